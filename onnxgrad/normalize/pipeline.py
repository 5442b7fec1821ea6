"""The normalisation pipeline: an ordered list of small passes run once at every entry.

Each :class:`Pass` is a function ``ModelProto -> ModelProto`` that may rewrite its argument
(the pipeline hands it a private copy) and returns the model for the next pass; it leaves
a model that needs nothing from it as it is, so normalising twice gives the same model.
A pass marked ``facts`` also takes the pipeline's :class:`~onnxgrad.normalize.facts.Facts`
(what an earlier pass learnt, such as one shape inference's verdict, so that a later one
need not infer again) and keeps them true; after any other pass they are forgotten.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from onnx import ModelProto

from onnxgrad._onnx_utils import ModelLike, load_model
from onnxgrad.normalize import (
    bfloat16,
    constants,
    contrib,
    dims,
    folding,
    opsets,
    quantized,
    ranks,
    shapes,
    structure,
)
from onnxgrad.normalize.facts import Facts


@dataclass(frozen=True)
class Pass:
    """One step of the pipeline: ``run`` requires what the passes before it ensure."""

    name: str
    run: Callable[[ModelProto], ModelProto]
    ensures: str
    #: ``run(model, facts)`` reads and keeps :class:`Facts` true (else they are forgotten)
    facts: bool = False


PASSES: tuple[Pass, ...] = (
    Pass("dynamic_dims", dims.dynamic_dims, "no negative declared dimension (-1 is dynamic)"),
    Pass(
        "structure",
        structure.checked_structure,
        "domains imported, every value produced once, nodes in topological order, "
        "onnx's checker passes",
    ),
    Pass(
        "constant_weights",
        constants.promote_constant_weights,
        "float weights stored as Constant nodes are initializers",
    ),
    Pass("opset", opsets.rules_opset, f"default-domain opset >= {opsets.RULES_OPSET}"),
    Pass("ml_lowering", opsets.lowered_ml, "no lowerable ai.onnx.ml operator"),
    Pass("contrib_lowering", contrib.lowered_contrib, "no fused com.microsoft transformer op"),
    Pass(
        "quantized_lowering", quantized.lowered_quantized, "quantized ops over dequantized weights"
    ),
    Pass(
        "bfloat16_compute",
        bfloat16.bfloat16_in_float32,
        "bfloat16 operators compute in float32, results rounded to bfloat16",
    ),
    Pass(
        "declared_shapes",
        shapes.reconciled_shapes,
        "declared output and value shapes agree with onnx's shape inference",
        facts=True,
    ),
    Pass(
        "integer_constants",
        folding.folded_integer_constants,
        "integer expressions of constants (pads, shapes, axes) are Constant nodes",
        facts=True,
    ),
    Pass(
        "ranks",
        ranks.refined_ranks,
        "ranks fixed by static Concat lengths, schemas, If branches and uses are declared",
        facts=True,
    ),
)


def normalized_model(model: ModelLike, facts: Facts | None = None) -> ModelProto:
    """A private copy of ``model`` (a ModelProto or a path) made regular by :data:`PASSES`;
    ``ValueError`` names what makes it unusable (node, value, opset). ``facts``, when
    given, hold what the passes know of the result (such as its shape inference, which
    the gradient engine then reads instead of inferring again)."""
    return normalize_in_place(load_model(model), facts)


def normalize_in_place(model: ModelProto, facts: Facts | None = None) -> ModelProto:
    """:func:`normalized_model` of a model the caller already owns (it may be rewritten)."""
    facts = Facts() if facts is None else facts
    facts.forget()
    for step in PASSES:
        if step.facts:
            model = step.run(model, facts)
        else:
            model = step.run(model)
            facts.forget()
    return model
