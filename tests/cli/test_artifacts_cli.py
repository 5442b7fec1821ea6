"""``onnxgrad artifacts``: the folder it writes, the options, its one-line errors."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from onnxgrad.training.artifacts.checkpoint import load_tensors
from tests.cli.helpers import assert_failed, run_in_process, run_onnxgrad, save
from tests.models import linear_regression_model


@pytest.fixture
def workdir(tmp_path):
    save(linear_regression_model(np.array([1.0, 2.0]), np.array([0.5])), tmp_path / "lr.onnx")
    rng = np.random.default_rng(0)
    X = rng.standard_normal((64, 2))
    np.savez(tmp_path / "data.npz", X=X, y=X @ np.array([1.0, 2.0]))
    return tmp_path


def _inputs(path) -> set[str]:
    return {i.name for i in onnx.load(path).graph.input}


def test_artifacts_with_frozen_weight_and_data(workdir):
    result = run_onnxgrad(
        "artifacts", "lr.onnx", "-o", "art", "--freeze", "coefs", "--optimizer", "sgd",
        "--lr", "0.05", "--data", "data.npz", cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "wrote art" in result.stdout and "trained: intercept" in result.stdout
    art = workdir / "art"
    assert _inputs(art / "training_model.onnx") == {"X", "label", "intercept", "learning_rate"}
    manifest = json.loads((art / "artifacts.json").read_text())
    assert manifest["learning_rate"]["value"] == 0.05
    data, _ = load_tensors(art / "data.json")
    with np.load(workdir / "data.npz") as npz:
        np.testing.assert_array_equal(data["X"], npz["X"].astype(np.float32))
        np.testing.assert_array_equal(data["label"], npz["y"].astype(np.float32).reshape(-1, 1))


def test_the_output_folder_is_created_with_its_parents(workdir):
    result = run_in_process("artifacts", "lr.onnx", "-o", "site/a/artifacts", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert (workdir / "site" / "a" / "artifacts" / "training_model.onnx").is_file()


def test_artifacts_lora_trains_the_adapters(workdir):
    result = run_in_process(
        "artifacts", "lr.onnx", "-o", "art", "--lora", "coefs", "--lora-rank", "1",
        cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    inputs = _inputs(workdir / "art" / "training_model.onnx")
    assert {"coefs_lora_A", "coefs_lora_B"} <= inputs and "coefs" not in inputs
    assert "intercept" not in inputs


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        (["--loss", "hinge"], "'hinge'"),
        (["--freeze", "nope"], "frozen_params ['nope']"),
        (["--train", "coefs", "--freeze", "coefs"], "both requires_grad and frozen_params"),
        (["--lora", "intercept"], "'intercept' is no float weight"),
    ],
)
def test_artifacts_errors(workdir, options, fragment):
    result = run_in_process("artifacts", "lr.onnx", "-o", "art", *options, cwd=workdir)
    assert_failed(result, 2, fragment)
    assert not (workdir / "art").exists()


def test_data_for_a_model_with_two_inputs_is_refused_before_writing(workdir):
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("MatMul", ["s", "W"], ["y"])],
        "two_inputs",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 2]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", 2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])],
        [onnx.numpy_helper.from_array(np.ones((2, 1), np.float32), "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    save(model, workdir / "two.onnx")
    result = run_onnxgrad("artifacts", "two.onnx", "-o", "art", "--data", "data.npz", cwd=workdir)
    assert_failed(result, 2, "--data feeds one input, the model has ['a', 'b']")
    assert not (workdir / "art").exists()


def test_artifacts_target_webgpu(workdir):
    result = run_onnxgrad("artifacts", "lr.onnx", "-o", "art", "--target", "webgpu", cwd=workdir)
    assert result.returncode == 0, result.stderr
    ops = {n.op_type for n in onnx.load(workdir / "art" / "training_model.onnx").graph.node}
    assert not ops & {"Sum", "Loop", "Scan", "If"}, ops
