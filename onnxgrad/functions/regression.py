"""Small models used as training targets in examples and tests."""

from __future__ import annotations

import onnx
from onnxscript import script

from onnxgrad.functions._registry import BuildContext, register, tensor


@register(
    "linear_regression",
    inputs=[tensor("X", "N", "F"), tensor("A", "F", "T"), tensor("B", None, None)],
    outputs=[tensor("Y", "N", "T")],
)
def linear_regression(ctx: BuildContext) -> onnx.ModelProto:
    r"""Y = X A + B, a linear regression with coefficients A and intercepts B.

    .. math:: Y = X A + B

    X is ``[N, F]``, A ``[F, T]`` and B any matrix broadcasting to ``[N, T]`` (``[1, T]``,
    ``[N, T]``, ``[N, 1]``...) by default; ``input_shapes={"B": ["T"]}`` declares a vector.
    """
    op = ctx.op

    @script(default_opset=op)
    def linear_regression(X, A, B):
        Y = op.MatMul(X, A) + B
        return Y

    return linear_regression.to_model_proto()
