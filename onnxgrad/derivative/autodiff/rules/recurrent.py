r"""Recurrent operators ``RNN``, ``GRU`` and ``LSTM``, differentiated by lowering to ``Scan``.

The rule rewrites the node into standard ops around one ``Scan`` per direction, following
the operator's specification, then differentiates that graph with the same rules (the
``Scan`` rule of :mod:`.control_flow` runs the step's vector-Jacobian product backwards in
time): one source of truth for every attribute, and a gradient graph that is itself
differentiable. The gradient graph recomputes the forward pass through the lowering.

Per direction ``d`` (gates ``G``: 1, 3, 4), with ``X`` time-major ``[T, B, I]``:

* the input projection of every step at once, ``XW = X W_d^\top + b`` (``[T, B, G H]``, the
  biases folded in where they are additive), outside the loop;
* a Scan over ``XW`` carrying ``h`` (and ``c``), whose step is

  - RNN: ``h' = f(XW_t + h R^\top)``
  - GRU: ``z, r = f(XW_{z,r} + h R_{z,r}^\top)``,
    ``\tilde h = g(XW_h + (r \odot h) R_h^\top + Rb_h)`` or, with ``linear_before_reset``,
    ``g(XW_h + r \odot (h R_h^\top + Rb_h))``; ``h' = (1 - z) \odot \tilde h + z \odot h``
  - LSTM (gate order ``i, o, f, c``, peepholes ``P = [P_i, P_o, P_f]``):
    ``i = f(XW_i + h R_i^\top + P_i \odot c)``, ``f`` likewise (or ``1 - i`` with
    ``input_forget``), ``c' = f \odot c + i \odot g(XW_c + h R_c^\top)``,
    ``o = f(XW_o + h R_o^\top + P_o \odot c')``, ``h' = o \odot h(c')``

  with ``clip`` bounding every activation's input to ``[-clip, clip]``;
* the reverse direction reads ``XW`` backwards (``Slice`` with step -1); with
  ``sequence_lens`` each batch entry is reversed within its own length (``GatherElements``)
  and a mask ``m_t = t < len_b`` freezes the state and zeroes ``Y`` past the length:
  ``h' \leftarrow h + m_t (h' - h)``.

Activations take their ``activation_alpha``/``activation_beta`` in order, one value per
activation that uses it (onnxruntime's reading of the specification); an absent value takes
the default of the ONNX operator of that name (Affine ``alpha=1, beta=0``, ScaledTanh
``alpha=beta=1``).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from onnxgrad._onnx_utils import np_dtype
from onnxgrad.derivative.autodiff.builder import GradBuilder, NodeView
from onnxgrad.derivative.autodiff.registry import register
from onnxgrad.derivative.autodiff.value_types import ValueType, value_info

_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
_DEFAULT_ACTIVATIONS = {
    "RNN": ["Tanh"],
    "GRU": ["Sigmoid", "Tanh"],
    "LSTM": ["Sigmoid", "Tanh", "Tanh"],
}
_OPS = {
    "relu": "Relu",
    "tanh": "Tanh",
    "sigmoid": "Sigmoid",
    "leakyrelu": "LeakyRelu",
    "thresholdedrelu": "ThresholdedRelu",
    "hardsigmoid": "HardSigmoid",
    "elu": "Elu",
    "softsign": "Softsign",
    "softplus": "Softplus",
    "affine": None,
    "scaledtanh": None,
}
#: (alpha default, beta default), ``None`` where the activation takes no such parameter
_PARAMETERS = {
    "affine": (1.0, 0.0),
    "leakyrelu": (0.01, None),
    "thresholdedrelu": (1.0, None),
    "scaledtanh": (1.0, 1.0),
    "hardsigmoid": (0.2, 0.5),
    "elu": (1.0, None),
}


class _Tape:
    """Nodes of one graph (the lowering or a step body) with names free in the model."""

    def __init__(self, b: GradBuilder, dtype: int):
        self.b = b
        self.dtype = dtype
        self.nodes = []

    def op(self, op_type: str, *inputs: str | None, **attrs) -> str:
        out = self.b.unique_name(f"{op_type}_out")
        node = helper.make_node(
            op_type,
            ["" if i is None else i for i in inputs],
            [out],
            name=self.b.unique_node_name(op_type),
            **attrs,
        )
        self.nodes.append(node)
        return out

    def const(self, value, dtype=None) -> str:
        array = np.asarray(value, dtype=np_dtype(self.dtype) if dtype is None else dtype)
        name = self.b.unique_name("cst")
        tensor = numpy_helper.from_array(array, name=name)
        node = helper.make_node(
            "Constant", [], [name], name=self.b.unique_node_name("Constant"), value=tensor
        )
        self.nodes.append(node)
        return name

    def ints(self, values) -> str:
        return self.const(values, np.int64)

    def unsqueeze(self, x: str, axes: list[int]) -> str:
        if self.b.opset >= 13:
            return self.op("Unsqueeze", x, self.ints(axes))
        return self.op("Unsqueeze", x, axes=axes)

    def slice(self, x: str, start: int, end: int, axis: int) -> str:
        return self.op("Slice", x, self.ints([start]), self.ints([end]), self.ints([axis]))

    def take(self, x: str, index: int, axis: int = 0) -> str:
        return self.op("Gather", x, self.ints(index), axis=axis)


# -- the rule -----------------------------------------------------------------------------------
@register("RNN", "GRU", "LSTM", since=11)
def recurrent_grad(b, node, grads, needs):
    outputs, nodes = _lower(b, node)
    graph = helper.make_graph(
        nodes,
        b.unique_name(f"{node.op_type}_lowered"),
        [],
        [helper.make_tensor_value_info(o, b.dtype(node.inputs[0]), None) for o in outputs],
    )
    seen, sources = set(), []
    for index, name in enumerate(node.inputs):
        if name and needs[index] and name not in seen:
            seen.add(name)
            sources.append(name)
    seeds = {o: g for o, g in zip(outputs, grads) if g is not None}
    backward, gradients = b.differentiate_subgraph(graph, sources, seeds)
    b.emit_nodes(list(graph.node))
    b.emit_nodes(backward)
    results, given = [], set()
    for name in node.inputs:
        if name in sources and name not in given:
            given.add(name)
            results.append(gradients[name])
        else:
            results.append(None)
    return results


# -- lowering -----------------------------------------------------------------------------------
def _hidden_size(b: GradBuilder, node: NodeView) -> int:
    size = node.attr("hidden_size")
    if size is None:
        shape = b.shape(node.inputs[2])
        size = shape[-1] if shape else None
    if not isinstance(size, int):
        raise NotImplementedError(
            f"{node.op_type} node {node.name!r}: the gradient needs hidden_size or a static "
            f"shape of R ({node.inputs[2]!r})"
        )
    return size


def _activations(node: NodeView, n_directions: int) -> list[list[tuple[str, float, float]]]:
    """Per direction, the ``(name, alpha, beta)`` of each activation."""
    per_direction = len(_DEFAULT_ACTIVATIONS[node.op_type])
    names = node.attr("activations") or _DEFAULT_ACTIVATIONS[node.op_type] * n_directions
    if len(names) == per_direction and n_directions == 2:
        names = names * 2
    if len(names) != per_direction * n_directions:
        raise ValueError(
            f"{node.op_type} node {node.name!r}: {len(names)} activations for "
            f"{n_directions} direction(s), expected {per_direction * n_directions}"
        )
    alphas = iter(node.attr("activation_alpha") or [])
    betas = iter(node.attr("activation_beta") or [])
    resolved = []
    for name in names:
        key = name.lower()
        if key not in _OPS:
            raise ValueError(f"{node.op_type} node {node.name!r}: unknown activation {name!r}")
        alpha, beta = _PARAMETERS.get(key, (None, None))
        alpha = None if alpha is None else next(alphas, alpha)
        beta = None if beta is None else next(betas, beta)
        resolved.append((key, alpha, beta))
    return [resolved[d * per_direction : (d + 1) * per_direction] for d in range(n_directions)]


def _activate(t: _Tape, x: str, activation: tuple[str, float, float]) -> str:
    key, alpha, beta = activation
    if key == "affine":
        return t.op("Add", t.op("Mul", x, t.const(alpha)), t.const(beta))
    if key == "scaledtanh":
        return t.op("Mul", t.const(alpha), t.op("Tanh", t.op("Mul", x, t.const(beta))))
    attrs = {"alpha": alpha, "beta": beta}
    return t.op(_OPS[key], x, **{k: float(v) for k, v in attrs.items() if v is not None})


class _Layer:
    """What the step of one direction reads: sizes, attributes, the captured weights."""

    def __init__(self, node: NodeView, dtype: int, hidden: int, activations: list):
        self.node, self.dtype, self.hidden = node, dtype, hidden
        self.activations = activations
        self.clip = node.attr("clip")
        self.op_type = node.op_type

    def clipped(self, t: _Tape, x: str) -> str:
        if self.clip is None:
            return x
        return t.op("Clip", x, t.const(-self.clip), t.const(self.clip))


def _lower(b: GradBuilder, node: NodeView) -> tuple[list[str], list]:
    """The nodes computing ``Y, Y_h[, Y_c]`` of ``node`` with standard ops."""
    dtype = b.dtype(node.inputs[0])
    t = _Tape(b, dtype)
    hidden = _hidden_size(b, node)
    layout = node.attr("layout", 0)
    direction = node.attr("direction", "forward")
    directions = ["forward", "reverse"] if direction == "bidirectional" else [direction]
    activations = _activations(node, len(directions))
    is_lstm = node.op_type == "LSTM"

    x = node.inputs[0]
    if layout:
        x = t.op("Transpose", x, perm=[1, 0, 2])
    x_shape = t.op("Shape", x)
    batch = t.op("Slice", x_shape, t.ints([1]), t.ints([2]))
    zeros = t.op(
        "ConstantOfShape",
        t.op("Concat", batch, t.ints([hidden]), axis=0),
        value=numpy_helper.from_array(np.zeros((1,), dtype=np_dtype(dtype))),
    )
    mask, order = _sequence_mask(t, node, x_shape)

    ys, hs, cs = [], [], []
    for d, name in enumerate(directions):
        layer = _Layer(node, dtype, hidden, activations[d])
        xw, captured = _projection(t, node, layer, x, d)
        reverse = name == "reverse"
        if reverse:
            xw = _reorder(t, xw, order)
        h0 = _initial(t, node.input(5), d, layout, zeros)
        c0 = _initial(t, node.input(6), d, layout, zeros) if is_lstm else None
        peepholes = t.take(node.input(7), d) if is_lstm and node.input(7) else None
        body = _step_body(b, layer, captured, peepholes, mask is not None)
        states = [h0, c0] if is_lstm else [h0]
        streams = [xw] if mask is None else [xw, mask]
        outs = [b.unique_name(f"{node.op_type}_scan_out") for _ in range(len(states) + 1)]
        t.nodes.append(
            helper.make_node(
                "Scan",
                [*states, *streams],
                outs,
                name=b.unique_node_name("Scan"),
                body=body,
                num_scan_inputs=len(streams),
            )
        )
        y = _reorder(t, outs[-1], order) if reverse else outs[-1]
        ys.append(t.unsqueeze(y, [1]))
        hs.append(t.unsqueeze(outs[0], [0]))
        if is_lstm:
            cs.append(t.unsqueeze(outs[1], [0]))

    outputs = [_join(t, ys, 1), _join(t, hs, 0)] + ([_join(t, cs, 0)] if is_lstm else [])
    if layout:
        outputs = [
            t.op("Transpose", outputs[0], perm=[2, 0, 1, 3]),
            *(t.op("Transpose", o, perm=[1, 0, 2]) for o in outputs[1:]),
        ]
    return outputs, t.nodes


def _join(t: _Tape, parts: list[str], axis: int) -> str:
    return parts[0] if len(parts) == 1 else t.op("Concat", *parts, axis=axis)


def _initial(t: _Tape, state: str | None, d: int, layout: int, zeros: str) -> str:
    return zeros if state is None else t.take(state, d, axis=1 if layout else 0)


def _sequence_mask(t: _Tape, node: NodeView, x_shape: str):
    """``(mask [T, B, 1], order)``: the mask of valid steps and, for the reverse direction,
    ``(index [T, B], None)`` reversing each batch entry within its length; ``(None, None)``
    without ``sequence_lens`` (the reverse direction then reverses the whole axis)."""
    lens = node.input(4)
    if lens is None:
        return None, None
    steps = t.op("Reshape", t.op("Slice", x_shape, t.ints([0]), t.ints([1])), t.ints([]))
    times = t.unsqueeze(t.op("Range", t.ints(0), steps, t.ints(1)), [1])
    lens = t.unsqueeze(t.op("Cast", lens, to=TensorProto.INT64), [0])
    valid = t.op("Less", times, lens)
    mask = t.unsqueeze(t.op("Cast", valid, to=t.dtype), [2])
    mirrored = t.op("Sub", t.op("Sub", lens, t.ints(1)), times)
    index = t.op("Where", valid, mirrored, t.op("Expand", times, t.op("Shape", valid)))
    return mask, index


def _reorder(t: _Tape, x: str, index: str | None) -> str:
    """``x [T, B, ...]`` in reverse time order (per batch entry within its length when
    ``index`` is given); the permutation is its own inverse."""
    if index is None:
        return t.op("Slice", x, t.ints([-1]), t.ints([-(2**63)]), t.ints([0]), t.ints([-1]))
    expanded = t.op("Expand", t.unsqueeze(index, [2]), t.op("Shape", x))
    return t.op("GatherElements", x, expanded, axis=0)


def _projection(t: _Tape, node: NodeView, layer: _Layer, x: str, d: int):
    """``XW = X W_d^T`` plus the additive biases, and the weights the step reads."""
    hidden = layer.hidden
    w = t.take(node.inputs[1], d)
    r = t.take(node.inputs[2], d)
    xw = t.op("MatMul", x, t.op("Transpose", w, perm=[1, 0]))
    gates = _GATES[node.op_type]
    bias = t.take(node.input(3), d) if node.input(3) else None
    w_bias = None if bias is None else t.slice(bias, 0, gates * hidden, 0)
    r_bias = None if bias is None else t.slice(bias, gates * hidden, 2 * gates * hidden, 0)
    captured = {}
    lbr = node.op_type == "GRU" and node.attr("linear_before_reset", 0)
    if node.op_type == "GRU" and not lbr:
        captured["r_zr"] = t.op("Transpose", t.slice(r, 0, 2 * hidden, 0), perm=[1, 0])
        captured["r_h"] = t.op("Transpose", t.slice(r, 2 * hidden, 3 * hidden, 0), perm=[1, 0])
    else:
        captured["r"] = t.op("Transpose", r, perm=[1, 0])
    if bias is not None:
        xw = t.op("Add", xw, w_bias)
        if lbr:
            captured["r_bias"] = r_bias
        else:
            xw = t.op("Add", xw, r_bias)
    return xw, captured


def _step_body(b: GradBuilder, layer: _Layer, captured: dict, peepholes, masked: bool):
    """The Scan body of one direction."""
    t = _Tape(b, layer.dtype)
    hidden, gates = layer.hidden, _GATES[layer.op_type]
    h = b.unique_name("h_prev")
    c = b.unique_name("c_prev") if layer.op_type == "LSTM" else None
    xw = b.unique_name("xw_t")
    m = b.unique_name("mask_t") if masked else None
    if layer.op_type == "RNN":
        pre = t.op("Add", xw, t.op("MatMul", h, captured["r"]))
        new = [_activate(t, layer.clipped(t, pre), layer.activations[0])]
    elif layer.op_type == "GRU":
        new = [_gru_step(t, layer, captured, h, xw)]
    else:
        new = list(_lstm_step(t, layer, captured, peepholes, h, c, xw))
    y = new[0]
    if masked:
        previous = [h, c] if c else [h]
        new = [t.op("Add", p, t.op("Mul", m, t.op("Sub", n, p))) for p, n in zip(previous, new)]
        y = t.op("Mul", m, y)
    outputs = [*new, t.op("Identity", y)]

    batch = b.unique_name("batch")  # one symbol: rules see equal batch sizes statically

    def info(name, width):
        return value_info(name, ValueType(layer.dtype, (batch, width)))

    inputs = [info(h, hidden)] + ([info(c, hidden)] if c else [])
    inputs += [info(xw, gates * hidden)] + ([info(m, 1)] if masked else [])
    return helper.make_graph(
        t.nodes,
        b.unique_name(f"{layer.op_type}_step"),
        inputs,
        [info(o, hidden) for o in outputs],
    )


def _gru_step(t: _Tape, layer: _Layer, captured: dict, h: str, xw: str) -> str:
    hidden = layer.hidden
    f, g = layer.activations

    def part(x, k):
        return t.slice(x, k * hidden, (k + 1) * hidden, 1)

    if "r_bias" in captured or "r" in captured:
        h_r = t.op("MatMul", h, captured["r"])
        if "r_bias" in captured:
            h_r = t.op("Add", h_r, captured["r_bias"])
        z_pre, r_pre = (t.op("Add", part(xw, k), part(h_r, k)) for k in (0, 1))
        z, r = (_activate(t, layer.clipped(t, p), f) for p in (z_pre, r_pre))
        h_pre = t.op("Add", part(xw, 2), t.op("Mul", r, part(h_r, 2)))
    else:
        h_zr = t.op("MatMul", h, captured["r_zr"])
        z_pre, r_pre = (t.op("Add", part(xw, k), part(h_zr, k)) for k in (0, 1))
        z, r = (_activate(t, layer.clipped(t, p), f) for p in (z_pre, r_pre))
        h_pre = t.op("Add", part(xw, 2), t.op("MatMul", t.op("Mul", r, h), captured["r_h"]))
    candidate = _activate(t, layer.clipped(t, h_pre), g)
    return t.op("Add", candidate, t.op("Mul", z, t.op("Sub", h, candidate)))


def _lstm_step(t: _Tape, layer: _Layer, captured: dict, peepholes, h: str, c: str, xw: str):
    hidden = layer.hidden
    f, g, act_h = layer.activations
    pre = t.op("Add", xw, t.op("MatMul", h, captured["r"]))
    i_pre, o_pre, f_pre, c_pre = (t.slice(pre, k * hidden, (k + 1) * hidden, 1) for k in range(4))
    if peepholes is not None:
        p_i, p_o, p_f = (t.slice(peepholes, k * hidden, (k + 1) * hidden, 0) for k in range(3))
        i_pre = t.op("Add", i_pre, t.op("Mul", p_i, c))
        f_pre = t.op("Add", f_pre, t.op("Mul", p_f, c))
    i = _activate(t, layer.clipped(t, i_pre), f)
    if layer.node.attr("input_forget", 0):
        forget = t.op("Sub", t.const(1.0), i)
    else:
        forget = _activate(t, layer.clipped(t, f_pre), f)
    cell = _activate(t, layer.clipped(t, c_pre), g)
    c_new = t.op("Add", t.op("Mul", forget, c), t.op("Mul", i, cell))
    if peepholes is not None:
        o_pre = t.op("Add", o_pre, t.op("Mul", p_o, c_new))
    o = _activate(t, layer.clipped(t, o_pre), f)
    return t.op("Mul", o, _activate(t, c_new, act_h)), c_new
