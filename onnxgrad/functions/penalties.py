r"""Elastic-net penalties on weights: value, gradient, the penalty of n tensors, the update.

.. math::

    P(X) = l_1 \lVert X \rVert_1 + l_2 \lVert X \rVert_2^2
         = l_1 \sum_i |X_i| + l_2 \sum_i X_i^2 \qquad
    \nabla P(X) = l_1 \mathrm{sign}(X) + 2 l_2 X

The gradient at :math:`X_i = 0` is taken as :math:`0` for the L1 part (a subgradient). Weights
are declared 2-D by default (see ``input_shapes``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import onnx
from onnxscript import script
from onnxscript.values import OnnxFunction

from onnxgrad.functions._registry import (
    BuildContext,
    Param,
    inferred,
    like,
    non_negative,
    optional_shape,
    positive_int,
    register,
    tensor,
)

_DIMS = ("D0", "D1")
_ELASTIC = {"l1_weight": Param(0.01, non_negative), "l2_weight": Param(0.01, non_negative)}


def _penalty(ctx: BuildContext, l1_weight: float, l2_weight: float) -> OnnxFunction:
    """X -> P(X), a scalar."""
    op = ctx.op
    l1 = ctx.constant(l1_weight)
    l2 = ctx.constant(l2_weight)

    @script(default_opset=op)
    def elastic_penalty(X):
        l1_norm = op.ReduceSum(op.Abs(X), keepdims=0)
        squared_l2_norm = op.ReduceSum(X * X, keepdims=0)
        return op.Constant(value=l1) * l1_norm + op.Constant(value=l2) * squared_l2_norm

    return elastic_penalty


def _penalty_grad(ctx: BuildContext, l1_weight: float, l2_weight: float) -> OnnxFunction:
    """X -> grad P(X), the shape of X."""
    op = ctx.op
    l1 = ctx.constant(l1_weight)
    two_l2 = ctx.constant(2 * l2_weight)

    @script(default_opset=op)
    def elastic_penalty_grad(X):
        return op.Constant(value=l1) * op.Sign(X) + op.Constant(value=two_l2) * X

    return elastic_penalty_grad


@register(
    "grad_penalty_elastic_error",
    inputs=[tensor("X", *_DIMS)],
    outputs=[tensor("Y"), like("Y_grad", "X")],
    params=_ELASTIC,
)
def grad_penalty_elastic_error(
    ctx: BuildContext, l1_weight: float, l2_weight: float
) -> onnx.ModelProto:
    r"""Y, Y_grad: the elastic penalty l1 |X|_1 + l2 |X|_2^2 of a weight X and its gradient.

    .. math:: Y = l_1 \sum_i |X_i| + l_2 \sum_i X_i^2 \qquad
        Y_{grad} = l_1 \mathrm{sign}(X) + 2 l_2 X

    Options ``l1_weight`` (:math:`l_1`, default 0.01) and ``l2_weight`` (:math:`l_2`,
    default 0.01). ``Y`` is a scalar.
    """
    penalty = _penalty(ctx, l1_weight, l2_weight)
    penalty_grad = _penalty_grad(ctx, l1_weight, l2_weight)

    @script(default_opset=ctx.op)
    def grad_penalty(X):
        Y = penalty(X)
        Y_grad = penalty_grad(X)
        return Y, Y_grad

    return grad_penalty.to_model_proto()


@register(
    "update_penalty_elastic_error",
    inputs=[tensor("X", *_DIMS)],
    outputs=[like("Y", "X")],
    params={"l1": Param(1e-4, non_negative), "l2": Param(1e-4, non_negative)},
)
def update_penalty_elastic_error(ctx: BuildContext, l1: float, l2: float) -> onnx.ModelProto:
    r"""Y = X - l1 sign(X) - 2 l2 X: one unit gradient step on the elastic penalty.

    .. math:: Y = X - \nabla P(X) = (1 - 2 l_2) X - l_1 \mathrm{sign}(X)

    Options ``l1`` and ``l2`` (default 1e-4 each) already include the learning rate.
    """
    penalty_grad = _penalty_grad(ctx, l1, l2)

    @script(default_opset=ctx.op)
    def update_penalty(X):
        Y = X - penalty_grad(X)
        return Y

    return update_penalty.to_model_proto()


def _n_penalty_inputs(params: Mapping[str, Any]) -> list:
    loss = tensor("loss", *params["loss_shape"])
    weights = (tensor(f"W{i}", f"W{i}_D0", f"W{i}_D1") for i in range(params["n_tensors"]))
    return [loss, *weights]


@register(
    "n_penalty_elastic_error",
    inputs=_n_penalty_inputs,
    outputs=[inferred("Y")],
    params={
        **_ELASTIC,
        "n_tensors": Param(1, positive_int),
        "loss_shape": Param((1, 1), optional_shape),
    },
    ignores_weight=True,
)
def n_penalty_elastic_error(
    ctx: BuildContext, l1_weight: float, l2_weight: float, n_tensors: int, loss_shape
) -> onnx.ModelProto:
    r"""Y = loss + sum_k P(W_k): a loss plus the elastic penalties of n weights W0..W{n-1}.

    .. math:: Y = \mathrm{flatten}\left(\text{loss} + \sum_{k=0}^{n-1}
        \left(l_1 \lVert W_k \rVert_1 + l_2 \lVert W_k \rVert_2^2\right)\right)

    Options ``l1_weight``, ``l2_weight`` (default 0.01 each), ``n_tensors`` (the number of
    weights, default 1) and ``loss_shape`` (shape of input ``loss``, default ``[1, 1]`` as
    onnxcustom's; ``[]`` for the scalar loss of :func:`~onnxgrad.add_loss_output`). ``Y`` is
    the sum as a vector (``[1]`` for a loss of one element). Each weight is 2-D with dims of
    its own (``W0_D0``, ``W0_D1``...), other shapes through ``input_shapes``.
    """
    del loss_shape  # shapes are declared by the catalogue, not by the graph
    penalty = _penalty(ctx, l1_weight, l2_weight).to_function_proto()
    weights = [f"W{i}" for i in range(n_tensors)]
    terms = [f"penalty_{name}" for name in weights]
    nodes = [
        onnx.helper.make_node(penalty.name, [name], [term], domain=penalty.domain)
        for name, term in zip(weights, terms)
    ]
    flat = onnx.helper.make_tensor("flat", onnx.TensorProto.INT64, [1], [-1])
    nodes.append(onnx.helper.make_node("Sum", ["loss", *terms], ["total"]))
    nodes.append(onnx.helper.make_node("Constant", [], ["flat"], value=flat))
    nodes.append(onnx.helper.make_node("Reshape", ["total", "flat"], ["Y"]))
    graph = onnx.helper.make_graph(
        nodes,
        "n_penalty_elastic_error",
        [onnx.ValueInfoProto(name=name) for name in ["loss", *weights]],
        [onnx.ValueInfoProto(name="Y")],
    )
    return onnx.helper.make_model(
        graph,
        opset_imports=[
            onnx.helper.make_opsetid("", ctx.opset),
            onnx.helper.make_opsetid(penalty.domain, 1),
        ],
        functions=[penalty],
    )
