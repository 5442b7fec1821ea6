"""On-device training artifacts: the files, their inputs, the checkpoint format, the merge.

References: numpy (the checkpoint bytes, the loss of a batch), scikit-learn (predictions of
the model the artifacts come from) and onnxruntime running the saved graphs.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxgrad.training import (
    Checkpoint,
    LearningRateSGDNesterov,
    OrtDataLoader,
    TrainingRunner,
    generate_artifacts,
    load_checkpoint,
    load_train_step,
    merge_checkpoint,
    parse_device,
    save_checkpoint,
)
from onnxgrad.training.artifacts.checkpoint import ALIGNMENT, load_tensors, save_tensors
from tests.graph.sklearn_models import mlp_regressor


class InOrder(OrtDataLoader):
    """Batches in row order, as the JavaScript example takes them."""

    def epoch_order(self) -> np.ndarray:
        return np.arange(len(self), dtype=np.int64)


def _run(path, feeds):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.fixture(scope="module")
def mlp():
    return mlp_regressor()


@pytest.fixture(scope="module")
def artifacts(mlp, tmp_path_factory):
    return generate_artifacts(mlp.onnx, artifact_directory=tmp_path_factory.mktemp("art"))


def test_tensor_file_is_raw_little_endian_with_a_json_manifest(tmp_path):
    tensors = {
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "step": np.array([3], dtype=np.int64),
        "d": np.array([[1.5], [-2.0]]),
    }
    save_tensors(tensors, tmp_path / "t.json", {"w": "weights"})
    manifest = json.loads((tmp_path / "t.json").read_text())
    data = (tmp_path / "t.bin").read_bytes()
    assert [e["name"] for e in manifest["tensors"]] == ["w", "step", "d"]
    for entry, (name, array) in zip(manifest["tensors"], tensors.items()):
        assert entry["offset"] % ALIGNMENT == 0
        assert entry["dtype"] == array.dtype.name and entry["shape"] == list(array.shape)
        raw = data[entry["offset"] : entry["offset"] + entry["nbytes"]]
        assert raw == array.astype(array.dtype.newbyteorder("<")).tobytes(), name
    loaded, groups = load_tensors(tmp_path / "t.json")
    assert groups == {"w": "weights", "step": "tensors", "d": "tensors"}
    for name, array in tensors.items():
        np.testing.assert_array_equal(loaded[name], array)
        assert loaded[name].dtype == array.dtype


def test_checkpoint_round_trip_and_errors(tmp_path):
    checkpoint = Checkpoint({"w": np.ones((2, 2), np.float32)}, {"m": np.zeros(3, np.float32)})
    save_checkpoint(checkpoint, tmp_path / "c.json")
    loaded = load_checkpoint(tmp_path / "c.json")
    assert list(loaded.weights) == ["w"] and list(loaded.optimizer_state) == ["m"]
    np.testing.assert_array_equal(loaded.weights["w"], checkpoint.weights["w"])
    with pytest.raises(ValueError, match=r"\.json manifest"):
        save_checkpoint(checkpoint, tmp_path / "c.bin")
    with pytest.raises(ValueError, match="both weights and optimizer state"):
        save_checkpoint(Checkpoint({"w": np.ones(1)}, {"w": np.ones(1)}), tmp_path / "d.json")
    (tmp_path / "c.bin").write_bytes(b"\0" * 4)
    with pytest.raises(ValueError, match=r"'w'.*needs 16 bytes"):
        load_checkpoint(tmp_path / "c.json")
    with pytest.raises(TypeError, match="dtype object"):
        save_tensors({"s": np.array(["a"], dtype=object)}, tmp_path / "s.json")


def test_files_and_train_step_inputs(artifacts, mlp):
    folder = artifacts.directory
    for name in (
        "training_model.onnx",
        "eval_model.onnx",
        "inference_model.onnx",
        "checkpoint.json",
        "checkpoint.bin",
        "artifacts.json",
    ):
        assert (folder / name).is_file(), name
    step = onnx.load(folder / "training_model.onnx")
    onnx.checker.check_model(step, full_check=True)
    assert {n.domain for n in step.graph.node} <= {""}
    inputs = [i.name for i in step.graph.input]
    state = list(artifacts.checkpoint.optimizer_state)
    weights = list(artifacts.checkpoint.weights)
    assert sorted(inputs) == sorted(["X", "label", *weights, *state, "learning_rate"])
    assert sorted(weights) == sorted(
        i.name for i in mlp.onnx.graph.initializer if "coef" in i.name or "intercept" in i.name
    )
    inference = onnx.load(folder / "inference_model.onnx")
    assert [i.name for i in inference.graph.input] == [i.name for i in mlp.onnx.graph.input]
    assert [o.name for o in inference.graph.output] == [o.name for o in mlp.onnx.graph.output]


def test_eval_model_is_the_summed_squared_error(artifacts, mlp):
    X, y = mlp.X.astype(np.float32), mlp.y.astype(np.float32).reshape(-1, 1)
    feeds = {"X": X, "label": y, **artifacts.checkpoint.weights}
    (loss,) = _run(artifacts.path("eval_model.onnx"), feeds)
    expected = np.sum((mlp.estimator.predict(X).reshape(-1, 1) - y) ** 2)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)


def test_frozen_params_are_folded_initializers(mlp, tmp_path):
    frozen = ["coefficient", "intercepts"]
    art = generate_artifacts(mlp.onnx, frozen_params=frozen, optimizer="sgd", folder=tmp_path)
    step = onnx.load(tmp_path / "training_model.onnx")
    inputs = {i.name for i in step.graph.input}
    initializers = {i.name for i in step.graph.initializer}
    assert set(frozen) <= initializers and not set(frozen) & inputs
    assert inputs == {"X", "label", "coefficient1", "intercepts1", "learning_rate"}
    assert set(art.checkpoint.weights) == {"coefficient1", "intercepts1"}
    assert art.checkpoint.optimizer_state == {}


def test_saved_step_trains_like_the_runner_and_merges_back(artifacts, mlp, tmp_path):
    """The saved step, run in a plain loop (what any runtime does), matches the runner on
    the in-memory step; the merged model predicts with the trained weights."""
    X, y = mlp.X.astype(np.float32), mlp.y.astype(np.float32).reshape(-1, 1)
    step = load_train_step(artifacts.directory)
    runner = TrainingRunner(
        artifacts.train_step,
        parse_device("cpu"),
        artifacts.checkpoint.weights,
        artifacts.checkpoint.optimizer_state,
    )
    expected = np.concatenate(
        [runner.run_epoch(InOrder(X, y, batch_size=16), 0.01) for _ in range(2)]
    )
    session = ort.InferenceSession(
        str(artifacts.path("training_model.onnx")), providers=["CPUExecutionProvider"]
    )
    values = {**artifacts.checkpoint.weights, **artifacts.checkpoint.optimizer_state}
    outputs = [step.loss, *step.new_weights, *step.new_state]
    losses = []
    for _ in range(2):
        for start in range(0, len(X), 16):
            feeds = {"X": X[start : start + 16], "label": y[start : start + 16], **values}
            feeds["learning_rate"] = np.array(0.01, np.float32)
            loss, *new = session.run(outputs, feeds)
            losses.append(loss)
            values = dict(zip([*step.weights, *step.state], new))
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    first = np.sum((mlp.estimator.predict(X[:16]).reshape(-1, 1) - y[:16]) ** 2)
    np.testing.assert_allclose(losses[0], first, rtol=1e-5)

    trained = Checkpoint({w: values[w] for w in step.weights}, {s: values[s] for s in step.state})
    save_checkpoint(trained, tmp_path / "trained.json")
    merged = merge_checkpoint(artifacts.directory, tmp_path / "trained.json")
    session = ort.InferenceSession(merged.SerializeToString(), providers=["CPUExecutionProvider"])
    (prediction,) = session.run(None, {"X": X})
    W1, b1, W2, b2 = (
        values[w] for w in ("coefficient", "intercepts", "coefficient1", "intercepts1")
    )
    reference = np.maximum(X @ W1 + b1, 0) @ W2 + b2
    np.testing.assert_allclose(prediction.reshape(-1, 1), reference, rtol=1e-5, atol=1e-6)
    runner_weights = runner.get_weights()
    for name in step.weights:
        np.testing.assert_allclose(values[name], runner_weights[name], rtol=1e-5, atol=1e-7)


def test_optimizer_object_and_learning_rate(mlp, tmp_path):
    optimizer = LearningRateSGDNesterov(eta0=0.05, momentum=0.5, learning_rate="constant")
    art = generate_artifacts(mlp.onnx, optimizer=optimizer, artifact_directory=tmp_path)
    manifest = json.loads((tmp_path / "artifacts.json").read_text())
    assert art.learning_rate == 0.05 and manifest["learning_rate"]["value"] == 0.05
    assert manifest["optimizer"]["momentum"] == 0.5
    assert all(s["suffix"] == "velocity" for s in manifest["train"]["state"])


def test_bad_arguments(mlp, tmp_path):
    with pytest.raises(TypeError, match="artifact_directory"):
        generate_artifacts(mlp.onnx)
    with pytest.raises(TypeError, match="not both"):
        generate_artifacts(mlp.onnx, artifact_directory=tmp_path, folder=tmp_path)
    with pytest.raises(ValueError, match=r"frozen_params.*'nope'"):
        generate_artifacts(mlp.onnx, frozen_params=["nope"], artifact_directory=tmp_path)
    with pytest.raises(ValueError, match="both requires_grad and frozen_params"):
        generate_artifacts(mlp.onnx, ["coefficient"], ["coefficient"], artifact_directory=tmp_path)
    with pytest.raises(ValueError, match="unknown learning_loss"):
        generate_artifacts(mlp.onnx, loss="hinge", artifact_directory=tmp_path)
    with pytest.raises(ValueError, match="unknown optimizer"):
        generate_artifacts(mlp.onnx, optimizer="lbfgs", artifact_directory=tmp_path)
    with pytest.raises(ValueError, match="not an artifact folder"):
        load_train_step(tmp_path / "missing")
    checkpoint = Checkpoint({"nope": np.ones(1, np.float32)})
    with pytest.raises(ValueError, match=r"\['nope'\] are not initializers"):
        merge_checkpoint(mlp.onnx, checkpoint)


def test_the_inference_model_is_the_model_as_given(tmp_path):
    """A converted classifier with its ZipMap: the inference model keeps its ``ai.onnx.ml``
    operators and outputs (the train step trains their lowered copy), the manifest lists those
    outputs, and the merged checkpoint keeps them too (its weights in the lowered operators,
    ZipMap kept)."""
    from skl2onnx import to_onnx
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(3)
    X = rng.standard_normal((30, 3)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    model = to_onnx(LogisticRegression().fit(X, y), X[:1], target_opset=15)
    artifacts = generate_artifacts(model, loss="squared_error", artifact_directory=tmp_path)
    inference = onnx.load(tmp_path / "inference_model.onnx")
    operators = [(n.domain, n.op_type) for n in model.graph.node]
    assert [(n.domain, n.op_type) for n in inference.graph.node] == operators
    manifest = json.loads((tmp_path / "artifacts.json").read_text())
    assert manifest["inference"]["outputs"] == [o.name for o in model.graph.output]
    moved = {k: v + 0.5 for k, v in artifacts.checkpoint.weights.items()}
    merged = merge_checkpoint(tmp_path, Checkpoint(moved, {}))
    assert [o.name for o in merged.graph.output] == [o.name for o in model.graph.output]
    assert merged.graph.node[-1].op_type == "ZipMap"
