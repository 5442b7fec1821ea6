"""What normalisation does with onnxruntime's deployed operators, in words for ``info``."""

from __future__ import annotations

from collections import Counter

from onnx import ModelProto

from onnxgrad._onnx_utils import normalize_domain
from onnxgrad.normalize.contrib import CONTRIB_LOWERINGS
from onnxgrad.normalize.quantized import QUANTIZED_LOWERINGS
from onnxgrad.normalize.ste import EXACT
from onnxgrad.normalize.ste import STRAIGHT_THROUGH as STRAIGHT_THROUGH_MODE

#: operators whose integer weights stay frozen, the float inputs trained through them
FROZEN_WEIGHTS = frozenset(
    {"MatMulNBits", "QLinearMatMul", "QLinearConv", "DynamicQuantizeMatMul", "MatMulInteger",
     "ConvInteger", "DynamicQuantizeLSTM"}
)  # fmt: skip
#: the converters' operators (scikit-learn's...), lowered by onnxgrad.graph.ml_lowering
CONVERTER_DOMAIN = "ai.onnx.ml"
#: activation quantization: the straight-through estimator or rounding held
STRAIGHT_THROUGH = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})


#: what becomes of a rounded activation, by ``quantized_activations=``
ROUNDING = {
    STRAIGHT_THROUGH_MODE: "activations: straight-through estimator (identity inside the "
    "quantization range, the default for training); weights: frozen",
    EXACT: "activations: the file's own derivative (rounding held: zero through the codes, "
    "a dynamic scale still differentiated); weights: frozen",
}


def operator_status(
    domain: str, op_type: str, remaining: set[tuple[str, str]], mode: str = STRAIGHT_THROUGH_MODE
) -> str:
    """``lowered and trained``, ``frozen ...``, how activations are differentiated under
    ``quantized_activations=mode``, or ``refused ...``."""
    key = (normalize_domain(domain), op_type)
    if key in remaining and key[0]:
        return "refused: no lowering to standard ONNX (no gradient)"
    if op_type in FROZEN_WEIGHTS:
        return "lowered over its dequantized weight: integer weight, scales and zero points frozen"
    if op_type in STRAIGHT_THROUGH:
        return ROUNDING[mode]
    if key in CONTRIB_LOWERINGS or key in QUANTIZED_LOWERINGS:
        return "lowered to standard ONNX and trained"
    return ""


def deployed_operators(original: ModelProto) -> Counter:
    """``{(domain, op_type): count}`` of the deployed (fused or quantized) operators of a
    model as it was given (before normalisation rewrites it); the converters' ``ai.onnx.ml``
    operators are not among them (``info`` lists them on their own)."""
    return Counter(
        (normalize_domain(n.domain), n.op_type)
        for n in original.graph.node
        if normalize_domain(n.domain) not in ("", CONVERTER_DOMAIN)
        or n.op_type in FROZEN_WEIGHTS | STRAIGHT_THROUGH
        or ("", n.op_type) in CONTRIB_LOWERINGS
    )


def deployed_operator_lines(
    counts: Counter, model: ModelProto, mode: str = STRAIGHT_THROUGH_MODE
) -> list[str]:
    """One line per deployed operator type (:func:`deployed_operators`) saying what the
    ``model`` normalised with ``quantized_activations=mode`` does with it."""
    remaining = {(normalize_domain(n.domain), n.op_type) for n in model.graph.node}
    if not counts:
        return []
    lines = ["deployed operators (onnxruntime's fused and quantized forms):"]
    for (domain, op), n in sorted(counts.items()):
        label = f"{domain}::{op}" if domain else op
        lines.append(f"  {label} x{n}: {operator_status(domain, op, remaining, mode)}")
    return lines
