r"""Forward mode by transposition: Jacobian-vector and Hessian-vector products.

For ``y = f(x)`` the native reverse mode builds ``G(x, \bar y) = J(x)^\top \bar y``, which is
linear in ``\bar y``. Its own vector-Jacobian product with respect to ``\bar y``, seeded with
a tangent ``\dot x``, is

.. math:: \frac{\partial}{\partial \bar y} \langle J^\top \bar y, \dot x \rangle = J \dot x,

the Jacobian-vector product, whatever ``\bar y`` is where ``G`` is linear in it. A rule may
read ``\bar y`` by value besides, but only where its forward values are not finite (Softmax
reads a NaN row of its output, a fully masked attention row, as 0 where that row's cotangent
is all zero): the cotangent fed is ones, and the cotangents it gives inside the graph may
still cancel to zero rows (ones are constant along a softmax row), so a rule whose gradient
changed branch on a zero cotangent of finite values would make the transposition wrong
(tests/derivative/test_zero_cotangent_rows.py). Every
operator with a reverse rule, whose rule emits operators with rules themselves, thus gets
tangents without a tangent rule. Applied to the gradient graph of a scalar loss it gives
Hessian-vector products, ``H \dot x = J_{\nabla f} \dot x`` (forward-over-reverse).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from onnx import ModelProto, ValueInfoProto, helper, numpy_helper

from onnxgrad._onnx_utils import (
    FLOAT_TYPES,
    ModelLike,
    NameScope,
    all_names,
    copy_message,
    finalize_model,
    np_dtype,
    replace_repeated,
    zeros_like_nodes,
)
from onnxgrad.derivative.api import derive_in_place
from onnxgrad.derivative.autodiff.tangent import NoTangentRule
from onnxgrad.derivative.native import NoFloatPath
from onnxgrad.derivative.options import DerivativeOptions
from onnxgrad.derivative.seeds import batch_seeds, check_seeds
from onnxgrad.derivative.tangent_graph import tangent_jvp
from onnxgrad.graph._scopes import defined_names
from onnxgrad.graph.names import rename_values
from onnxgrad.graph.select import prune_graph
from onnxgrad.normalize import normalized_model
from onnxgrad.normalize.ranks import refined_ranks


def onnx_jvp(
    model: ModelLike,
    weights: Sequence[str] | None = (),
    inputs: Sequence[str] | None = None,
    keep_outputs: bool = False,
    seeds: int | None = None,
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
    :param seeds: ``k`` tangents per run: every ``<x>_tangent`` input and ``<y>_tangent``
        output gets a leading axis of size ``k``
        (:mod:`onnxgrad.derivative.seeds`); ``None``: one tangent, no extra axis.
    """
    seeds = check_seeds(seeds)
    checked = seeds is None  # batch_seeds checks the batched graph
    return _batched(*_jvp(normalized_model(model), weights, inputs, keep_outputs, checked), seeds)


def _batched(model: ModelProto, seed_inputs, results, seeds: int | None) -> ModelProto:
    return model if seeds is None else batch_seeds(model, seed_inputs, results, seeds)


def _jvp(
    model: ModelProto,
    weights: Sequence[str] | None,
    inputs: Sequence[str] | None,
    keep_outputs: bool = False,
    checked: bool = True,
) -> tuple[ModelProto, list[str], list[str]]:
    """:func:`onnx_jvp` of a normalised model the caller owns, its tangent inputs and its
    tangent outputs: by tangent propagation where every node on the way has a tangent rule
    (:mod:`onnxgrad.derivative.tangent_graph`), else by transposition (``checked``: onnx's
    full check of the result, off for one checked once rewritten)."""
    try:
        return tangent_jvp(model, weights, inputs, keep_outputs, checked)
    except NoTangentRule:
        return _transposed_jvp(model, weights, inputs, keep_outputs, checked)


