"""Error messages around converted models: the opset of the operator's own domain, the
command line's spelling, no hint towards a backend known to fail on the same operator."""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper

from onnxgrad import onnx_derivative
from onnxgrad.cli_common import one_line
from onnxgrad.derivative.ort.backend import builder_error

ML = "ai.onnx.ml"


def _svm_probit(opset: int):
    """An ``ai.onnx.ml`` operator that stays as it is: the lowering has no ``PROBIT``."""
    node = helper.make_node(
        "SVMClassifier",
        ["X"],
        ["label", "scores"],
        domain=ML,
        name="svm",
        coefficients=[1.0, -1.0],
        support_vectors=[0.0, 1.0, 1.0, 0.0],
        vectors_per_class=[1, 1],
        rho=[0.0],
        classlabels_ints=[0, 1],
        kernel_type="RBF",
        kernel_params=[0.5, 0.0, 3.0],
        post_transform="PROBIT",
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 2])],
        [
            helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, 2]),
        ],
    )
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(ML, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


@pytest.mark.parametrize("opset", [12, 15])
def test_a_missing_ml_rule_names_the_ml_opset_and_no_other_backend(opset):
    with pytest.raises(NotImplementedError) as info:
        onnx_derivative(_svm_probit(opset))
    message = str(info.value)
    assert "'SVMClassifier' (domain 'ai.onnx.ml', opset 1) at node 'svm'" in message
    assert "post_transform 'PROBIT' has no lowering" in message
    assert "backend='ort'" not in message  # onnxruntime-training has no ml gradients


def test_the_command_line_speaks_its_own_spelling():
    text = one_line(NotImplementedError("no rule; try backend='ort'. Or backend='onnx'"))
    assert text == "no rule; try --backend ort. Or --backend onnx"


def test_the_ort_backend_sends_nobody_to_a_native_backend_that_fails_too():
    model = _svm_probit(15)
    message = "gradient builder has not been registered: SVMClassifier for node svm"
    error = str(builder_error(message, model))
    assert "backend='onnx'" not in error.replace("(backend='onnx') has no rule", "")
    assert "has no rule for it either" in error
    relu = helper.make_model(
        helper.make_graph(
            [helper.make_node("Relu", ["x"], ["y"], name="r")],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        ),
        opset_imports=[helper.make_opsetid("", 15)],
    )
    hint = str(builder_error("gradient builder has not been registered: Relu for node r", relu))
    assert hint.endswith("try backend='onnx'")


@pytest.mark.parametrize(
    ("node_domain", "opset_domain"), [("ai.onnx", ""), ("", "ai.onnx"), ("ai.onnx", "ai.onnx")]
)
def test_the_hint_reads_the_default_domain_however_it_is_spelled(node_domain, opset_domain):
    relu = helper.make_model(
        helper.make_graph(
            [helper.make_node("Relu", ["x"], ["y"], name="r", domain=node_domain)],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        ),
        opset_imports=[helper.make_opsetid(opset_domain, 15)],
    )
    hint = str(builder_error("gradient builder has not been registered: Relu for node r", relu))
    assert hint.endswith("try backend='onnx'")
