"""The model as the user has it, made regular once, at the entry.

Models arrive as shipped: weights stored as ``Constant`` nodes, ``-1`` or unnamed dims,
declared shapes that disagree with what the model computes, old opsets, ``ai.onnx.ml``
operators, onnxruntime's fused and quantized ``com.microsoft`` operators.
:func:`normalized_model` runs one pipeline of small passes
(:data:`~onnxgrad.normalize.pipeline.PASSES`) that turns such a model into the regular form
every later layer assumes; every public entry point (``info``, ``onnx_derivative``,
``onnx_jvp``/``onnx_hvp``, ``add_loss_output``, ``get_train_initializer``, the estimators,
``train``, ``artifacts``, ``generate_artifacts``, ``make_train_step``...) calls it at its
entry, once: an entry built on another calls that one's normalised core
(:func:`onnxgrad._entries.normalizing`: ``make_train_step.normalized``), and the
engine and the train step below never normalise. Normalising a normalised model changes
nothing (tested), so two entries called in turn (``add_lora`` then ``generate_artifacts``)
agree.
"""

from onnxgrad.normalize.pipeline import PASSES, Pass, normalize_in_place, normalized_model

__all__ = ["PASSES", "Pass", "normalize_in_place", "normalized_model"]
