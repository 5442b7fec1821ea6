"""runtime_adapter_model beside a ``Conv``: ``Conv(x, W) + s branch(x)``
(:mod:`onnxgrad.graph.conv_branch`) against ``merge_lora`` and the adapted training model
with random non-zero ``A`` and ``B``, in float64 (onnx's reference evaluator) and in float32
(onnxruntime at its default optimization level); and where the cost model puts it."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import add_lora, merge_lora
from onnxgrad.graph import lora_runtime
from onnxgrad.graph.lora import lora_adapters
from onnxgrad.graph.lora_choice import conv_branch_pays
from onnxgrad.graph.lora_runtime import runtime_adapter_model

RANK = 3

#: (in channels, out channels, kernel side, spatial dims, bias, Conv attributes)
CASES = {
    "dense, padded": (4, 6, 3, 2, True, {"pads": [1, 1, 1, 1]}),
    "strided, dilated, no bias": (
        4, 6, 3, 2, False, {"strides": [2, 2], "dilations": [2, 2], "pads": [1, 0, 2, 1]},
    ),
    "grouped": (6, 4, 3, 2, True, {"group": 2, "strides": [2, 1]}),
    "depthwise": (5, 5, 3, 2, True, {"group": 5, "pads": [1, 1, 1, 1]}),
    "depthwise x2, SAME_UPPER": (
        4, 8, 3, 2, False, {"group": 4, "auto_pad": "SAME_UPPER", "strides": [2, 2]},
    ),
    "SAME_UPPER": (4, 6, 4, 2, True, {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    "1-D grouped": (6, 6, 3, 1, True, {"group": 3, "pads": [1, 1]}),
    "3-D": (2, 3, 2, 3, False, {"strides": [1, 2, 1]}),
}  # fmt: skip


def _conv_model(cin, cout, side, dims, bias, attrs, matmul=False) -> onnx.ModelProto:
    """``Relu(Conv(x, W, b))`` in float64 over ``[N, cin, 7, ...]`` (``matmul``: then a
    ``MatMul`` over the last axis, a product adapted beside the ``Conv``)."""
    rng = np.random.default_rng(0)
    group = attrs.get("group", 1)
    inits = [
        numpy_helper.from_array(rng.standard_normal((cout, cin // group, *[side] * dims)), "W")
    ]
    inputs = ["x", "W"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(cout), "bias"))
        inputs.append("bias")
    nodes = [
        helper.make_node("Conv", inputs, ["y"], name="conv", **attrs),
        helper.make_node("Relu", ["y"], ["z"], name="relu"),
    ]
    output = "z"
    if matmul:
        inits.append(numpy_helper.from_array(rng.standard_normal((4, 5)), "M"))
        nodes.append(helper.make_node("MatMul", ["z", "M"], ["out"], name="product"))
        output = "out"
    spatial = [None] * dims
    graph = helper.make_graph(
        nodes,
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["N", cin, *spatial])],
        [helper.make_tensor_value_info(output, TensorProto.DOUBLE, ["N", None, *spatial])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _trained(adapted: onnx.ModelProto) -> onnx.ModelProto:
    """``adapted`` with every ``A`` and ``B`` drawn anew, non-zero."""
    rng = np.random.default_rng(1)
    parts = {a[key] for a in lora_adapters(adapted) for key in ("a", "b")}
    for init in adapted.graph.initializer:
        if init.name in parts:
            value = rng.standard_normal(tuple(init.dims))
            init.CopyFrom(numpy_helper.from_array(value.astype(np.float64), init.name))
    return adapted


def _float32(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its float64 tensors, values, constants and casts in float32."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    for init in graph.initializer:
        if init.data_type == TensorProto.DOUBLE:
            value = numpy_helper.to_array(init).astype(np.float32)
            init.CopyFrom(numpy_helper.from_array(value, init.name))
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.type.tensor_type.elem_type == TensorProto.DOUBLE:
            value.type.tensor_type.elem_type = TensorProto.FLOAT
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.name == "to" and attribute.i == TensorProto.DOUBLE:
                attribute.i = TensorProto.FLOAT
            if attribute.name == "value" and attribute.t.data_type == TensorProto.DOUBLE:
                value = numpy_helper.to_array(attribute.t).astype(np.float32)
                attribute.t.CopyFrom(numpy_helper.from_array(value))
    return copy


def _reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ReferenceEvaluator(model).run(None, {"x": x})[0]


def _onnxruntime(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.fixture
def branch_everywhere(monkeypatch):
    """A branch beside every adapted ``Conv``, whatever the cost model says."""
    monkeypatch.setattr(lora_runtime, "conv_branch_pays", lambda *shape: True)


def _branched(deployed, adapted, **options):
    """The runtime model, checked to keep ``W`` a constant kernel of the ``Conv``."""
    runtime = runtime_adapter_model(deployed, adapted, **options)
    readers = [n for n in runtime.graph.node if "W" in n.input]
    assert [n.op_type for n in readers] == ["Conv"], "the kernel is no longer read as it was"
    return runtime


@pytest.mark.parametrize("case", CASES)
def test_conv_branch_is_the_adapted_convolution(case, branch_everywhere):
    deployed = _conv_model(*CASES[case])
    adapted = _trained(add_lora(deployed, rank=RANK, alpha=2.0 * RANK))
    runtime = _branched(deployed, adapted)
    cin, dims = CASES[case][0], CASES[case][3]
    x = np.random.default_rng(2).standard_normal((2, cin, *[7] * dims))
    want = _reference(merge_lora(adapted), x)
    scale = np.abs(want).max()
    assert np.abs(_reference(runtime, x) - want).max() < 1e-12 * scale
    assert np.abs(_reference(runtime, x) - _reference(adapted, x)).max() < 1e-12 * scale
    assert np.abs(_reference(deployed, x) - want).max() > 0.1 * scale  # the adapters count
    single = _onnxruntime(_branched(_float32(deployed), _float32(adapted)), x.astype(np.float32))
    assert np.abs(single - want).max() < 1e-5 * scale


def test_conv_and_product_branches_together(branch_everywhere):
    """A ``Conv`` branch and a ``MatMul`` branch in one model (the ``MatMul``'s branch
    finds its node in the graph after the ``Conv``'s was added); with ``apply="auto"`` the
    ``Conv``'s branch runs before the ``If`` choosing the ``MatMul``'s way: 40 rows, the
    branch, 160 rows, the updated weight."""
    deployed = _conv_model(3, 4, 3, 2, True, {"pads": [1, 1, 1, 1]}, matmul=True)
    adapted = _trained(add_lora(deployed, rank=RANK))
    models = {
        "branch": _branched(_float32(deployed), _float32(adapted)),
        "auto": _branched(_float32(deployed), _float32(adapted), apply="auto", rows=100),
    }
    assert "If" in [n.op_type for n in models["auto"].graph.node]
    for height in (5, 20):
        x = np.random.default_rng(3).standard_normal((2, 3, height, 4))
        want = _reference(merge_lora(adapted), x)
        for apply, runtime in models.items():
            got = _onnxruntime(runtime, x.astype(np.float32))
            assert np.abs(got - want).max() < 1e-5 * np.abs(want).max(), (apply, height)


def test_weights_applied_per_run_keep_the_kernel_update(branch_everywhere):
    deployed = _conv_model(*CASES["dense, padded"])
    runtime = runtime_adapter_model(deployed, add_lora(deployed, rank=RANK), apply="weights")
    assert [n.op_type for n in runtime.graph.node if "W" in n.input] == ["Add"]


def test_cost_model_puts_the_branch_beside_large_dense_convolutions_only():
    """Measured (benchmarks/bench_conv_branch.py): faster beside a dense, unstrided ``k > 1``
    convolution whose branch adds at most 4% of its multiply-adds, slower elsewhere."""
    assert conv_branch_pays(1, 512, 9, 512, 8)
    assert conv_branch_pays(1, 256, 9, 256, 8)  # the branch adds 3.5%
    assert not conv_branch_pays(1, 512, 9, 512, 8, strided=True)
    assert not conv_branch_pays(1, 128, 9, 128, 8)  # the branch adds 7%
    assert not conv_branch_pays(1, 1024, 1, 256, 8)  # pointwise
    assert not conv_branch_pays(4, 16, 9, 64, 8)  # grouped
    assert not conv_branch_pays(64, 1, 9, 64, 8)  # depthwise
    small = _conv_model(*CASES["dense, padded"])
    runtime = runtime_adapter_model(small, add_lora(small, rank=RANK))
    assert [n.op_type for n in runtime.graph.node if "W" in n.input] == ["Add"]
    large = _conv_model(512, 512, 3, 2, True, {"pads": [1, 1, 1, 1]})
    _branched(large, add_lora(large, rank=8))


def test_a_kernel_a_subgraph_reads_too_gets_no_branch(branch_everywhere):
    """The ``Conv`` branched and an ``If`` body reading ``W`` unchanged would disagree: the
    update's refusal names that reader instead."""
    deployed = _conv_model(*CASES["dense, padded"])
    adapted = add_lora(deployed, rank=RANK)  # add_lora itself refuses the If below
    body = helper.make_graph(
        [helper.make_node("Identity", ["W"], ["w_out"], name="inner")],
        "body",
        [],
        [helper.make_tensor_value_info("w_out", TensorProto.DOUBLE, None)],
    )
    flag = numpy_helper.from_array(np.array(True), "flag")
    deployed.graph.initializer.append(flag)
    deployed.graph.node.append(
        helper.make_node(
            "If", ["flag"], ["w_seen"], name="branchy", then_branch=body, else_branch=body
        )
    )
    deployed.graph.output.append(helper.make_tensor_value_info("w_seen", TensorProto.DOUBLE, None))
    with pytest.raises(ValueError, match="subgraph of node 'branchy'"):
        runtime_adapter_model(deployed, adapted)
