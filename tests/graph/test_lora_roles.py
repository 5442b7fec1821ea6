"""``add_lora``'s default targets are the learned layers: the weights of ``MatMul``, ``Gemm``
and ``Conv`` that :func:`~onnxgrad.get_train_initializer` counts as weights
(:mod:`onnxgrad.graph.weight_roles`), and the codes of quantized products. Fixed transforms
(an STFT written as convolutions by a DFT basis, the mel filterbank after its power, a
smoothing window) get no adapter unless named. The model keeps its deployed operators.
References: the roles of the hand-built graphs below (each constant's nature is known) and
onnxruntime on the original model (the adapted one computes the same until trained)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import add_lora, get_train_initializer
from onnxgrad.graph.lora import lora_adapters
from tests.graph.test_weight_roles import hann_dft_rows

F = TensorProto.FLOAT
node = helper.make_node


def _model(nodes, inits, inputs, shape, domains=()):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info("y", F, shape)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    opsets = [helper.make_opsetid("", 18), *(helper.make_opsetid(d, 1) for d in domains)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9)


def _random(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _dft_kernels():
    """``w_n cos(2 pi k n / 8)`` and ``-w_n sin(2 pi k n / 8)``: 5 bins, a Hann window."""
    cos, sin = hann_dft_rows()
    return cos.astype(np.float32)[:, None, :], (-sin).astype(np.float32)[:, None, :]


def _log_mel_front(head: list, head_inits: dict):
    """openwakeword's melspectrogram: the STFT as two ``Conv`` by a DFT basis, the power
    ``re^2 + im^2`` times a non-negative mel filterbank (``MatMul``), ``log(mel + guard)``;
    then ``head`` reading ``flat`` ``[2, 21]``."""
    real, imag = _dft_kernels()
    nodes = [
        node("Unsqueeze", ["x", "one"], ["signal"]),
        node("Conv", ["signal", "real"], ["re"], strides=[4]),
        node("Conv", ["signal", "imag"], ["im"], strides=[4]),
        node("Mul", ["re", "re"], ["re2"]),
        node("Mul", ["im", "im"], ["im2"]),
        node("Add", ["re2", "im2"], ["power"]),
        node("Transpose", ["power"], ["frames"], perm=[0, 2, 1]),
        node("MatMul", ["frames", "mel"], ["mels"]),
        node("Add", ["mels", "guard"], ["guarded"]),
        node("Log", ["guarded"], ["logmel"]),
        node("Flatten", ["logmel"], ["flat"]),
        *head,
    ]
    inits = {
        "one": np.array([1], np.int64),
        "real": real,
        "imag": imag,
        "mel": np.abs(_random(5, 3, seed=1)),
        "guard": np.float32(1e-6),
        **head_inits,
    }
    return _model(nodes, inits, [("x", F, [2, 32])], [2, 2])


def _linear_head():
    head = [node("Gemm", ["flat", "kernel", "bias"], ["y"], transB=1)]
    return head, {"kernel": _random(2, 21, seed=2), "bias": _random(2, seed=3)}


def _weights(model) -> list[str]:
    return sorted(a["weight"] for a in lora_adapters(model))


def _outputs(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def test_a_dft_front_end_and_its_filterbank_get_no_adapter_the_linear_layer_does():
    model = _log_mel_front(*_linear_head())
    adapted = add_lora(model, rank=2)
    assert _weights(adapted) == ["kernel"]  # before: imag, kernel, mel, real
    assert sorted(get_train_initializer(model)) == ["bias", "kernel"]
    kept = [n.op_type for n in adapted.graph.node if not n.name.startswith("kernel_lora")]
    assert kept == [n.op_type for n in model.graph.node]
    x = _random(2, 32, seed=4)
    np.testing.assert_allclose(_outputs(adapted, {"x": x}), _outputs(model, {"x": x}), rtol=1e-6)


def test_a_front_end_alone_has_no_default_target_and_the_error_names_its_transforms():
    head = [node("ReduceSum", ["flat"], ["y"], keepdims=1)]
    model = _log_mel_front(head, {})
    with pytest.raises(ValueError, match=r"no MatMul, Gemm or Conv weight to adapt.*\['imag', "):
        add_lora(model)
    with pytest.raises(ValueError, match="name them in weights="):
        add_lora(model)


def test_named_fixed_transforms_are_adapted_whatever_their_role():
    model = _log_mel_front(*_linear_head())
    adapted = add_lora(model, ["real", "mel"], rank=2)
    assert _weights(adapted) == ["mel", "real"]
    # the default then adds the learned layer only, not the fixed transform left (imag)
    assert _weights(add_lora(adapted, rank=2)) == ["kernel", "mel", "real"]


def _smoothed(window: np.ndarray):
    """silero's adaptive normalisation: a ``Conv`` by a window, then a dense layer."""
    nodes = [
        node("Conv", ["x", "window"], ["smooth"], pads=[2, 2]),
        node("Flatten", ["smooth"], ["flat"]),
        node("MatMul", ["flat", "head"], ["y"]),
    ]
    inits = {"window": window.astype(np.float32), "head": _random(16, 2, seed=5)}
    return _model(nodes, inits, [("x", F, [2, 1, 16])], [2, 2])


