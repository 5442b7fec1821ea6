"""The original model as the finite-difference reference: float64, onnx's reference
evaluator, weights overridden wherever the model stores them (initializers or ``Constant``
nodes, subgraphs included).

The reference evaluator's ``BatchNormalization`` of opsets 9-13 normalises with the batch's
own statistics (its ``momentum`` attribute, which has a default, selects that path); the
specification's one-output node is inference mode, ``(x - mean) / sqrt(var + eps) * scale +
bias``, which onnxruntime computes, so the reference uses that formula at every opset. Its
``GlobalMaxPool``, ``OneHot``, ``GatherElements``, ``Pad``, ``STFT``, ``Erf``, ``Loop`` and
``DequantizeLinear`` / ``QuantizeLinear`` before opset 19 are replaced likewise (see each
class); onnxruntime's ``DynamicQuantizeLSTM`` becomes its float ``LSTM`` (:func:`with_float_lstms`).
``Conv``, ``ConvTranspose`` and ``Col2Im`` are computed one product per kernel offset
(:mod:`tests.derivative.reference_conv`: the same values as onnx's element loops, faster).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from onnx import GraphProto, ModelProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from onnx.reference.ops.op_loop import Loop as _ReferenceLoop
from scipy import special

from onnxgrad._onnx_utils import subgraphs
from tests.derivative.fd import to_double
from tests.derivative.reference_conv import Col2Im, Conv, ConvTranspose


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
    finite differences of a GELU model at small steps were noise. scipy's ``erf`` is the
    double-precision one, vectorised (``math.erf`` per element cost smart-turn's reference a
    fifth of its time)."""

    op_domain = ""

    def _run(self, x):
        return (special.erf(np.asarray(x, np.float64)).astype(x.dtype),)


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


class Loop(_ReferenceLoop):
    """onnx's reference joins a ``Loop``'s scan outputs with ``numpy.vstack``: a body
    emitting ``[B, H]`` each step gave ``[T B, H]`` where the specification stacks them on a
    new first axis, ``[T, B, H]`` (tf2onnx's LSTMs written as loops)."""

    op_domain = ""

    def _run(self, M, cond, *carried, context=None, body=None, attributes=None, bindings=None):
        names = self.body.input_names
        inputs = dict(context or {})
        inputs.update(zip(names[2:], carried))
        scans = [[] for _ in range(self.K)]
        step, final = 0, list(carried)
        while cond and (M is None or step < M):
            inputs[names[0]] = np.array(step, np.int64 if M is None else M.dtype)
            inputs[names[1]] = cond
            outputs = self._run_body(inputs, attributes=attributes, bindings=bindings)
            cond, final = outputs[0], list(outputs[1 : 1 + self.N])
            inputs.update(zip(names[2:], final))
            for scan, value in zip(scans, outputs[1 + self.N :]):
                scan.append(value)
            step += 1
        stacked = [np.stack(scan) if scan else np.empty((0,)) for scan in scans]
        return self._check_and_fix_outputs((*final, *stacked))


def _along(x: np.ndarray, value, axis) -> np.ndarray:
    """``value`` (one number, or one per position of ``axis``) broadcastable to ``x``."""
    value = np.asarray(value)
    if value.size == 1:
        return value.reshape(())
    shape = [1] * x.ndim
    shape[1 if axis is None else axis] = -1
    return value.reshape(shape)


def with_float_lstms(model: ModelProto) -> ModelProto:
    """A copy of ``model`` whose onnxruntime ``DynamicQuantizeLSTM`` nodes are the float
    ``LSTM`` over their dequantized weights (new initializers): the kernel's dynamic
    quantization of its input and state removed, as the straight-through estimator reads it.
    The rounding of other activations is then frozen at the values this copy computes (a
    ``MatMulInteger`` after the LSTM reads the float LSTM's output, as in the gradient)."""
    copy = ModelProto()
    copy.CopyFrom(model)
    arrays = {i.name: numpy_helper.to_array(i) for i in copy.graph.initializer}
    nodes, replaced = [], set()
    for node in copy.graph.node:
        if node.op_type != "DynamicQuantizeLSTM":
            nodes.append(node)
            continue
        names = [*node.input, *[""] * (12 - len(node.input))]
        replaced.update(names[i] for i in (1, 2, 8, 9, 10, 11))
        weights = []
        for codes, scale, zero in ((1, 8, 9), (2, 10, 11)):
            value = _dequantized_columns(
                arrays[names[codes]], arrays[names[scale]], arrays.get(names[zero])
            )
            tensor = numpy_helper.from_array(value.astype(np.float32), f"{names[codes]}_float")
            copy.graph.initializer.append(tensor)
            weights.append(tensor.name)
        inputs = [names[0], *weights, *names[3:8]]
        while not inputs[-1]:
            inputs.pop()
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        nodes.append(helper.make_node("LSTM", inputs, node.output, name=node.name, **attributes))
    del copy.graph.node[:]
    copy.graph.node.extend(nodes)
    read = {name for node in nodes for name in node.input}
    kept = [i for i in copy.graph.initializer if i.name in read or i.name not in replaced]
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(kept)
    return copy


def _dequantized_columns(codes, scale, zero) -> np.ndarray:
    """``(codes - zero) scale`` with one scale per direction or per column, as ``[D, 4H, K]``."""
    shape = (codes.shape[0], 1, -1)
    zero = 0.0 if zero is None else np.asarray(zero, np.float64).reshape(shape)
    values = (codes.astype(np.float64) - zero) * np.reshape(scale, shape)
    return values.transpose(0, 2, 1)


#: the operators replaced in onnx's reference evaluator
FIXED_OPS = [Erf, BatchNormalization, GlobalMaxPool, OneHot, GatherElements, Pad, STFT,
              DequantizeLinear, QuantizeLinear, Loop, Conv, ConvTranspose, Col2Im]  # fmt: skip


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
            evaluator = ReferenceEvaluator(self.model, new_ops=FIXED_OPS)
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
