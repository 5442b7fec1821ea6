"""Rule table entries at opsets 11 and 12: the elementwise, activation and linear-algebra
rules whose semantics did not change at opset 13, on a case of each op's own table
re-targeted to the lowest opset the op and the case's inputs allow."""

import re
from dataclasses import replace

from onnxgrad.derivative.autodiff.registry import find_rule
from tests.derivative.autodiff import (
    cases_activations,
    cases_arithmetic,
    cases_elementwise,
    cases_linalg,
    cases_unary,
)
from tests.derivative.autodiff.gradcheck import OpCase, case_model

#: rules that reduce a broadcast input themselves (Gemm's C): with unknown shapes that
#: needs ReduceSum's axes input, so opset 13
_UNDO_BROADCAST = {"Gemm"}


def _at_low_opset(case: OpCase) -> OpCase | None:
    """``case`` at the lowest opset (11 or 12) its op has a rule for and its model is
    valid at; ``None`` when there is none."""
    for opset in (11, 12):
        rule = find_rule(case.domain, case.op_type, opset)
        if rule is None:
            continue
        low = replace(
            case,
            opset=opset,
            id=re.sub(r"-opset\d+$", "", case.id) + f"-opset{opset}",
            dynamic_shapes=case.dynamic_shapes
            and not (rule.broadcast or case.op_type in _UNDO_BROADCAST),
        )
        try:
            case_model(low)
        except Exception:  # the case uses an input or attribute the old opset lacks
            continue
        return low
    return None


def _first_case_per_op(modules) -> list[OpCase]:
    chosen: dict[str, OpCase] = {}
    for module in modules:
        for case in module.CASES:
            if case.op_type in chosen or "second-order" in case.id:
                continue
            low = _at_low_opset(case)
            if low is not None:
                chosen[case.op_type] = low
    return list(chosen.values())


CASES = _first_case_per_op(
    [cases_arithmetic, cases_unary, cases_activations, cases_elementwise, cases_linalg]
)
