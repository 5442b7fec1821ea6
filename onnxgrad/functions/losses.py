r"""Losses between expected values X1 and predictions X2, and their gradients.

Every loss is a sum over all elements of a pointwise error :math:`e(X_1, X_2)`, optionally
weighted per sample by :math:`w` (input ``weight_name``, shape ``[N]``, broadcast over the
trailing dimensions of the rows):

.. math::

    Y = \sum_{i} w_i \, e(X_{1,i}, X_{2,i}) \qquad
    Y_{grad} = \frac{\partial Y}{\partial X_2} = w \, \frac{\partial e}{\partial X_2}

``Y`` is a scalar (shape ``[]``); ``Y_grad`` has the shape of ``X2``: it is the gradient of the
loss with respect to the predictions, the one to back-propagate through the model. X1 is
declared ``[N, K]`` by default and X2 follows it (see ``input_shapes``).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnxscript import script
from onnxscript.values import OnnxFunction

from onnxgrad.functions._registry import (
    BuildContext,
    Param,
    clip_epsilon,
    like,
    non_negative,
    register,
    tensor,
)

_PAIR = [tensor("X1", "N", "K"), like("X2", "X1")]
_LOSS = tensor("Y")
_GRAD = like("Y_grad", "X2")
_ELASTIC = {"l1_weight": Param(0.01, non_negative), "l2_weight": Param(0.01, non_negative)}


def _summed(ctx: BuildContext, pointwise: OnnxFunction) -> onnx.ModelProto:
    """The graph (X1, X2[, weight]) -> (Y, Y_grad) summing ``pointwise = (e, de/dX2)``."""
    op = ctx.op
    minus_one = np.array([-1], dtype=np.int64)
    second = np.array([1], dtype=np.int64)
    last = np.array([np.iinfo(np.int64).max], dtype=np.int64)
    one = np.array([1], dtype=np.int64)

    if ctx.weighted:

        @script(default_opset=op)
        def weighted_loss(X1, X2, weight):
            error, error_grad = pointwise(X1, X2)
            row_dims = op.Slice(op.Shape(X2), op.Constant(value=second), op.Constant(value=last))
            ones = op.ConstantOfShape(op.Shape(row_dims), value=one)
            w = op.Reshape(weight, op.Concat(op.Constant(value=minus_one), ones, axis=0))
            Y = op.ReduceSum(w * error, keepdims=0)
            Y_grad = w * error_grad
            return Y, Y_grad

        return weighted_loss.to_model_proto()

    @script(default_opset=op)
    def loss(X1, X2):
        error, Y_grad = pointwise(X1, X2)
        Y = op.ReduceSum(error, keepdims=0)
        return Y, Y_grad

    return loss.to_model_proto()


def _square(ctx: BuildContext) -> onnx.ModelProto:
    op = ctx.op
    minus_two = ctx.constant(-2)

    @script(default_opset=op)
    def square(X1, X2):
        d = X1 - X2
        return d * d, op.Constant(value=minus_two) * d

    return _summed(ctx, square)


def _absolute(ctx: BuildContext) -> onnx.ModelProto:
    op = ctx.op

    @script(default_opset=op)
    def absolute(X1, X2):
        d = X1 - X2
        return op.Abs(d), op.Neg(op.Sign(d))

    return _summed(ctx, absolute)


def _elastic(ctx: BuildContext, l1_weight: float, l2_weight: float) -> onnx.ModelProto:
    op = ctx.op
    l1 = ctx.constant(l1_weight)
    l2 = ctx.constant(l2_weight)
    minus_two_l2 = ctx.constant(-2 * l2_weight)

    @script(default_opset=op)
    def elastic(X1, X2):
        d = X1 - X2
        l1_factor = op.Constant(value=l1)
        error = l1_factor * op.Abs(d) + op.Constant(value=l2) * d * d
        error_grad = op.Constant(value=minus_two_l2) * d - l1_factor * op.Sign(d)
        return error, error_grad

    return _summed(ctx, elastic)


def _sigmoid_neg_log(ctx: BuildContext, eps: float) -> onnx.ModelProto:
    op = ctx.op
    one = ctx.constant(1)
    low = ctx.constant(eps)
    high = ctx.constant(1 - eps)
    float_type = ctx.elem_type

    @script(default_opset=op)
    def sigmoid_neg_log(X1, X2):
        unit = op.Constant(value=one)
        y = op.Cast(X1, to=float_type)
        p = op.Sigmoid(X2)
        clipped = op.Clip(p, op.Constant(value=low), op.Constant(value=high))
        error = op.Neg(y * op.Log(clipped) + (unit - y) * op.Log(unit - clipped))
        return error, p - y

    return _summed(ctx, sigmoid_neg_log)


@register("square_error", inputs=_PAIR, outputs=[_LOSS], weighted=True)
def square_error(ctx: BuildContext) -> onnx.ModelProto:
    r"""Y = sum w (X1 - X2)^2, the weighted square error (loss only).

    .. math:: Y = \sum_i w_i (X_{1,i} - X_{2,i})^2
    """
    return _square(ctx)


@register("grad_square_error", inputs=_PAIR, outputs=[_GRAD], weighted=True)
def grad_square_error(ctx: BuildContext) -> onnx.ModelProto:
    r"""Y_grad = -2 w (X1 - X2), the gradient of square_error with respect to X2.

    .. math:: Y_{grad} = \frac{\partial}{\partial X_2} \sum_i w_i (X_{1,i} - X_{2,i})^2
        = -2 w (X_1 - X_2)
    """
    return _square(ctx)


@register("grad_loss_square_error", inputs=_PAIR, outputs=[_LOSS, _GRAD], weighted=True)
def grad_loss_square_error(ctx: BuildContext) -> onnx.ModelProto:
    r"""Y, Y_grad: the square error sum w (X1 - X2)^2 and its gradient -2 w (X1 - X2).

    .. math:: Y = \sum_i w_i (X_{1,i} - X_{2,i})^2 \qquad Y_{grad} = -2 w (X_1 - X_2)
    """
    return _square(ctx)


@register("grad_loss_absolute_error", inputs=_PAIR, outputs=[_LOSS, _GRAD], weighted=True)
def grad_loss_absolute_error(ctx: BuildContext) -> onnx.ModelProto:
    r"""Y, Y_grad: the absolute error sum w |X1 - X2| and its gradient -w sign(X1 - X2).

    .. math:: Y = \sum_i w_i |X_{1,i} - X_{2,i}| \qquad Y_{grad} = -w \, \mathrm{sign}(X_1 - X_2)

    The gradient at :math:`X_1 = X_2` is taken as 0 (a subgradient).
    """
    return _absolute(ctx)


@register(
    "grad_loss_elastic_error",
    inputs=_PAIR,
    outputs=[_LOSS, _GRAD],
    params=_ELASTIC,
    weighted=True,
)
def grad_loss_elastic_error(
    ctx: BuildContext, l1_weight: float, l2_weight: float
) -> onnx.ModelProto:
    r"""Y, Y_grad: the elastic error sum w (l1 |d| + l2 d^2), d = X1 - X2, and its gradient.

    .. math::

        Y = \sum_i w_i \left(l_1 |d_i| + l_2 d_i^2\right) \qquad
        Y_{grad} = -w \left(l_1 \mathrm{sign}(d) + 2 l_2 d\right)

    Options ``l1_weight`` (:math:`l_1`, default 0.01) and ``l2_weight`` (:math:`l_2`,
    default 0.01).
    """
    return _elastic(ctx, l1_weight, l2_weight)


@register(
    "grad_sigmoid_neg_log_loss_error",
    inputs=[tensor("X1", "N", "K", integer=True), like("X2", "X1")],
    outputs=[_LOSS, _GRAD],
    params={"eps": Param(1e-5, clip_epsilon)},
    weighted=True,
)
def grad_sigmoid_neg_log_loss_error(ctx: BuildContext, eps: float) -> onnx.ModelProto:
    r"""Y, Y_grad: the summed log loss of sigmoid(X2) for int64 labels X1 in {0, 1}, its gradient.

    .. math::

        p = \sigma(X_2) = \frac{1}{1 + e^{-X_2}} \qquad
        \hat p = \min(\max(p, \epsilon), 1 - \epsilon)

        Y = -\sum_i w_i \left(y_i \log \hat p_i + (1 - y_i) \log (1 - \hat p_i)\right)
        \qquad Y_{grad} = w (p - y)

    X2 holds raw scores (logits). Probabilities are clipped (option ``eps``, default 1e-5)
    so that the loss stays finite; ``Y_grad`` is the exact gradient wherever the clipping is
    inactive, i.e. :math:`\epsilon < p < 1 - \epsilon`. The loss is a sum, not a mean, like
    every loss of the catalogue.
    """
    return _sigmoid_neg_log(ctx, eps)
