"""Bad arguments raise ValueError or TypeError naming the offending thing."""

from __future__ import annotations

import numpy as np
import pytest

from onnxgrad.functions import function_onnx_graph, get_supported_functions
from onnxgrad.functions.catalogue import max_function_opset


def test_unknown_name_lists_the_supported_ones():
    with pytest.raises(ValueError, match="'axpz'") as info:
        function_onnx_graph("axpz")
    for name in get_supported_functions():
        assert name in str(info.value)


def test_name_must_be_a_string():
    with pytest.raises(TypeError, match="graph name"):
        function_onnx_graph(None)


@pytest.mark.parametrize(
    ("dtype", "shown"),
    [(np.float16, "float16"), (np.int64, "int64"), ("complex64", "complex64"), (object, "object")],
)
def test_unsupported_dtype(dtype, shown):
    with pytest.raises(TypeError, match=f"dtype {shown} is not supported"):
        function_onnx_graph("axpy", dtype=dtype)


def test_dtype_that_is_no_dtype():
    with pytest.raises(TypeError, match="not a numpy dtype"):
        function_onnx_graph("axpy", dtype="no-such-type")


@pytest.mark.parametrize("opset", [1, 12, max_function_opset() + 1, 99])
def test_opset_out_of_range(opset):
    newest = max_function_opset()
    with pytest.raises(ValueError, match=rf"supports opsets 13 to {newest}.*target_opset={opset}"):
        function_onnx_graph("adam", target_opset=opset)


@pytest.mark.parametrize("opset", ["18", 18.0, True])
def test_opset_must_be_an_int(opset):
    with pytest.raises(TypeError, match="target_opset must be an int"):
        function_onnx_graph("axpy", target_opset=opset)


def test_numpy_integer_opset_is_accepted():
    model = function_onnx_graph("axpy", target_opset=np.int64(15))
    assert model.opset_import[0].version == 15


def test_unknown_option_names_the_accepted_ones():
    with pytest.raises(TypeError, match=r"unexpected option.*l1.*accepted options: l1_weight"):
        function_onnx_graph("grad_loss_elastic_error", l1=0.1)
    with pytest.raises(TypeError, match=r"'axpy' got unexpected option.*accepted options: none"):
        function_onnx_graph("axpy", alpha=0.1)


@pytest.mark.parametrize(
    ("name", "options", "error", "pattern"),
    [
        ("grad_loss_elastic_error", {"l1_weight": -0.1}, ValueError, "'l1_weight' must be >= 0"),
        ("grad_penalty_elastic_error", {"l2_weight": np.nan}, ValueError, r"'l2_weight'.*finite"),
        ("update_penalty_elastic_error", {"l1": "0.1"}, TypeError, "'l1' must be a real"),
        ("n_penalty_elastic_error", {"n_tensors": 0}, ValueError, "'n_tensors' must be >= 1"),
        ("n_penalty_elastic_error", {"n_tensors": 2.0}, TypeError, r"'n_tensors'.*integer"),
        ("n_penalty_elastic_error", {"loss_shape": 3}, TypeError, "shape of 'loss_shape'"),
        ("grad_sigmoid_neg_log_loss_error", {"eps": 0.5}, ValueError, r"'eps'.*\(0, 0.5\)"),
        ("grad_sigmoid_neg_log_loss_error", {"eps": 0}, ValueError, r"'eps'.*\(0, 0.5\)"),
    ],
)
def test_bad_option_values(name, options, error, pattern):
    with pytest.raises(error, match=pattern):
        function_onnx_graph(name, **options)


def test_weight_name_on_a_graph_without_sample_weight():
    with pytest.raises(ValueError, match="'axpy' takes no sample weight"):
        function_onnx_graph("axpy", weight_name="w")


@pytest.mark.parametrize("weight_name", ["X1", "Y_grad"])
def test_weight_name_clashing_with_an_input_or_output(weight_name):
    with pytest.raises(ValueError, match=f"weight_name '{weight_name}' is already"):
        function_onnx_graph("grad_loss_square_error", weight_name=weight_name)


@pytest.mark.parametrize("weight_name", ["", 3])
def test_weight_name_must_be_a_non_empty_string(weight_name):
    with pytest.raises(TypeError, match="weight_name must be a non-empty str"):
        function_onnx_graph("square_error", weight_name=weight_name)


def test_input_shapes_for_an_unknown_input():
    with pytest.raises(ValueError, match=r"unknown inputs \['W'\].*inputs are \['X1', 'X2'"):
        function_onnx_graph("square_error", input_shapes={"W": (3,)})


def test_input_shapes_name_the_weight_by_weight_name():
    with pytest.raises(ValueError, match=r"unknown inputs \['weight'\]"):
        function_onnx_graph("square_error", weight_name="w", input_shapes={"weight": (3,)})


@pytest.mark.parametrize(
    ("shapes", "error", "pattern"),
    [
        ([("X", (3,))], TypeError, "input_shapes must be a mapping"),
        ({"X": 3}, TypeError, "shape of 'X' must be a sequence"),
        ({"X": (3, -1)}, ValueError, "shape of 'X' has an invalid dimension -1"),
        ({"X": (3, 2.5)}, ValueError, "shape of 'X' has an invalid dimension 2.5"),
    ],
)
def test_bad_input_shapes(shapes, error, pattern):
    with pytest.raises(error, match=pattern):
        function_onnx_graph("copy", input_shapes=shapes)


def test_inconsistent_input_shapes_are_reported_with_the_graph():
    with pytest.raises(ValueError, match="'linear_regression' is invalid with the input shapes"):
        function_onnx_graph("linear_regression", input_shapes={"X": (5, 3), "A": (4, 2)})
