"""Step building: the loss, penalty, gradient and update of one training step as ONNX graphs.

:mod:`.composition` fuses them into one train step (:mod:`.train_step` describes its state
inputs and update), or two graphs for data-parallel training (:mod:`.split_step`); the
learning objects (:mod:`.losses`, :mod:`.penalties`, :mod:`.learning_rate`) say what the
step computes, and :mod:`.node_order`, :mod:`.update_gates` and :mod:`._in_place` how it
runs in bounded memory. Nothing here imports onnxruntime.
"""
