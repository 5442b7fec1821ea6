"""The catalogue: names, descriptions, opsets, IR version, validity and fresh copies."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnxgrad._onnx_utils import default_opset
from onnxgrad.functions import function_onnx_graph, get_supported_functions
from onnxgrad.functions.catalogue import max_function_opset
from tests.functions.references import CASES, WEIGHTED
from tests.functions.runtimes import RUNTIMES, onnxruntime_max_opset, tolerance

REQUIRED = {
    "axpy",
    "axpyw",
    "axpyw2",
    "adam",
    "copy",
    "zero",
    "square_error",
    "grad_square_error",
    "grad_loss_square_error",
    "grad_loss_absolute_error",
    "grad_loss_elastic_error",
    "grad_penalty_elastic_error",
    "n_penalty_elastic_error",
    "update_penalty_elastic_error",
    "grad_sigmoid_neg_log_loss_error",
    "linear_regression",
}


def test_supported_functions_are_described_in_one_line():
    supported = get_supported_functions()
    assert set(supported) == REQUIRED
    for name, description in supported.items():
        assert description and "\n" not in description, name


def test_every_supported_function_has_a_numpy_reference():
    assert {c.name for c in CASES} == set(get_supported_functions())


@pytest.mark.parametrize("opset", range(13, max_function_opset() + 1))
def test_every_graph_at_every_opset_is_valid_and_computes_the_reference(opset, rng):
    runtimes = [run for name, run in RUNTIMES.items() if name != "onnxruntime"]
    if opset <= onnxruntime_max_opset():
        runtimes.append(RUNTIMES["onnxruntime"])
    for case in CASES:
        for dtype in (np.float32, np.float64):
            model = function_onnx_graph(case.name, target_opset=opset, dtype=dtype, **case.options)
            onnx.checker.check_model(model, full_check=True)
            assert default_opset(model) == opset
            assert [o.domain for o in model.opset_import] == [""]
            assert model.ir_version == onnx.helper.find_min_ir_version_for(model.opset_import)
            assert not model.functions
            feeds = case.feeds(rng, np.dtype(dtype))
            expected = case.reference(feeds)
            for run in runtimes:
                got = run(model, feeds)
                for name, value in expected.items():
                    np.testing.assert_allclose(got[name], value, **tolerance(dtype))


def test_default_opset_is_18():
    assert default_opset(function_onnx_graph("axpy")) == 18


@pytest.mark.parametrize("dtype", [np.float32, np.float64, "float32", np.dtype("float64")])
def test_declared_types_follow_dtype(dtype):
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    model = function_onnx_graph("grad_sigmoid_neg_log_loss_error", dtype=dtype, weight_name="w")
    types = {
        v.name: v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output)
    }
    assert types == {"X1": onnx.TensorProto.INT64, "X2": elem, "w": elem, "Y": elem, "Y_grad": elem}


def _shape(value: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def test_declared_shapes():
    model = function_onnx_graph("grad_loss_square_error", weight_name="w")
    shapes = {v.name: _shape(v) for v in (*model.graph.input, *model.graph.output)}
    assert shapes == {"X1": ["N", "K"], "X2": ["N", "K"], "w": ["N"], "Y": [], "Y_grad": ["N", "K"]}
    model = function_onnx_graph("linear_regression")
    assert _shape(model.graph.output[0]) == ["N", "T"]
    model = function_onnx_graph("adam", input_shapes={"X": (10,)})
    assert _shape(model.graph.input[0]) == [10] and _shape(model.graph.output[0]) == [10]
    assert _shape(model.graph.input[-1]) == [1]


def test_weight_name_may_reuse_an_internal_name():
    model = function_onnx_graph("grad_loss_elastic_error", dtype=np.float64, weight_name="d")
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == ["X1", "X2", "d"]


def test_formula_is_in_the_doc_string():
    model = function_onnx_graph("axpyw2")
    assert model.graph.name == "axpyw2"
    assert "Nesterov" in model.graph.doc_string
    assert r"\beta Z + \alpha X_1 + X_2" in model.graph.doc_string


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_node_names_are_unique(name):
    model = function_onnx_graph(name, weight_name="w" if name in WEIGHTED else None)
    names = [n.name for n in model.graph.node]
    assert all(names) and len(set(names)) == len(names)


def test_each_call_returns_a_new_model():
    first = function_onnx_graph("axpy")
    first.graph.input[0].name = "changed"
    first.graph.node.pop()
    second = function_onnx_graph("axpy")
    assert second is not first
    assert second.graph.input[0].name == "X1"
    onnx.checker.check_model(second, full_check=True)
