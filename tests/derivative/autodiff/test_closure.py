"""Closure under differentiation: the gradient graph of every rule-table case is itself
differentiable, and its gradient (a Hessian-vector product) agrees with float64 finite
differences of the first derivative."""

from __future__ import annotations

import pytest

from tests.derivative.autodiff.gradcheck import check_case, second_order
from tests.derivative.autodiff.test_rules import CASES

_TIE = (
    "the case sits on a tie or a zero by design (it checks the first derivative's "
    "convention there); the first derivative jumps at that point, so finite differences "
    "of it do not measure a second derivative"
)
#: cases whose second derivative cannot be checked this way, with the reason
NOT_CHECKED = {
    **dict.fromkeys(["Celu-default", "Celu-alpha", "Celu-default-opset12"], (
        "Celu is defined for float32 only: the case casts to float32, which the float64 "
        "output gradient of the second-order graph cannot enter"
    )),
    **dict.fromkeys(
        ["Max-tie-split", "Min-two-way-ties", "ReduceMax-ties", "ReduceMax-ties-input-axes",
         "ReduceMin-ties-opset11", "ReduceL2-zero-norm",
         "ReduceProd-zeros", "LpPool-zero-windows-p1"], _TIE,
    ),
    **dict.fromkeys(
        ["LpPool-zero-windows-p2", "LpPool-zero-windows-p3", "GlobalLpPool-zero-plane"],
        _TIE + (
            "; test_nonfinite_points checks there that the second derivative is finite and "
            "agrees with finite differences along the inputs where the first does not jump"
        ),
    ),
    **dict.fromkeys(["ReduceSum-runtime-axes", "ReduceSum-runtime-empty-axes"], (
        "with axes computed at run time, shape inference cannot give the rank of the first "
        "derivative, which the table's model builder needs to declare its outputs"
    )),
    "Loop-trip-count": (
        "its Loop scan output has no inferable shape; differentiated again, the reverse "
        "Scan's gradient of that stream has no declared rank, which onnxruntime requires, "
        "and the reference evaluator runs no iteration of a Loop without a condition"
    ),
    **dict.fromkeys(["Compress-axis0", "RNN-opset11"], (
        "opset 11: undoing a broadcast of unknown shape needs ReduceSum's axes input (13)"
    )),
    "ScatterElements-max": _TIE,
    "Pow-zero-exponent": (
        "x^0 is constant: its first derivative (zeros) depends on neither x nor the output "
        "gradient, and the engine refuses a derivative that would be 0 everywhere"
    ),
    "MaxUnpool-2d-output-shape": (
        "the Slice rule needs the static rank of the Reshape the MaxUnpool rule emits, which "
        "shape inference cannot give: a rank-generic Slice rule is needed"
    ),
    **dict.fromkeys(["Reshape-allowzero-empty", "Reshape-allowzero-zero-dim"], (
        "zero-size tensors: the first derivative has no element, there is nothing to check"
    )),
}  # fmt: skip

#: the onnx reference evaluator cannot run these second-order graphs (``np.choose`` accepts
#: at most 64 choices in its GatherElements): onnxruntime evaluates them. The Gather cases
#: below opset 16: the gradient of the segment sum's ScatterElements gathers from its
#: ``S`` slots (the data's elements)
ON_ONNXRUNTIME = {
    "MaxPool-2d-stride2-pads-ceil-opset13", "MaxPool-2d-dilation2-opset15",
    "MaxPool-2d-same-upper", "MaxPool-3d", "MaxPool-3d-unit-steps",
    "Gather-axis1-dup-opset15", "Gather-last-axis-opset13",
}  # fmt: skip

#: DequantizeLinear's scale is float32 (no opset, 10 to 25, accepts a float64 one), so its first
#: derivative is computed in float32; it is linear in the output gradient and does not depend
#: on the scale, so central differences are exact for any step, and a unit step keeps the float32
#: rounding of the first derivative (ulp ~1e-5 at |s_bar| ~ 100) below the tolerance
UNIT_STEP = {"DequantizeLinear"}

FIRST_ORDER = [c for c in CASES if not c.id.endswith("-second-order")]


@pytest.mark.parametrize("case", FIRST_ORDER, ids=[c.id for c in FIRST_ORDER])
def test_second_derivative_against_finite_differences(case):
    if case.id in NOT_CHECKED:
        pytest.skip(NOT_CHECKED[case.id])
    changes = {}
    if case.id in ON_ONNXRUNTIME:
        changes["evaluator"] = "onnxruntime"
    if case.op_type in UNIT_STEP:
        changes["eps"] = 1.0
    check_case(second_order(case, **changes))
