"""Artifacts: a model prepared once for training by any inference runtime, and its files.

:mod:`.generate` writes the train, eval and inference models with their checkpoint and
merges a trained checkpoint back; :mod:`.checkpoint` is the checkpoint format,
:mod:`.manifest` reads ``artifacts.json`` as untrusted input, :mod:`.webgpu` prepares the
graphs for onnxruntime-web's WebGPU provider and :mod:`.onnx_adapter` writes onnxruntime's
adapter files.
"""
