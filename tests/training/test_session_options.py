"""Training sessions get the options of :mod:`onnxgrad.training.running.session_options` unless the
caller passes its own."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.training import (
    LearningRateAdam,
    LearningRateSGDNesterov,
    TrainingRunner,
    make_train_step,
)
from onnxgrad.training.running.data import OrtDataLoader
from onnxgrad.training.running.devices import check_device
from onnxgrad.training.running.session_options import training_session_options
from onnxgrad.training.step.losses import SquareLearningLoss
from tests.models import linear_regression_model


def test_defaults_and_overrides():
    options = training_session_options(2)
    assert not options.enable_mem_pattern
    assert options.enable_cpu_mem_arena
    assert not training_session_options(enable_cpu_mem_arena=False).enable_cpu_mem_arena
    assert options.intra_op_num_threads == 2
    assert training_session_options(enable_mem_pattern=True).enable_mem_pattern
    assert not options.enable_mem_reuse
    assert training_session_options(enable_mem_reuse=True).enable_mem_reuse
    with pytest.raises(ValueError, match="no option 'enable_memory_pattern'"):
        training_session_options(enable_memory_pattern=False)


def test_runner_uses_them_unless_given_its_own():
    model = linear_regression_model(np.zeros((1, 3)), np.zeros(1))
    step = make_train_step(model, learning_rate=LearningRateSGDNesterov())
    weights = {"coefs": np.zeros((3, 1), np.float32), "intercept": np.zeros(1, np.float32)}
    cpu = check_device("cpu")
    runner = TrainingRunner(step, cpu, weights)
    assert not runner.session.get_session_options().enable_mem_pattern
    assert not runner.session.get_session_options().enable_mem_reuse
    mine = ort.SessionOptions()
    runner = TrainingRunner(step, cpu, weights, session_options=mine)
    assert runner.session.get_session_options().enable_mem_pattern
    assert runner.session.get_session_options().enable_mem_reuse


def test_training_sessions_share_one_cpu_arena():
    """The sessions allocate from the arena registered in onnxruntime's environment (not
    with the arena off), and train exactly as a session with its own arena."""
    from onnxgrad.training.running.cpu_arena import USE_SHARED_ARENA

    key, value = USE_SHARED_ARENA
    assert training_session_options().get_session_config_entry(key) == value
    alone = training_session_options(enable_cpu_mem_arena=False)
    with pytest.raises(RuntimeError, match="does not have configuration"):
        alone.get_session_config_entry(key)
    rng = np.random.default_rng(0)
    X = rng.standard_normal((16, 3)).astype(np.float32)
    y = (X @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)
    model = linear_regression_model(np.zeros((1, 3)), np.zeros(1))
    step = make_train_step(model, learning_rate=LearningRateSGDNesterov(eta0=0.05))
    cpu = check_device("cpu")
    trained = []
    for options in (training_session_options(), ort.SessionOptions()):
        weights = {"coefs": np.zeros((3, 1), np.float32), "intercept": np.zeros(1, np.float32)}
        runner = TrainingRunner(step, cpu, weights, session_options=options)
        loader = OrtDataLoader(X, y, batch_size=4, random_state=0)
        for _ in range(3):
            runner.run_epoch(loader, 0.05)
        trained.append(runner.get_weights())
    assert trained[0]["coefs"].any()
    for name in trained[0]:
        np.testing.assert_array_equal(trained[0][name], trained[1][name])


def _reshaping_model(layers: int = 3, width: int = 8):
    """``h_{i+1} = sum over the pair axis of tanh(reshape(h_i W_i, [N, T, 2, width]))``,
    then the mean over features: every layer's backward reshapes its gradient to the shape of
    ``h_i W_i``, a forward value read by nothing else after its own ``Reshape``."""
    rng = np.random.default_rng(0)
    node = helper.make_node
    nodes, weights = [], {}
    constants = {
        "pairs": np.array([0, 0, 2, width], np.int64),
        "pair_axis": np.array([2], np.int64),
        "feature_axis": np.array([2], np.int64),
    }
    previous = "X"
    for i in range(layers):
        weights[f"w{i}"] = (0.3 * rng.standard_normal((width, 2 * width))).astype(np.float32)
        nodes += [
            node("MatMul", [previous, f"w{i}"], [f"m{i}"], name=f"matmul{i}"),
            node("Reshape", [f"m{i}", "pairs"], [f"v{i}"], name=f"view{i}"),
            node("Tanh", [f"v{i}"], [f"t{i}"], name=f"tanh{i}"),
            node("ReduceSum", [f"t{i}", "pair_axis"], [f"h{i}"], keepdims=0, name=f"sum{i}"),
        ]
        previous = f"h{i}"
    nodes.append(node("ReduceMean", [previous, "feature_axis"], ["Y"], keepdims=0, name="mean"))
    initializers = {**weights, **constants}
    graph = helper.make_graph(
        nodes,
        "reshaping",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", "T", width])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", "T"])],
        [numpy_helper.from_array(v, name=k) for k, v in initializers.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return model, weights


def test_shapes_of_forward_values_are_taken_in_the_forward(tmp_path):
    """A backward ``Shape`` of a forward value runs before the backward's first computing
    node, so the value is freed after its last forward reader: onnxruntime 1.32's ``DEFAULT``
    order reached it only from the backward (the first layer's ``Shape`` ran 114th of the
    145 nodes), keeping every such value alive across the step."""
    model, weights = _reshaping_model()
    step = make_train_step(model, loss=SquareLearningLoss(), learning_rate=LearningRateAdam())
    forward_values = {o for n in step.model.graph.node if "_Grad" not in n.name for o in n.output}
    shapes_of_forward = {
        n.name
        for n in step.model.graph.node
        if n.op_type == "Shape" and n.input[0] in forward_values and "_Grad" in n.name
    }
    options = training_session_options(enable_profiling=True)
    options.profile_file_prefix = str(tmp_path / "step")
    runner = TrainingRunner(step, check_device("cpu"), weights, session_options=options)
    rng = np.random.default_rng(1)
    X = rng.standard_normal((4, 5, 8)).astype(np.float32)
    y = rng.standard_normal((4, 5)).astype(np.float32)
    runner.run_epoch(OrtDataLoader(X, y, batch_size=4), 0.01)
    with open(runner.session.end_profiling()) as profile:
        events = json.load(profile)
    suffix = "_kernel_time"
    ran = [
        e["name"][: -len(suffix)]
        for e in events
        if e.get("cat") == "Node" and e["name"].endswith(suffix)
    ]
    kinds = {n.name: n.op_type for n in step.model.graph.node}
    first_backward = min(
        i for i, name in enumerate(ran) if "_Grad" in name and kinds.get(name) != "Shape"
    )
    assert {"view0_Grad/Shape", "view1_Grad/Shape", "view2_Grad/Shape"} <= shapes_of_forward
    late = [name for name in ran[first_backward:] if name in shapes_of_forward]
    assert not late, f"taken in the backward: {late}"


def test_products_of_dequantized_integer_weights_compute_in_float():
    """onnxruntime 1.20+ fuses ``MatMul(x, DequantizeLinear(int8 W))`` into ``MatMulNBits``,
    which rounds ``x`` to int8 by default (4e-3 of the output off the specification's float
    product); training sessions ask for float32 compute (1.19 does not fuse: same result)."""
    rng = np.random.default_rng(0)
    codes = rng.integers(-127, 128, (256, 64)).astype(np.int8)
    scale = (rng.random(64) * 0.01 + 0.001).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("DequantizeLinear", ["w", "s"], ["wf"], axis=1),
            helper.make_node("MatMul", ["x", "wf"], ["y"]),
        ],
        "dequantized_product",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 64])],
        [numpy_helper.from_array(codes, "w"), numpy_helper.from_array(scale, "s")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    x = rng.standard_normal((8, 256)).astype(np.float32)
    expected = x.astype(np.float64) @ (codes.astype(np.float64) * scale.astype(np.float64))
    session = ort.InferenceSession(
        model.SerializeToString(), training_session_options(1), providers=["CPUExecutionProvider"]
    )
    (y,) = session.run(None, {"x": x})
    assert np.abs(y - expected).max() <= 1e-5 * np.abs(expected).max()