def _transposed_jvp(
    model: ModelProto,
    weights: Sequence[str] | None,
    inputs: Sequence[str] | None,
    keep_outputs: bool = False,
    checked: bool = True,
) -> tuple[ModelProto, list[str], list[str]]:
    """The JVP graph as the transposition of the reverse graph.

    The reverse graph keeps the model's outputs (so that the transposed one computes them,
    under the names it gave them, for the cotangents' shapes); the transposed graph keeps
    them too, and differentiates the reverse gradients only. The reverse graph's ranks are
    declared where onnx's inference stops (a gradient reshaped by a computed shape of static
    length), as normalisation declares a model's: the transposition's rules read them."""
    originals = _private_output_names(model)
    outputs = [o for o in model.graph.output if o.type.tensor_type.elem_type in FLOAT_TYPES]
    reverse = derive_in_place(
        copy_message(model), weights=weights, inputs=inputs,
        options=DerivativeOptions.KeepOutputs, order_leaves=False, checked=False,
    )  # fmt: skip
    _declare_again(reverse, model.graph.value_info)
    refined_ranks(reverse)
    sources = _gradient_sources(reverse)
    reverse_inputs = {i.name for i in reverse.graph.input}
    cotangents = {f"{o.name}_grad": o.name for o in model.graph.output}
    cotangents = {c: o for c, o in cotangents.items() if c in reverse_inputs}
    transposed = derive_in_place(
        reverse, weights=[], inputs=list(cotangents), options=DerivativeOptions.KeepOutputs,
        outputs=[f"{s}_grad" for s in sources], structural_zeros=True, checked=False,
    )  # fmt: skip
    tangents = _tangent_model(transposed, sources, outputs, cotangents, keep_outputs, originals)
    result = transposed
    _restore_output_names(result.graph, originals)
    seed_inputs = [i.name for i in result.graph.input if i.name in tangents]
    results = [o.name for o in result.graph.output if o.name in tangents]
    return finalize_model(result, check=checked), seed_inputs, results


def _declare_again(gradient: ModelProto, declared) -> None:
    """Give the forward values the gradient graph still computes their declared types back,
    in place: where onnx's inference stops (a paddle2onnx ``Conv`` after a ``Reshape`` of
    computed shape), normalisation declared the rank, which differentiating the gradient
    again (the transposition) reads as the first derivative did."""
    graph = gradient.graph
    computed = {o for node in graph.node for o in node.output}
    typed = {v.name for v in [*graph.value_info, *graph.input, *graph.output]}
    graph.value_info.extend(v for v in declared if v.name in computed and v.name not in typed)


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


def _restore_output_names(graph, originals: dict[str, str]) -> None:
    """Give the model's outputs back their names (``{fresh: original}``), in place, first
    moving aside the values the derivations gave those names: the reverse graph's
    ``<x>_grad`` where the model is itself a gradient (``onnx_hvp``), which the node that
    computes it (a Scan kept for the states it saves) may still output."""
    taken = defined_names(graph) & set(originals.values())
    scope = NameScope(all_names(graph))
    rename_values(graph, {name: scope.unique(f"{name}_transposed") for name in taken})
    rename_values(graph, originals)


def onnx_hvp(
    model: ModelLike,
    weights: Sequence[str] | None = (),
    inputs: Sequence[str] | None = None,
    loss: str | None = None,
    label: str | None = None,
    seeds: int | None = None,
) -> ModelProto:
    """Hessian-vector products of a scalar loss, by forward-over-reverse.

    The graph takes the model's inputs, the differentiated weights and one ``<x>_tangent``
    per differentiated input or weight ``x``, and returns the tangents of the gradients,
    ``<x>_grad_tangent``: ``H v`` where ``H`` is the Hessian of the loss with respect to all
    of them together and ``v`` the stacked tangents. ``loss``/``label`` are those of
    ``onnx_derivative(options=DerivativeOptions.Loss)``; ``seeds=k``: ``k`` tangents
    per run, as for :func:`onnx_jvp`.
    """
    seeds = check_seeds(seeds)
    normalized = normalized_model(model)
    declared = list(normalized.graph.value_info)
    gradient = derive_in_place(
        normalized, weights=weights, inputs=inputs,
        options=DerivativeOptions.Loss, loss=loss, label=label, checked=False,
    )  # fmt: skip
    _declare_again(gradient, declared)
    sources = _gradient_sources(gradient)
    wanted = {f"{s}_grad" for s in sources}
    replace_repeated(gradient.graph.output, [o for o in gradient.graph.output if o.name in wanted])
    try:
        jvp = _jvp(gradient, weights=[], inputs=sources, checked=seeds is None)
    except NoFloatPath:  # the first derivative was not refused: the second is 0
        jvp = _zero_hvp(gradient, sources, checked=seeds is None)
    return _batched(*jvp, seeds)


