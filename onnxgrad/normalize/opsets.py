"""The default-domain opset the gradient rules and the training graphs are written for,
and the lowering of ``ai.onnx.ml`` operators into standard ONNX."""

from __future__ import annotations

from onnx import ModelProto, helper

from onnxgrad._onnx_utils import MIN_OPSET, default_opset
from onnxgrad.graph.ml_lowering import lower_ml_operators, lowerable_nodes
from onnxgrad.graph.opset_raise import raised_opset

#: Models below this default-domain opset are raised to it: the rules, losses and updates
#: are written for opset 13 and later (axes as inputs, the LSTM broadcast undone, Resize-13).
RULES_OPSET = MIN_OPSET


def rules_opset(model: ModelProto) -> ModelProto:
    """``model`` raised to :data:`RULES_OPSET` by onnx's version converter when it imports an
    older default domain (``ValueError`` naming both opsets when the converter cannot). A
    model importing ``ai.onnx.ml`` alone (an old converter's classifier) has no default-domain
    node: it imports :data:`RULES_OPSET`, which its lowering and gradient are written in."""
    if not any(op.domain in ("", "ai.onnx") for op in model.opset_import):
        model.opset_import.add(domain="", version=RULES_OPSET)
        needed = helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
        model.ir_version = max(model.ir_version, needed)
        return model
    if default_opset(model) >= RULES_OPSET:
        return model
    if model.ir_version < 4:  # IR 3 lists initializers as inputs; the converter needs that
        model.ir_version = 4  # or IR 4, which only stops requiring it
    return raised_opset(model, RULES_OPSET)


def lowered_ml(model: ModelProto) -> ModelProto:
    """``model`` with its ``ai.onnx.ml`` operators lowered into standard ONNX (the ZipMap
    dropped, its probability tensor exposed as ``probabilities``); see
    :func:`onnxgrad.lower_ml_operators`."""
    if not lowerable_nodes(model):
        return model
    return lower_ml_operators(model, keep_zipmap=False)
