"""onnx_derivative refuses bad requests with errors that name the problem."""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper

from onnxgrad import DerivativeOptions, onnx_derivative
from tests.models import seed004_model


@pytest.mark.parametrize("options", [16, 32 | 8, -1])
def test_unknown_option_bits_are_refused(options):
    with pytest.raises(ValueError, match="unknown DerivativeOptions bits"):
        onnx_derivative(seed004_model(), options=options)


@pytest.mark.parametrize("options", [2.0, True, "Zero"])
def test_options_must_be_flags(options):
    with pytest.raises(TypeError, match="DerivativeOptions flags"):
        onnx_derivative(seed004_model(), options=options)


def test_loss_option_needs_a_scalar_loss():
    graph = helper.make_graph(
        [helper.make_node("Relu", ["X"], ["Y"])],
        "relu",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    with pytest.raises(ValueError, match=r"'Y' has shape \[None, 3\].*scalar loss"):
        onnx_derivative(model, options=DerivativeOptions.Loss)


@pytest.mark.ort_training
def test_ort_backend_refuses_loss_with_kept_outputs():
    with pytest.raises(ValueError, match="KeepOutputs needs backend='onnx'"):
        onnx_derivative(
            seed004_model(),
            options=DerivativeOptions.Loss | DerivativeOptions.KeepOutputs,
            backend="ort",
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weights": ["nope"]}, r"unknown weights \['nope'\]"),
        ({"inputs": ["nope"]}, r"unknown inputs \['nope'\]"),
        ({"weights": ["init_2"]}, r"weights \['init_2'\] are not float"),
        ({"weights": [], "inputs": []}, "nothing to differentiate"),
        ({"weights": "init"}, "must be a list of names"),
        ({"backend": "tf"}, "unknown backend 'tf'"),
        ({"loss": "y"}, "need options=DerivativeOptions.Loss"),
    ],
)
def test_bad_names_are_named(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        onnx_derivative(seed004_model(), **kwargs)


@pytest.mark.ort_training
def test_ort_backend_clamps_a_newer_ir_version():
    model = seed004_model()
    model.ir_version = 14
    grad = onnx_derivative(model, backend="ort")
    assert grad.graph.output[0].name == "x_grad"
    assert grad.ir_version <= 10


@pytest.mark.ort_training
def test_ort_backend_names_its_opset_limit():
    with pytest.raises(ValueError, match="opsets up to 21, the model has opset 22"):
        onnx_derivative(seed004_model(22), backend="ort")


@pytest.mark.parametrize("backend", ["onnx", "ort"])
def test_models_below_ir_4_are_raised_to_a_valid_version(backend):
    model = seed004_model()
    model.ir_version = 3
    grad = onnx_derivative(model, backend=backend)
    assert 4 <= grad.ir_version <= 10
    assert model.ir_version == 3


def test_a_node_name_does_not_block_a_gradient_value_name():
    graph = helper.make_graph(
        [helper.make_node("Relu", ["X"], ["Y"], name="Y_grad")],
        "relu",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    grad = onnx_derivative(model)
    assert [i.name for i in grad.graph.input] == ["X", "Y_grad"]
    names = [n.name for n in grad.graph.node if n.name]
    assert len(names) == len(set(names))
