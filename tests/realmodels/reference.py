"""The original model as the finite-difference reference: float64, onnx's reference
evaluator, weights overridden wherever the model stores them (initializers or ``Constant``
nodes, subgraphs included).

The reference evaluator's ``BatchNormalization`` of opsets 9-13 normalises with the batch's
own statistics (its ``momentum`` attribute, which has a default, selects that path); the
specification's one-output node is inference mode, ``(x - mean) / sqrt(var + eps) * scale +
bias``, which onnxruntime computes, so the reference uses that formula at every opset. Its
``GlobalMaxPool``, ``OneHot``, ``GatherElements``, ``Pad``, ``STFT``, ``Erf`` and
``DequantizeLinear`` / ``QuantizeLinear`` before opset 19 are replaced likewise (see each
class), and onnxruntime's ``DynamicQuantizeLSTM`` is its float ``LSTM``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from onnx import GraphProto, ModelProto, TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from onnxgrad._onnx_utils import subgraphs
from tests.derivative.fd import to_double


class BatchNormalization(OpRun):
    op_domain = ""

    def _run(self, x, scale, bias, mean, var, epsilon=None, momentum=None, training_mode=None):
        shape = (1, -1) + (1,) * (x.ndim - 2)
        centred = x - mean.reshape(shape)
        return (centred / np.sqrt(var.reshape(shape) + epsilon) * scale.reshape(shape)
                + bias.reshape(shape),)  # fmt: skip


class GlobalMaxPool(OpRun):
    """onnx's reference keeps only the first spatial axis (a rank-4 ``[N, C, L, 1]`` comes
    back ``[N, C, 1]``); the specification keeps every axis, size 1."""

    op_domain = ""

    def _run(self, x):
        return (x.max(axis=tuple(range(2, x.ndim)), keepdims=True),)


class OneHot(OpRun):
    """onnx's reference refuses a float64 ``depth`` (the float32 one, made double)."""

    op_domain = ""

    def _run(self, indices, depth, values, axis=None):
        size = int(np.asarray(depth).ravel()[0])
        codes = np.asarray(indices).astype(np.int64)
        codes = np.where(codes < 0, codes + size, codes)
        hot = codes[..., None] == np.arange(size)
        result = np.where(hot, values[1], values[0]).astype(values.dtype)
        return (np.moveaxis(result, -1, -1 if axis is None else axis),)


class GatherElements(OpRun):
    """onnx's reference handles at most 64 positions per axis (``numpy.choose``)."""

    op_domain = ""

    def _run(self, data, indices, axis=None):
        axis = 0 if axis is None else axis
        positions = np.where(indices < 0, indices + data.shape[axis], indices)
        return (np.take_along_axis(data, positions, axis=axis),)


class Pad(OpRun):
    """onnx's reference refuses negative pads, which crop (onnxruntime crops, then pads)."""

    op_domain = ""

    def _run(self, data, pads=None, constant_value=None, axes=None, mode=None, value=None):
        if constant_value is None:
            constant_value = value  # an attribute before opset 11
        rank = data.ndim
        axes = list(range(rank)) if axes is None else [int(a) % rank for a in axes]
        pads = np.asarray(pads, np.int64)
        width = [[0, 0] for _ in range(rank)]
        for k, axis in enumerate(axes):
            width[axis] = [int(pads[k]), int(pads[k + len(axes)])]
        crop = tuple(
            slice(max(-a, 0), data.shape[i] - max(-b, 0)) for i, (a, b) in enumerate(width)
        )
        kept = data[crop]
        width = [(max(a, 0), max(b, 0)) for a, b in width]
        mode = (mode or "constant").decode() if isinstance(mode, bytes) else (mode or "constant")
        if mode == "constant":
            fill = 0 if constant_value is None else np.asarray(constant_value).item()
            return (np.pad(kept, width, mode="constant", constant_values=fill),)
        return (
            np.pad(kept, width, mode={"edge": "edge", "reflect": "reflect", "wrap": "wrap"}[mode]),
        )


