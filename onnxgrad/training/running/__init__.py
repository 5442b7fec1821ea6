"""Running: the train steps executed by onnxruntime on a device, fed batch by batch.

:mod:`.runner` keeps the training state on the device and runs the steps with IOBinding;
:mod:`.session_options` and :mod:`.cpu_arena` configure its sessions; :mod:`.devices` and
:mod:`.ort_devices` name devices; :mod:`.data` and :mod:`.feeds` cut the batches;
:mod:`.distributed` runs one session per rank of ``torch.distributed``.
"""