def _zero_hvp(
    gradient: ModelProto, sources: list[str], checked: bool
) -> tuple[ModelProto, list[str], list[str]]:
    r"""The HVP model, rewritten in place from the loss's ``gradient`` graph, where no
    gradient depends on a source through float values (:class:`NoFloatPath`: only through
    comparisons or indices, as ReLU's mask, or not at all, as a linear model's):
    ``\nabla f`` is constant in the sources wherever it is differentiable, so
    ``H v = 0`` there. Each ``<x>_grad_tangent`` is ``ConstantOfShape(Shape(x), 0)``,
    zeros of x's type however ``v`` is (no product with it: no NaN from an infinite ``v``);
    the inputs are the gradient's, then one ``<x>_tangent`` per source, as :func:`_jvp`'s."""
    graph = gradient.graph
    scope = NameScope(all_names(graph))
    declared = {i.name: i for i in graph.input}
    tangents, results, nodes = [], [], []
    for source in sources:
        tangent = copy_message(declared[source])
        tangent.name = scope.unique(f"{source}_tangent")
        tangents.append(tangent)
        result = copy_message(declared[source])
        result.name = scope.unique(f"{source}_grad_tangent")
        results.append(result)
        elem_type = result.type.tensor_type.elem_type
        nodes += zeros_like_nodes(source, result.name, elem_type, scope)
    graph.input.extend(tangents)
    replace_repeated(graph.output, results)
    replace_repeated(graph.node, nodes)
    graph.ClearField("value_info")
    prune_graph(graph, keep_inputs=True)
    model = finalize_model(gradient, check=checked)
    return model, [t.name for t in tangents], [r.name for r in results]


def _gradient_sources(reverse: ModelProto) -> list[str]:
    """The differentiated inputs and weights of a reverse gradient graph, in order."""
    inputs = {i.name for i in reverse.graph.input}
    return [
        o.name[: -len("_grad")]
        for o in reverse.graph.output
        if o.name.endswith("_grad") and o.name[: -len("_grad")] in inputs
    ]


def _tangent_model(
    transposed: ModelProto,
    sources: list[str],
    outputs: list[ValueInfoProto],
    cotangents: dict[str, str],
    keep_outputs: bool,
    originals: dict[str, str],
) -> set[str]:
    """Rename, in place, the transposed graph's seeds and results to tangents (returns
    their names), and feed ones to the cotangent inputs ``{cotangent: output}`` it may
    still read (for their shapes, or a rule's test of a zero cotangent: see the module's
    docstring)."""
    graph = transposed.graph
    scope = NameScope(all_names(graph))
    renames = {f"{s}_grad_grad": scope.unique(f"{s}_tangent") for s in sources}
    renames |= {
        f"{o.name}_grad_grad": scope.unique(f"{originals.get(o.name, o.name)}_tangent")
        for o in outputs
    }
    declared = {i.name: i.type.tensor_type.elem_type for i in graph.input}
    nodes = []
    for cotangent, output in cotangents.items():
        one = numpy_helper.from_array(np.array([1], dtype=np_dtype(declared[cotangent])))
        shape = scope.unique(f"{output}_shape")
        nodes.append(helper.make_node("Shape", [output], [shape]))
        nodes.append(helper.make_node("ConstantOfShape", [shape], [cotangent], value=one))
    replace_repeated(graph.input, [i for i in graph.input if i.name not in cotangents])
    replace_repeated(graph.node, _topological(nodes + list(graph.node), graph))
    kept = {o.name for o in outputs} if keep_outputs else set()
    tangents = [o for o in graph.output if o.name in renames]
    replace_repeated(graph.output, tangents + [o for o in graph.output if o.name in kept])
    prune_graph(graph, keep_inputs=True)
    rename_values(graph, renames)
    return set(renames.values())


def _topological(nodes: list, graph) -> list:
    """``nodes`` ordered so that each comes after the producers of its inputs (the graph's
    inputs already exclude the cotangents that ``nodes`` now compute)."""
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
