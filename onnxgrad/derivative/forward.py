r"""Forward mode by transposition: Jacobian-vector and Hessian-vector products.

For ``y = f(x)`` the native reverse mode builds ``G(x, \bar y) = J(x)^\top \bar y``, which is
linear in ``\bar y``. Its own vector-Jacobian product with respect to ``\bar y``, seeded with
a tangent ``\dot x``, is

.. math:: \frac{\partial}{\partial \bar y} \langle J^\top \bar y, \dot x \rangle = J \dot x,

the Jacobian-vector product, whatever ``\bar y`` is (zeros here). Every operator with a
reverse rule, whose rule emits operators with rules themselves, thus gets tangents without
a tangent rule. Applied to the gradient graph of a scalar loss it gives Hessian-vector
products, ``H \dot x = J_{\nabla f} \dot x`` (forward-over-reverse).
"""

from __future__ import annotations

from collections.abc import Sequence

from onnx import ModelProto, ValueInfoProto, helper

from onnxgrad._onnx_utils import (
    FLOAT_TYPES,
    ModelLike,
    NameScope,
    all_names,
    copy_message,
    finalize_model,
    replace_repeated,
)
from onnxgrad.derivative.api import derive_in_place
from onnxgrad.derivative.options import DerivativeOptions
from onnxgrad.graph.names import rename_values
from onnxgrad.graph.select import prune_graph
from onnxgrad.normalize import normalized_model


def onnx_jvp(
    model: ModelLike,
    weights: Sequence[str] | None = (),
    inputs: Sequence[str] | None = None,
    keep_outputs: bool = False,
) -> ModelProto:
    """The Jacobian-vector products of ``model`` as a standard ONNX graph.

    For outputs ``y_k = f_k(x, w)`` and tangents ``x_tangent``, ``w_tangent`` (new inputs, one
    per differentiated input or weight, same shape and type), the graph returns
    ``y_k_tangent = sum_i dy_k/dx_i . x_i_tangent`` for every float output.

    :param model: ModelProto or path; never modified.
    :param weights: initializers to differentiate (they become inputs); ``None`` means every
        trainable weight, the default ``()`` none.
    :param inputs: graph inputs to differentiate; ``None`` means every float input.
    :param keep_outputs: also return the original outputs, after the tangents.
    """
    return _jvp(normalized_model(model), weights, inputs, keep_outputs)


def _jvp(
    model: ModelProto,
    weights: Sequence[str] | None,
    inputs: Sequence[str] | None,
    keep_outputs: bool = False,
) -> ModelProto:
    """:func:`onnx_jvp` of a normalised model the caller owns."""
    originals = _private_output_names(model)
    reverse = derive_in_place(copy_message(model), weights=weights, inputs=inputs)
    sources = _gradient_sources(reverse)
    outputs = [o for o in model.graph.output if o.type.tensor_type.elem_type in FLOAT_TYPES]
    cotangents = [f"{o.name}_grad" for o in model.graph.output]
    differentiated = [f"{o.name}_grad" for o in outputs]
    transposed = derive_in_place(reverse, weights=[], inputs=differentiated)
    result = _tangent_model(
        model, transposed, sources, outputs, cotangents, keep_outputs, originals
    )
    rename_values(result.graph, originals)
    return finalize_model(result)


def _private_output_names(model: ModelProto) -> dict[str, str]:
    """Rename, in place, the outputs computed by nodes to fresh names, so that the names
    derived from them (``<y>_grad``, ``<y>_grad_grad``) cannot clash with the model's own
    values (a gradient graph's ``x_grad`` output, say); returns ``{fresh: original}``."""
    graph = model.graph
    scope = NameScope(all_names(graph))
    computed = {o for node in graph.node for o in node.output}
    renames = {
        o.name: scope.unique(f"jvp_output{k}")
        for k, o in enumerate(graph.output)
        if o.name in computed
    }
    rename_values(graph, renames)
    return {fresh: original for original, fresh in renames.items()}


