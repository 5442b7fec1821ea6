"""Weight updates: plain, momentum and Nesterov steps, Adam, copy and zero.

Every tensor input and output has the shape of the weight being trained: declared 2-D by
default, or as ``input_shapes`` gives the first input (the other tensors follow it).
Hyper-parameters are inputs of shape ``[1]`` so that one graph serves every learning rate.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnxscript import script

from onnxgrad.functions._registry import BuildContext, Port, like, register, scalar, tensor

_DIMS = ("D0", "D1")


def _weight(name: str, follows: str | None = None) -> Port:
    return like(name, follows) if follows else tensor(name, *_DIMS)


@register(
    "axpy",
    inputs=[_weight("X1"), _weight("X2", "X1"), scalar("alpha")],
    outputs=[like("Y", "X1")],
)
def axpy(ctx: BuildContext) -> onnx.ModelProto:
    r"""Y = alpha X1 + X2, a gradient step (X1 gradient, X2 weight, alpha = -learning rate).

    .. math:: Y = \alpha X_1 + X_2
    """
    op = ctx.op

    @script(default_opset=op)
    def axpy(X1, X2, alpha):
        Y = alpha * X1 + X2
        return Y

    return axpy.to_model_proto()


#: axpyw and axpyw2: gradient, weight, previous velocity, -learning rate, momentum
_MOMENTUM_INPUTS = [
    _weight("X1"),
    _weight("X2", "X1"),
    _weight("G", "X1"),
    scalar("alpha"),
    scalar("beta"),
]
_MOMENTUM_OUTPUTS = [like("Y", "X1"), like("Z", "X1")]


@register(
    "axpyw",
    inputs=_MOMENTUM_INPUTS,
    outputs=_MOMENTUM_OUTPUTS,
)
def axpyw(ctx: BuildContext) -> onnx.ModelProto:
    r"""Y, Z = X2 + Z, beta G + alpha X1: a momentum step (G previous velocity, Z the new one).

    .. math:: Z = \beta G + \alpha X_1 \qquad Y = Z + X_2

    With :math:`X_1` the gradient, :math:`X_2` the weight, :math:`\alpha = -\eta` the
    negated learning rate and :math:`\beta` the momentum.
    """
    op = ctx.op

    @script(default_opset=op)
    def axpyw(X1, X2, G, alpha, beta):
        Z = beta * G + alpha * X1
        Y = Z + X2
        return Y, Z

    return axpyw.to_model_proto()


@register(
    "axpyw2",
    inputs=_MOMENTUM_INPUTS,
    outputs=_MOMENTUM_OUTPUTS,
)
def axpyw2(ctx: BuildContext) -> onnx.ModelProto:
    r"""Y, Z = X2 + beta Z + alpha X1, beta G + alpha X1: a Nesterov momentum step.

    .. math:: Z = \beta G + \alpha X_1 \qquad Y = \beta Z + \alpha X_1 + X_2

    Same roles as ``axpyw``; the weight moves along the velocity it is about to have, as
    scikit-learn's ``nesterovs_momentum=True``.
    """
    op = ctx.op

    @script(default_opset=op)
    def axpyw2(X1, X2, G, alpha, beta):
        step = alpha * X1
        Z = beta * G + step
        Y = beta * Z + step + X2
        return Y, Z

    return axpyw2.to_model_proto()


@register(
    "adam",
    inputs=[
        _weight("X"),
        _weight("G", "X"),
        _weight("M", "X"),
        _weight("V", "X"),
        scalar("alpha"),
        scalar("beta1"),
        scalar("beta2"),
        scalar("epsilon"),
        tensor("t", 1, integer=True),
    ],
    outputs=[like("Y", "X"), like("M_new", "X"), like("V_new", "X")],
)
def adam(ctx: BuildContext) -> onnx.ModelProto:
    r"""Y, M_new, V_new: one Adam step with bias correction (t is the 1-based int64 step).

    .. math::

        M' = \beta_1 M + (1 - \beta_1) G \qquad
        V' = \beta_2 V + (1 - \beta_2) G^2

        Y = X - \alpha \frac{M' / (1 - \beta_1^t)}{\sqrt{V' / (1 - \beta_2^t)} + \epsilon}

    X weight, G gradient, M and V first and second moments (zeros before step 1), alpha
    learning rate; as Kingma and Ba (2015) and ``torch.optim.Adam``.
    """
    op = ctx.op
    one = ctx.constant(1)
    float_type = ctx.elem_type

    @script(default_opset=op)
    def adam(X, G, M, V, alpha, beta1, beta2, epsilon, t):
        unit = op.Constant(value=one)
        step = op.Cast(t, to=float_type)
        M_new = beta1 * M + (unit - beta1) * G
        V_new = beta2 * V + (unit - beta2) * G * G
        m_hat = M_new / (unit - op.Pow(beta1, step))
        v_hat = V_new / (unit - op.Pow(beta2, step))
        Y = X - alpha * m_hat / (op.Sqrt(v_hat) + epsilon)
        return Y, M_new, V_new

    return adam.to_model_proto()


@register("copy", inputs=[_weight("X")], outputs=[like("Y", "X")])
def copy(ctx: BuildContext) -> onnx.ModelProto:
    """Y = X.

    .. math:: Y = X
    """
    op = ctx.op

    @script(default_opset=op)
    def copy(X):
        Y = op.Identity(X)
        return Y

    return copy.to_model_proto()


@register("zero", inputs=[_weight("X")], outputs=[like("Y", "X")])
def zero(ctx: BuildContext) -> onnx.ModelProto:
    r"""Y = zeros with the shape of X (also where X holds inf or NaN).

    .. math:: Y = 0_{\text{shape}(X)}
    """
    op = ctx.op
    zero_value = np.zeros((1,), dtype=ctx.dtype)

    @script(default_opset=op)
    def zero(X):
        Y = op.ConstantOfShape(op.Shape(X), value=zero_value)
        return Y

    return zero.to_model_proto()
