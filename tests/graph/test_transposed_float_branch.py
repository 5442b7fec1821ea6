"""A float weight a ``MatMul`` reads through ``Transpose`` (``h W^T``: a tied weight's
second reader): the runtime adapter model adds the branch ``s (h B^T) A^T`` beside that
product, as beside a plain ``MatMul`` weight's, and the deployed ``Transpose`` reads ``W`` as
stored (before: ``W + s A B`` computed once per run before all the readers)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import add_lora, merge_lora
from onnxgrad.graph.initializers import replace_initializers_into_onnx
from onnxgrad.graph.lora import lora_adapters
from onnxgrad.graph.lora_runtime import runtime_adapter_model

M, K, N = 4, 6, 5


def _deployed(rng, shared: bool = False):
    """``h = relu(x W)``, ``y = h W^T`` (a tied weight, ``W`` ``K x N``, its second reader
    through ``Transpose``); where ``shared``, a reader of ``W^T`` that is no product (an
    ``Add``) keeps the update."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="first"),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Transpose", ["W"], ["W_t"], perm=[1, 0], name="transpose"),
        helper.make_node("MatMul", ["r", "W_t"], ["y"], name="second"),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, K])]
    if shared:
        nodes.append(helper.make_node("Add", ["W_t", "W_t"], ["doubled"]))
        outputs.append(helper.make_tensor_value_info("doubled", TensorProto.FLOAT, [N, K]))
    weight = numpy_helper.from_array(rng.standard_normal((K, N)).astype(np.float32), "W")
    graph = helper.make_graph(
        nodes,
        "tied",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
        outputs,
        [weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _trained(model, rng):
    adapted = add_lora(model, rank=2, alpha=3.0)
    shapes = {i.name: tuple(i.dims) for i in adapted.graph.initializer}
    values = {}
    for adapter in lora_adapters(adapted):
        for key in ("a", "b"):
            name = adapter[key]
            values[name] = rng.standard_normal(shapes[name]).astype(np.float32)
    return replace_initializers_into_onnx(adapted, values)


def _run(model, x):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    return dict(zip(names, session.run(names, {"x": x})))


@pytest.mark.parametrize("shared", [False, True], ids=["product", "also_read"])
def test_a_weight_read_through_transpose_gets_a_branch_beside_its_product(shared):
    rng = np.random.default_rng(0)
    deployed = _deployed(rng, shared)
    trained = _trained(deployed, rng)
    assert [a["weight"] for a in lora_adapters(trained)] == ["W"]
    served = runtime_adapter_model(deployed, trained)
    transpose = next(n for n in served.graph.node if n.name == "transpose")
    ops = [n.op_type for n in served.graph.node]
    if shared:  # the Add reads W^T too: W + s A B before the Transpose
        assert transpose.input[0] != "W"
        assert ops.count("MatMul") == 3
    else:  # the deployed nodes, W read as stored, a branch beside each product
        assert transpose.input[0] == "W"
        assert ops.count("MatMul") == 2 + 2 * 2 and ops.count("Add") == 2
        assert ops.count("Transpose") == 1 + 2  # (h B^T) A^T
    x = rng.standard_normal((M, K)).astype(np.float32)
    want = _run(merge_lora(trained), x)
    got = _run(served, x)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5)


def test_a_weight_read_only_through_transpose_gets_an_adapter_by_default():
    """``y = relu(x W^T) V`` (``W`` ``N x K``: PyTorch's ``Linear`` exported unfolded, as
    wav2vec2's export reads 14 of its 15 linear layers): add_lora adapts ``W`` too (before:
    ``V`` only); the merged model has the file's operators and computes what the adapted one
    does, and the runtime adapter model adds a branch beside the product."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("Transpose", ["W"], ["W_t"], perm=[1, 0], name="transpose"),
        helper.make_node("MatMul", ["x", "W_t"], ["h"], name="first"),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "V"], ["y"], name="second"),
    ]
    inits = {
        "W": rng.standard_normal((N, K)).astype(np.float32),
        "V": rng.standard_normal((N, N)).astype(np.float32),
    }
    graph = helper.make_graph(
        nodes,
        "unfolded",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, N])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    trained = _trained(model, rng)
    assert sorted(a["weight"] for a in lora_adapters(trained)) == ["V", "W"]
    x = rng.standard_normal((M, K)).astype(np.float32)
    merged = merge_lora(trained)
    assert [n.op_type for n in merged.graph.node] == [n.op_type for n in model.graph.node]
    np.testing.assert_allclose(_run(merged, x)["y"], _run(trained, x)["y"], rtol=1e-5, atol=1e-5)
    assert np.abs(_run(merged, x)["y"] - _run(model, x)["y"]).max() > 0.1
    served = runtime_adapter_model(model, trained)
    assert next(n for n in served.graph.node if n.name == "transpose").input[0] == "W"
    np.testing.assert_allclose(_run(served, x)["y"], _run(merged, x)["y"], rtol=1e-5, atol=1e-5)
