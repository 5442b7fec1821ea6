"""Which weights a training run trains by default, and why a model offers none.

The default weights of a loss put on output ``o`` are the weights of
:func:`onnxgrad.get_train_initializer` restricted to the part of the model computing ``o``:
``{w : d o / d w`` flows through differentiable edges``}``. On a model with several outputs
the weights that only feed other outputs would get no gradient; they are left out rather
than refused. Weights the user names are checked, not filtered.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from onnx import GraphProto, ModelProto, TensorProto

from onnxgrad._onnx_utils import FLOAT_TYPES, subgraphs
from onnxgrad.graph._differentiable import differentiable_values, model_opsets, value_elem_types


def weights_reaching(model: ModelProto, output: str, weights: Sequence[str]) -> tuple[str, ...]:
    """The names of ``weights`` (kept in order) that reach ``output`` through differentiable
    edges; ``ValueError`` when none does."""
    if len(model.graph.output) == 1 and model.graph.output[0].name == output:
        return tuple(weights)
    reaching = differentiable_values(
        model.graph, model_opsets(model), value_elem_types(model), outputs=[output]
    )
    kept = tuple(w for w in weights if w in reaching)
    if not kept:
        raise ValueError(
            f"no weight reaches the output {output!r} the loss is put on: the model's weights "
            f"{_shown(weights)} only feed its other outputs "
            f"{[o.name for o in model.graph.output if o.name != output]}; choose another output"
        )
    return kept


def no_weight_error(model: ModelProto) -> ValueError:
    """The error of a model with no weight to train, naming the likely causes."""
    graphs = list(_all_graphs(model.graph))
    causes = []
    constants = [
        (node.name or node.output[0], tuple(node.attribute[0].t.dims))
        for g in graphs
        for node in g.node
        if _holds_float_tensor(node)
    ]
    if constants:
        name, dims = max(constants, key=lambda c: int(np.prod(c[1], dtype=np.int64)))
        causes.append(
            f"{len(constants)} float Constant nodes hold tensors (the largest: {name!r} of "
            f"shape {list(dims)}) that reach no output through a differentiable input, so "
            "normalisation (onnxgrad.normalize) keeps them as constants"
        )
    initializers = [i for g in graphs for i in g.initializer]
    floats = [i.name for i in initializers if i.data_type in FLOAT_TYPES]
    if initializers and not floats:
        kinds = sorted({TensorProto.DataType.Name(i.data_type).lower() for i in initializers})
        causes.append(
            f"its {len(initializers)} initializers are all {'/'.join(kinds)} (a quantized "
            "model?): only float tensors are trained"
        )
    elif floats:
        causes.extend(_float_initializer_causes(model, floats))
    if not causes:
        causes.append("it has no initializer and no Constant tensor: it computes from its inputs")
    return ValueError("the model has no weight to train: " + "; ".join(causes))


def _float_initializer_causes(model: ModelProto, floats: list[str]) -> list[str]:
    """Why none of the float initializers ``floats`` is a weight: those a change of which
    reaches no output through differentiable inputs, and those that do but play no
    parameter role (:mod:`onnxgrad.graph.weight_roles`)."""
    live = differentiable_values(model.graph, model_opsets(model), value_elem_types(model))
    reaching = [n for n in floats if n in live]
    dead = [n for n in floats if n not in live]
    causes = []
    if dead:
        causes.append(
            f"its float initializers {_shown(dead)} reach no output through a "
            "differentiable input (they are shapes, axes, scales, bounds or statistics)"
        )
    if reaching:
        causes.append(
            f"its float initializers {_shown(reaching)} reach an output but play no parameter "
            "role (fixed transforms such as a DFT basis or a mel filterbank, epsilons, fill "
            "values, fitted statistics: onnxgrad.graph.weight_roles); name them "
            "(weights=[...]) to train them"
        )
    return causes


def _holds_float_tensor(node) -> bool:
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
        return False
    attribute = node.attribute[0] if len(node.attribute) == 1 else None
    return (
        attribute is not None
        and attribute.name == "value"
        and attribute.t.data_type in FLOAT_TYPES
        and int(np.prod(attribute.t.dims, dtype=np.int64)) > 1
    )


def _all_graphs(graph: GraphProto) -> Iterable[GraphProto]:
    yield graph
    for node in graph.node:
        for sub in subgraphs(node):
            yield from _all_graphs(sub)


def _shown(names: Sequence[str], limit: int = 8) -> str:
    names = list(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{names[:limit]}{more}"


__all__ = ["no_weight_error", "weights_reaching"]
