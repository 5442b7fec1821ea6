"""onnxgrad.training.artifacts.webgpu without a browser: Sum as Adds computes what numpy computes,
the placement log is parsed and sorted by what each CPU node reads, the target option."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxgrad.training import generate_artifacts
from onnxgrad.training.artifacts.webgpu import (
    check_target,
    check_webgpu_model,
    classify_placement,
    parse_placements,
    sums_as_adds,
)


def _sum_model(n_inputs: int) -> onnx.ModelProto:
    names = [f"x{i}" for i in range(n_inputs)]
    shapes = [[2, 3], [3], [1, 3], [2, 1]][:n_inputs]
    graph = helper.make_graph(
        [
            helper.make_node("Sum", names, ["s"], name="total"),
            helper.make_node("Shape", ["s"], ["shape"], name="size"),
            helper.make_node("ReduceSum", ["shape"], ["count"], name="count_sum", keepdims=0),
        ],
        "sums",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in zip(names, shapes)],
        [
            helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("count", TensorProto.INT64, []),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


@pytest.mark.parametrize("n_inputs", [1, 2, 4])
def test_sums_as_adds_computes_the_sum(n_inputs):
    model = _sum_model(n_inputs)
    sums_as_adds(model.graph)
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert "Sum" not in ops and ops.count("Add") == n_inputs - 1
    rng = np.random.default_rng(0)
    feeds = {
        i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(
            np.float32
        )
        for i in model.graph.input
    }
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = sum(feeds.values())
    np.testing.assert_allclose(session.run(["s"], feeds)[0], expected, rtol=1e-6)


P = "error: 2026 [V:onnxruntime:, session_state.cc:1385 VerifyEachNodeIsAssignedToAnEp] "
LOG = [
    "log: onnxgrad-session: m.onnx",
    P + "Node placements",
    P + " Node(s) placed on [CPUExecutionProvider]. Number of nodes: 4",
    P + "  Sum (total)",
    P + "  Shape (size)",
    P + "  ReduceSum (count_sum)",
    P + "  Gather (Gather)\x1b[m",
    P + " Node(s) placed on [WebGpuExecutionProvider]. Number of nodes: 7",
    P + "  Add (a)",
    "log: onnxgrad-session: e.onnx",
    P + " All nodes placed on [WebGpuExecutionProvider]. Number of nodes: 8",
]


def test_placements_sorted_by_what_cpu_nodes_read():
    sessions = parse_placements(LOG)
    assert sessions["e.onnx"] == {"WebGpuExecutionProvider": (8, [])}
    placed = sessions["m.onnx"]
    assert placed["WebGpuExecutionProvider"] == (7, [("Add", "a")])
    placement = classify_placement(_sum_model(2), placed)
    # Sum and Shape read a float tensor: they count (conservative for Shape)
    assert placement.fallbacks == [("Sum", "total"), ("Shape", "size")]
    assert placement.shape == [("ReduceSum", "count_sum")]
    assert placement.inserted == [("Gather", "Gather")]
    assert placement.on_gpu == 7


def test_target_option():
    with pytest.raises(ValueError, match="target must be one of"):
        check_target("gpu")
    loop_body = helper.make_graph([], "b", [], [])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["", ""], [], name="tiles", body=loop_body)], "g", [], []
    )
    with pytest.raises(ValueError, match="'tiles' \\(Loop\\) has no WebGPU kernel"):
        check_webgpu_model(helper.make_model(graph), "train step")


def test_webgpu_artifacts_have_no_control_flow_nor_sum(tmp_path):
    from tests.examples.test_js_training import _attention_case

    model = _attention_case()[0]
    default = generate_artifacts(model, folder=tmp_path / "default")
    webgpu = generate_artifacts(model, folder=tmp_path / "webgpu", target="webgpu")
    assert "Loop" in {n.op_type for n in default.train_step.model.graph.node}
    ops = {n.op_type for n in webgpu.train_step.model.graph.node}
    assert not ops & {"Loop", "Scan", "If", "Sum"}, ops
