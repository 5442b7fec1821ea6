"""Pure graph rewrites ``ModelProto -> ModelProto``: losses, weights, selection, text views.

Every public function accepts an ``onnx.ModelProto`` or the path of an ``.onnx`` file, never
modifies its argument, and returns a model that passes ``onnx.checker.check_model`` with
``full_check=True``, keeps the input's opsets and has an IR version onnxruntime-training
1.19.2 loads.
"""

from onnxgrad.graph import ml_svm  # noqa: F401  (registers the SVM lowerings)
from onnxgrad.graph.initializers import (
    add_initializer,
    get_train_initializer,
    replace_initializers_into_onnx,
)
from onnxgrad.graph.lora import add_lora, merge_lora
from onnxgrad.graph.loss import add_loss_output
from onnxgrad.graph.ml_lowering import lower_ml_operators
from onnxgrad.graph.names import onnx_rename_weights
from onnxgrad.graph.select import remove_unused_nodes, select_model_inputs_outputs
from onnxgrad.graph.text import onnx_simple_text_plot
from onnxgrad.graph.unreduced import unreduced_onnx_loss

__all__ = [
    "add_initializer",
    "add_lora",
    "add_loss_output",
    "get_train_initializer",
    "lower_ml_operators",
    "merge_lora",
    "onnx_rename_weights",
    "onnx_simple_text_plot",
    "remove_unused_nodes",
    "replace_initializers_into_onnx",
    "select_model_inputs_outputs",
    "unreduced_onnx_loss",
]
