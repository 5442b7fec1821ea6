"""The rule table: every case against finite differences, and every rule has a case."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import tests.derivative.autodiff as cases_package
from onnxgrad.derivative.autodiff import attention_tiles
from onnxgrad.derivative.autodiff.registry import registered_rules
from tests.derivative.autodiff.gradcheck import check_case


def all_cases():
    cases = []
    for module in pkgutil.iter_modules(cases_package.__path__):
        if module.name.startswith("cases_"):
            cases.extend(importlib.import_module(f"{cases_package.__name__}.{module.name}").CASES)
    return cases


CASES = all_cases()


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule_against_finite_differences(case, dynamic):
    if dynamic and not case.dynamic_shapes:
        pytest.skip(f"{case.id} runs with static shapes only")
    check_case(case, dynamic=dynamic)


def test_every_rule_has_a_case():
    """Every rule of a real operator has a case; the internal ``TiledAttention`` node (which
    exists only while a gradient is built) is checked by ``tests/derivative/
    test_attention_tiles.py`` against finite differences of the attention it replaces."""
    covered = {(c.domain, c.op_type, c.opset) for c in CASES}
    missing = [
        f"{r.domain or 'ai.onnx'}::{r.op_type} [{r.since}, {r.until or 'latest'}]"
        for r in registered_rules()
        if r.domain != attention_tiles.DOMAIN
        and not any(d == r.domain and op == r.op_type and r.covers(v) for d, op, v in covered)
    ]
    assert not missing, f"gradient rules without a table entry: {missing}"


def test_case_ids_are_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
