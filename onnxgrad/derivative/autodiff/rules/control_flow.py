r"""Control flow: ``If``.

A branch reads outer values ``u`` (its captured inputs); for ``y = If(c, f(u), h(u))``

.. math:: \bar u = \mathrm{If}(c,\; (\partial f / \partial u)^\top \bar y,\;
          (\partial h / \partial u)^\top \bar y)

Each branch of the gradient ``If`` recomputes its forward branch and appends the backward
nodes a nested engine emits for it; a branch that does not depend on some ``u`` returns
zeros of ``u``'s shape, so both branches return the same values. ``Loop`` and ``Scan`` have
no rule yet: the engine reports them by name.
"""

from __future__ import annotations

from onnx import GraphProto, NodeProto, helper

from onnxgrad._onnx_utils import zeros_like_nodes
from onnxgrad.derivative.autodiff.builder import GradBuilder, NodeView
from onnxgrad.derivative.autodiff.registry import register
from onnxgrad.derivative.autodiff.value_types import value_info
from onnxgrad.graph.select import prune_graph


@register("If", since=13)
def if_grad(b, node, grads, needs):
    n_inputs = len(node.inputs)
    sources = [name for name, need in zip(node.captured, needs[n_inputs:]) if need]
    if not sources:
        return []
    branches = {
        attr: _branch_gradient(b, node, node.attr(attr), grads, sources)
        for attr in ("then_branch", "else_branch")
    }
    results = b.op("If", node.inputs[0], outputs=len(sources), **branches)
    by_source = dict(zip(sources, [results] if len(sources) == 1 else results))
    return [None] * n_inputs + [by_source.get(name) for name in node.captured]


def _branch_gradient(
    b: GradBuilder, node: NodeView, branch: GraphProto, grads: list, sources: list[str]
) -> GraphProto:
    """The branch's forward nodes, then its backward nodes, returning one gradient per
    source (zeros where the branch does not depend on it)."""
    seeds = {out.name: g for out, g in zip(branch.output, grads) if g is not None}
    backward, gradients = b.differentiate_subgraph(branch, sources, seeds)
    outputs, tail = [], []
    for source in sources:
        name = b.unique_name(f"{source}_branch_grad")
        tail += _result_nodes(b, source, gradients[source], name)
        outputs.append(value_info(name, b.value_type(source)))
    graph = helper.make_graph(
        [*branch.node, *backward, *tail],
        b.unique_name(f"{branch.name or 'branch'}_grad"),
        [],
        outputs,
        list(branch.initializer),
    )
    prune_graph(graph, keep_inputs=True)
    return graph


def _result_nodes(b: GradBuilder, source: str, grad: str | None, name: str) -> list[NodeProto]:
    if grad is None:
        return zeros_like_nodes(source, name, b.dtype(source), b.names, b.node_names)
    return [helper.make_node("Identity", [grad], [name], name=b.unique_node_name("Identity"))]
