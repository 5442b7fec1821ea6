"""The names both backends give their results (see :mod:`onnxgrad.derivative.api`).

A result has ``<source>_grad`` outputs, ``<output>_grad`` seed inputs (``Zero``) and keeps
some original outputs; an intermediate value of the model already holding one of those
names (typically ``w_grad`` when a gradient graph is differentiated again) is renamed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from onnx import GraphProto, ValueInfoProto

from onnxgrad._onnx_utils import NameScope, all_names
from onnxgrad.derivative.api import DerivativeRequest
from onnxgrad.derivative.options import DerivativeOptions
from onnxgrad.graph.names import rename_values


def kept_outputs(
    outputs: Sequence[ValueInfoProto], request: DerivativeRequest
) -> list[ValueInfoProto]:
    """The model outputs the result returns after the gradients."""
    if DerivativeOptions.KeepOutputs in request.options:
        return list(outputs)
    if DerivativeOptions.Loss in request.options:
        return [o for o in outputs if o.name == request.loss]
    return []


def seeds_are_inputs(options: DerivativeOptions) -> bool:
    """Whether the output gradients are ``<output>_grad`` graph inputs (``Zero``)."""
    return not options & (
        DerivativeOptions.FillGrad | DerivativeOptions.Loss | DerivativeOptions.KeepYieldOp
    )


def free_gradient_names(
    graph: GraphProto,
    request: DerivativeRequest,
    also: Callable[[str], object] = lambda name: False,
) -> dict[str, str]:
    """Rename, in place, the intermediates named like a result's inputs or outputs (and
    those ``also`` selects); returns ``{old: new}``.

    A clash with an input, an initializer or a kept output, or two results sharing a
    name, is a ``ValueError`` naming them.
    """
    wanted = [f"{name}_grad" for name in (*request.inputs, *request.weights)]
    if seeds_are_inputs(request.options):
        wanted += [f"{o.name}_grad" for o in graph.output if o.name in request.outputs]
    fixed = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    fixed |= {o.name for o in kept_outputs(graph.output, request)}
    seen: set[str] = set()
    clashes = []
    for name in wanted:
        if name in fixed or name in seen:
            clashes.append(name)
        seen.add(name)
    if clashes:
        raise ValueError(
            f"cannot name the gradient values {clashes}: the model already has inputs, "
            "initializers or kept outputs with these names, or two of them would share a name"
        )
    names = all_names(graph)
    scope = NameScope(names | set(wanted))
    wanted_set = set(wanted)
    renames = {
        name: scope.unique(f"{name}_fw")
        for name in sorted(names - fixed)
        if name in wanted_set or also(name)
    }
    if renames:
        rename_values(graph, renames)
    return renames