def onnx_hvp(
    model: ModelLike,
    weights: Sequence[str] | None = (),
    inputs: Sequence[str] | None = None,
    loss: str | None = None,
    label: str | None = None,
) -> ModelProto:
    """Hessian-vector products of a scalar loss, by forward-over-reverse.

    The graph takes the model's inputs, the differentiated weights and one ``<x>_tangent``
    per differentiated input or weight ``x``, and returns the tangents of the gradients,
    ``<x>_grad_tangent``: ``H v`` where ``H`` is the Hessian of the loss with respect to all
    of them together and ``v`` the stacked tangents. ``loss``/``label`` are those of
    ``onnx_derivative(options=DerivativeOptions.Loss)``.
    """
    gradient = derive_in_place(
        normalized_model(model), weights=weights, inputs=inputs,
        options=DerivativeOptions.Loss, loss=loss, label=label,
    )  # fmt: skip
    sources = _gradient_sources(gradient)
    wanted = {f"{s}_grad" for s in sources}
    replace_repeated(gradient.graph.output, [o for o in gradient.graph.output if o.name in wanted])
    return _jvp(gradient, weights=[], inputs=sources)


def _gradient_sources(reverse: ModelProto) -> list[str]:
    """The differentiated inputs and weights of a reverse gradient graph, in order."""
    inputs = {i.name for i in reverse.graph.input}
    return [
        o.name[: -len("_grad")]
        for o in reverse.graph.output
        if o.name.endswith("_grad") and o.name[: -len("_grad")] in inputs
    ]


def _tangent_model(
    model: ModelProto,
    transposed: ModelProto,
    sources: list[str],
    outputs: list[ValueInfoProto],
    cotangents: list[str],
    keep_outputs: bool,
    originals: dict[str, str],
) -> ModelProto:
    """Rename the transposed graph's seeds and results to tangents, and feed zeros to the
    cotangent inputs it may still read (for their shapes only)."""
    graph = transposed.graph
    scope = NameScope(all_names(graph) | all_names(model.graph))
    renames = {f"{s}_grad_grad": scope.unique(f"{s}_tangent") for s in sources}
    renames |= {
        f"{o.name}_grad_grad": scope.unique(f"{originals.get(o.name, o.name)}_tangent")
        for o in outputs
    }
    known = {o for node in graph.node for o in node.output}
    nodes = [n for n in model.graph.node if known.isdisjoint(n.output)]
    for cotangent, output in zip(cotangents, model.graph.output):
        shape, zero = scope.unique(f"{output.name}_shape"), scope.unique(f"{cotangent}_zero")
        nodes.append(helper.make_node("Shape", [output.name], [shape]))
        nodes.append(helper.make_node("ConstantOfShape", [shape], [zero]))
        nodes.append(helper.make_node("CastLike", [zero, output.name], [cotangent]))
    new_nodes = nodes + list(graph.node)
    replace_repeated(graph.node, _topological(new_nodes, graph))
    replace_repeated(graph.input, [i for i in graph.input if i.name not in set(cotangents)])
    known_inits = {i.name for i in graph.initializer}
    graph.initializer.extend(i for i in model.graph.initializer if i.name not in known_inits)
    tangents = [o for o in graph.output if o.name in renames]
    if keep_outputs:
        tangents += list(outputs)
    replace_repeated(graph.output, tangents)
    prune_graph(graph, keep_inputs=True)
    inputs = {i.name for i in graph.input}
    replace_repeated(graph.initializer, [i for i in graph.initializer if i.name not in inputs])
    rename_values(graph, renames)
    return transposed


def _topological(nodes: list, graph) -> list:
    """``nodes`` ordered so that each comes after the producers of its inputs."""
    from onnxgrad.graph._scopes import node_inputs

    available = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    producers = {o: n for n in nodes for o in n.output}
    ordered, done, pending = [], set(), list(nodes)
    while pending:
        remaining = []
        for node in pending:
            needs = [i for i in node_inputs(node) if i in producers and i not in available]
            if all(i in done for i in needs):
                ordered.append(node)
                done.update(node.output)
            else:
                remaining.append(node)
        if len(remaining) == len(pending):
            raise AssertionError("the tangent graph has a cycle")
        pending = remaining
    return ordered