def test_a_smoothing_window_gets_no_adapter_a_trained_kernel_does():
    gauss = np.exp(-0.5 * np.arange(-2, 3) ** 2)
    assert _weights(add_lora(_smoothed((gauss / gauss.sum())[None, None]))) == ["head"]
    assert _weights(add_lora(_smoothed(_random(1, 1, 5, seed=6)))) == ["head", "window"]


def test_a_scaler_before_a_network_stays_deployed_its_layers_are_adapted():
    """skl2onnx's ``Scaler`` (fitted statistics) then a layer: the role analysis runs on a
    normalised copy (the ``Scaler`` lowered), the model returned keeps the ``Scaler``."""
    nodes = [
        node(
            "Scaler",
            ["x"],
            ["scaled"],
            domain="ai.onnx.ml",
            offset=[5.0, 0.0, 12.0],
            scale=[0.3, 1.0, 0.1],
        ),
        node("MatMul", ["scaled", "kernel"], ["h"]),
        node("Add", ["h", "bias"], ["y"]),
    ]
    inits = {"kernel": _random(3, 2, seed=7), "bias": _random(2, seed=8)}
    model = _model(nodes, inits, [("x", F, [None, 3])], [None, 2], domains=["ai.onnx.ml"])
    adapted = add_lora(model, rank=1)
    assert _weights(adapted) == ["kernel"]
    assert [n.op_type for n in adapted.graph.node].count("Scaler") == 1
    x = _random(4, 3, seed=9)
    np.testing.assert_allclose(_outputs(adapted, {"x": x}), _outputs(model, {"x": x}), rtol=1e-6)


def test_a_quantized_layer_after_a_fixed_front_end_is_adapted():
    """The head's weight as int8 codes dequantized (``DequantizeLinear``): its codes are the
    learned weight (its scale is no default weight) and get the adapter; the DFT kernels and
    the filterbank get none."""
    codes = np.random.default_rng(10).integers(-127, 128, (21, 2)).astype(np.int8)
    head = [
        node("DequantizeLinear", ["codes", "step"], ["w"]),
        node("MatMul", ["flat", "w"], ["y"]),
    ]
    model = _log_mel_front(head, {"codes": codes, "step": np.float32(0.02)})
    adapted = add_lora(model, rank=2)
    (adapter,) = lora_adapters(adapted)
    assert adapter["weight"] == "codes" and "quantized" in adapter
    x = _random(2, 32, seed=11)
    np.testing.assert_allclose(
        _outputs(adapted, {"x": x}), _outputs(model, {"x": x}), rtol=1e-5, atol=1e-6
    )


def test_constant_weights_without_an_adapter_stay_constant_nodes():
    """paddle2onnx and PyTorch keep some weights as ``Constant`` nodes: ``add_lora`` promotes
    them to find its targets; those it adapts stay initializers (same names), the others
    (here a DFT kernel) are ``Constant`` nodes again, before their first reader."""
    model = _log_mel_front(*_linear_head())
    graph = model.graph
    for name in ("real", "kernel"):
        init = next(i for i in graph.initializer if i.name == name)
        graph.node.insert(0, node("Constant", [], [name], value=init, name=f"{name}_node"))
        graph.initializer.remove(init)
    adapted = add_lora(model, rank=2)
    assert _weights(adapted) == ["kernel"]
    constants = [n.output[0] for n in adapted.graph.node if n.op_type == "Constant"]
    assert "real" in constants and "kernel" not in constants
    assert "kernel" in {i.name for i in adapted.graph.initializer}
    x = _random(2, 32, seed=12)
    np.testing.assert_allclose(_outputs(adapted, {"x": x}), _outputs(model, {"x": x}), rtol=1e-6)