class STFT(OpRun):
    """onnx's reference fails on a real signal of rank 2 ``[B, N]`` (onnx-asr's feature
    extractors), which onnxruntime takes: the specification's frames, window and DFT, by
    ``numpy.fft``."""

    op_domain = ""

    def _run(self, signal, frame_step, window=None, frame_length=None, onesided=None):
        x = (
            signal
            if signal.ndim == 2
            else signal[..., 0] + 1j * signal[..., -1] * (signal.shape[-1] == 2)
        )
        length = len(window) if window is not None else int(np.asarray(frame_length))
        step = int(np.asarray(frame_step))
        count = (x.shape[1] - length) // step + 1
        starts = np.arange(count)[:, None] * step + np.arange(length)
        frames = x[:, starts] * (1.0 if window is None else window)
        spectrum = np.fft.fft(frames, axis=-1)
        if onesided is None or onesided:
            spectrum = spectrum[..., : length // 2 + 1]
        return (np.stack([spectrum.real, spectrum.imag], axis=-1).astype(signal.dtype),)


class Erf(OpRun):
    """onnx's reference computes ``erf`` in float32 whatever the input (``otypes="f"``):
    finite differences of a GELU model at small steps were noise."""

    op_domain = ""

    def _run(self, x):
        return (np.vectorize(math.erf, otypes=[np.float64])(x).astype(x.dtype),)


class DequantizeLinear(OpRun):
    """onnx's reference implements ``DequantizeLinear`` from opset 19 only; opsets 10-18
    compute the same ``(x - zero_point) scale``, per tensor or along ``axis``."""

    op_domain = ""

    def _run(self, x, scale, zero=None, axis=None, block_size=None, output_dtype=None):
        scale, zero = _along(x, scale, axis), _along(x, 0 if zero is None else zero, axis)
        return (((x.astype(np.float64) - zero) * scale).astype(np.asarray(scale).dtype),)


class QuantizeLinear(OpRun):
    """``saturate(round_half_even(x / scale) + zero_point)`` (see ``DequantizeLinear``)."""

    op_domain = ""

    def _run(self, x, scale, zero=None, axis=None, block_size=None, output_dtype=None,
             saturate=None, precision=None):  # fmt: skip
        codes = np.uint8 if zero is None else np.asarray(zero).dtype
        zero = _along(x, 0 if zero is None else zero, axis)
        rounded = np.rint(x / _along(x, scale, axis)) + zero
        info = np.iinfo(codes)
        return (np.clip(rounded, info.min, info.max).astype(codes),)


def _along(x: np.ndarray, value, axis) -> np.ndarray:
    """``value`` (one number, or one per position of ``axis``) broadcastable to ``x``."""
    value = np.asarray(value)
    if value.size == 1:
        return value.reshape(())
    shape = [1] * x.ndim
    shape[1 if axis is None else axis] = -1
    return value.reshape(shape)


class DynamicQuantizeLSTM(OpRun):
    """onnxruntime's ``com.microsoft`` LSTM over int8 weights ``W [D, I, 4H]``,
    ``R [D, H, 4H]`` with scales and zero points per direction or per column, its
    activations' dynamic quantization removed: the float ``LSTM`` over the dequantized,
    transposed weights (the file with activation rounding removed)."""

    op_domain = "com.microsoft"

    def _run(self, x, w, r, b=None, lengths=None, h0=None, c0=None, p=None,
             w_scale=None, w_zero=None, r_scale=None, r_zero=None, **attributes):  # fmt: skip
        weights = [
            _dequantized_columns(w, w_scale, w_zero),
            _dequantized_columns(r, r_scale, r_zero),
        ]
        feeds = dict(zip("XWRBLHCP", [x, *weights, b, lengths, h0, c0, p]))
        names = [k if v is not None else "" for k, v in feeds.items()]
        while names and not names[-1]:
            names.pop()
        given = {k: v for k, v in feeds.items() if v is not None}
        node = helper.make_node(
            "LSTM", names, ["Y", "Y_h", "Y_c"],
            **{k: v for k, v in attributes.items() if v is not None},
        )  # fmt: skip
        graph = helper.make_graph(
            [node], "lstm",
            [helper.make_tensor_value_info(k, _elem(v), None) for k, v in given.items()],
            [helper.make_tensor_value_info(o, TensorProto.DOUBLE, None) for o in node.output],
        )  # fmt: skip
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
        return tuple(ReferenceEvaluator(model).run(None, given))


def _dequantized_columns(codes, scale, zero) -> np.ndarray:
    """``(codes - zero) scale`` with one scale per direction or per column, as ``[D, 4H, K]``."""
    shape = (codes.shape[0], 1, -1)
    zero = np.zeros(1) if zero is None else np.asarray(zero, np.float64)
    values = (codes.astype(np.float64) - zero.reshape(shape)) * np.reshape(scale, shape)
    return values.transpose(0, 2, 1)


def _elem(value: np.ndarray) -> int:
    return helper.np_dtype_to_tensor_dtype(np.asarray(value).dtype)


_FIXED_OPS = [Erf, BatchNormalization, GlobalMaxPool, OneHot, GatherElements, Pad, STFT,
              DequantizeLinear, QuantizeLinear, DynamicQuantizeLSTM]  # fmt: skip


class Reference:
    """``run(feeds, weights)``: the float64 outputs of ``model`` with some weights replaced."""

    def __init__(self, model: ModelProto):
        self.model = to_double(model)
        self.slots = _weight_slots(self.model)

    def weight(self, name: str) -> np.ndarray:
        return numpy_helper.to_array(self._slot(name))

    def run(self, feeds: Mapping[str, np.ndarray], weights: Mapping[str, np.ndarray]):
        saved = {name: _copy(self._slot(name)) for name in weights}
        try:
            for name, value in weights.items():
                self._slot(name).CopyFrom(
                    numpy_helper.from_array(np.asarray(value, np.float64), name)
                )
            evaluator = ReferenceEvaluator(self.model, new_ops=_FIXED_OPS)
            doubles = {
                k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feeds.items()
            }
            return evaluator.run(None, doubles)
        finally:
            for name, tensor in saved.items():
                self._slot(name).CopyFrom(tensor)

    def _slot(self, name: str):
        if name not in self.slots:
            raise KeyError(f"weight {name!r} is neither an initializer nor a Constant of the model")
        return self.slots[name]


def _copy(tensor):
    copy = type(tensor)()
    copy.CopyFrom(tensor)
    return copy


def _weight_slots(model: ModelProto) -> dict:
    slots = {}

    def visit(graph: GraphProto) -> None:
        for init in graph.initializer:
            slots[init.name] = init
        for node in graph.node:
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
                slots[node.output[0]] = node.attribute[0].t
            for sub in subgraphs(node):
                visit(sub)

    visit(model.graph)
    return slots
