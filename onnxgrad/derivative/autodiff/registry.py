"""The table of gradient rules, keyed by ``(domain, op_type)`` with opset ranges.

A rule has one signature::

    rule(b: GradBuilder, node: NodeView, grads: list[str | None], needs: list[bool])
        -> sequence of str | None, one per node input

``grads[k]`` is the gradient flowing into output ``k`` (``None``: a symbolic zero);
``needs[i]`` says whether input ``i`` wants a gradient. The rule returns the gradient of
each input (``None`` for no gradient). Rules never handle broadcasting: for ops registered
with ``broadcast=True`` the engine reduces each returned gradient to its input's shape.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from onnx import NodeProto

from onnxgrad._onnx_utils import normalize_domain

if TYPE_CHECKING:
    from onnxgrad._onnx_utils import NameScope
    from onnxgrad.derivative.autodiff.builder import GradBuilder, NodeView

#: ``hook(node, scope)`` may append outputs to a forward node on the path (e.g. MaxPool's
#: Indices) so that its rule reuses them instead of computing them again.
ForwardHook = Callable[[NodeProto, "NameScope"], None]

RuleFunction = Callable[
    ["GradBuilder", "NodeView", list["str | None"], list[bool]], Sequence["str | None"]
]


@dataclass(frozen=True)
class Rule:
    """One gradient rule, valid for opsets ``since <= opset <= until``."""

    domain: str
    op_type: str
    since: int
    until: int | None
    function: RuleFunction
    broadcast: bool
    forward: ForwardHook | None = None

    def covers(self, opset: int) -> bool:
        return self.since <= opset and (self.until is None or opset <= self.until)


_RULES: dict[tuple[str, str], list[Rule]] = {}
_ZERO_GRADIENT: set[tuple[str, str]] = set()


def register(
    *op_types: str,
    domain: str = "",
    since: int = 1,
    until: int | None = None,
    broadcast: bool = False,
    forward: ForwardHook | None = None,
) -> Callable[[RuleFunction], RuleFunction]:
    """Decorator registering a rule for ``op_types`` over ``[since, until]``."""

    def decorate(function: RuleFunction) -> RuleFunction:
        for op_type in op_types:
            rules = _RULES.setdefault((domain, op_type), [])
            if any(_overlap(other, since, until) for other in rules):
                raise ValueError(f"gradient rules for {domain or 'ai.onnx'}::{op_type} overlap")
            rules.append(Rule(domain, op_type, since, until, function, broadcast, forward))
        return function

    return decorate


def _overlap(rule: Rule, since: int, until: int | None) -> bool:
    inf = float("inf")
    return rule.since <= (inf if until is None else until) and since <= (
        inf if rule.until is None else rule.until
    )


def register_zero_gradient(*op_types: str, domain: str = "") -> None:
    """Ops whose outputs carry no gradient: non-differentiable (Shape, comparisons...)
    or piecewise constant (Sign, Floor...). The engine treats their outputs as constants."""
    _ZERO_GRADIENT.update((domain, op) for op in op_types)


_NOT_DIFFERENTIABLE: dict[tuple[str, str], str] = {}


def register_not_differentiable(*op_types: str, domain: str = "", reason: str) -> None:
    """Ops with float inputs and outputs but no usable derivative (tree ensembles, lookup
    tables): a path through one makes the engine refuse the model, saying ``reason``."""
    _NOT_DIFFERENTIABLE.update(((domain, op), reason) for op in op_types)


def not_differentiable_reason(domain: str, op_type: str) -> str | None:
    """Why ``op_type`` has no derivative, or ``None`` when it may have one."""
    load_rules()
    return _NOT_DIFFERENTIABLE.get((normalize_domain(domain), op_type))


def find_rule(domain: str, op_type: str, opset: int) -> Rule | None:
    """The rule covering ``opset``, or ``None``."""
    load_rules()
    domain = normalize_domain(domain)
    for rule in _RULES.get((domain, op_type), ()):
        if rule.covers(opset):
            return rule
    return None


def has_zero_gradient(domain: str, op_type: str) -> bool:
    load_rules()
    return (normalize_domain(domain), op_type) in _ZERO_GRADIENT


def registered_rules() -> list[Rule]:
    """Every registered rule, sorted by domain, op type and opset."""
    load_rules()
    rules = [r for group in _RULES.values() for r in group]
    return sorted(rules, key=lambda r: (r.domain, r.op_type, r.since))


_LOADED = False


def load_rules() -> None:
    """Import every module of :mod:`onnxgrad.derivative.autodiff.rules` once."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    from onnxgrad.derivative.autodiff import rules

    for module in pkgutil.iter_modules(rules.__path__):
        importlib.import_module(f"{rules.__name__}.{module.name}")
