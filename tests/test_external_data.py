"""Models with external data: read from their own folder, written beside the output when
they pass protobuf's 2 GiB limit (the limit is lowered here, so a small model takes the
same path), and a dead onnxruntime-training child is a RuntimeError."""

from __future__ import annotations

import re
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import convert_model_to_external_data

from onnxgrad import _files
from tests.cli.helpers import run_in_process, run_model

W = np.arange(12, dtype=np.float32).reshape(3, 4) / 10


def _model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"], name="mm")],
        "mm",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 4])],
        [
            numpy_helper.from_array(W, "W"),
            numpy_helper.from_array(np.ones(300, np.float32), "unused_big"),
            numpy_helper.from_array(np.array([2], np.int64), "small"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _saved_with_external_data(folder) -> None:
    folder.mkdir()
    model = _model()
    convert_model_to_external_data(model, location="weights.bin", size_threshold=0)
    onnx.save_model(model, folder / "m.onnx")


@pytest.fixture
def lowered_limit(monkeypatch):
    monkeypatch.setattr(_files, "PROTOBUF_LIMIT", 100)
    monkeypatch.setattr(_files, "EXTERNAL_THRESHOLD", 40)


def test_a_big_model_is_saved_with_its_weights_beside_it(tmp_path, lowered_limit):
    model = _model()
    _files.save_model(model, tmp_path / "out.onnx")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[0] == "out.onnx" and re.fullmatch(r"out\.onnx\.[0-9a-f]{16}\.data", names[1])
    assert len(names) == 2
    header = onnx.load(tmp_path / "out.onnx", load_external_data=False)
    external = [i.name for i in header.graph.initializer if i.data_location == 1]
    assert external == ["W", "unused_big"]
    loaded = onnx.load(tmp_path / "out.onnx")
    for init in model.graph.initializer:
        np.testing.assert_array_equal(
            numpy_helper.to_array(init), numpy_helper.to_array(_named(loaded, init.name))
        )
    assert model.graph.initializer[0].HasField("raw_data"), "the model given is not changed"


def test_a_big_model_saved_through_a_link_loads_through_it(tmp_path, lowered_limit):
    (tmp_path / "real").mkdir()
    (tmp_path / "link.onnx").symlink_to(tmp_path / "real" / "out.onnx")
    _files.save_model(_model(), tmp_path / "link.onnx")
    assert (tmp_path / "link.onnx").is_symlink()
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["out.onnx"]
    assert len(list(tmp_path.glob("link.onnx.*.data"))) == 1
    x = np.ones((2, 3), np.float32)
    np.testing.assert_allclose(run_model(tmp_path / "link.onnx", {"X": x})["Y"], x @ W)


def test_a_big_model_is_not_written_into_a_special_file(tmp_path, lowered_limit):
    import os

    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(ValueError, match=r"over 2 GiB.*not a regular file"):
        _files.save_model(_model(), tmp_path / "pipe")


def _named(model, name):
    return next(i for i in model.graph.initializer if i.name == name)


def test_the_command_reads_external_data_from_the_models_folder(tmp_path, lowered_limit):
    _saved_with_external_data(tmp_path / "model")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    (elsewhere / "weights.bin").write_bytes(np.zeros(400, np.float32).tobytes())  # a decoy
    result = run_in_process(
        "derivative", tmp_path / "model" / "m.onnx", "-o", "g.onnx", "--weights", cwd=elsewhere
    )
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in elsewhere.iterdir())
    assert names[0] == "g.onnx" and names[2] == "weights.bin" and len(names) == 3
    assert re.fullmatch(r"g\.onnx\.[0-9a-f]{16}\.data", names[1])
    seed = np.array([[1.0, -1.0, 2.0, 0.5]], np.float32)
    got = run_model(elsewhere / "g.onnx", {"X": np.ones((1, 3), np.float32), "Y_grad": seed})
    np.testing.assert_allclose(got["X_grad"], seed @ W.T, rtol=1e-6)


def test_a_child_dying_before_it_reads_its_request_is_a_runtime_error(tmp_path, monkeypatch):
    from onnxgrad.derivative.ort import process as _ort_process

    monkeypatch.setattr(
        _ort_process, "worker_command", lambda: [sys.executable, "-c", "raise SystemExit(3)"]
    )
    with (
        pytest.raises(RuntimeError, match="exit code 3"),
        _ort_process.OrtChild(tmp_path) as child,
    ):
        child._process.wait()
        child.load(tmp_path / "m.onnx")


def test_a_session_of_a_model_past_the_limit_goes_through_external_data(lowered_limit):
    from onnxgrad.training.running.devices import Device
    from onnxgrad.training.running.runner import make_session

    session = make_session(_model(), Device("cpu"))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(session.run(None, {"X": x})[0], x @ W, rtol=1e-6)


def test_the_command_trains_a_model_past_the_limit_end_to_end(tmp_path, lowered_limit):
    """Read with external data, train (sessions through external data), write the trained
    model with its weights beside it."""
    pytest.importorskip("onnxruntime")
    folder = tmp_path / "model"
    folder.mkdir()
    model = _model()
    del model.graph.initializer[1:]  # W only: the unused weights would not train
    convert_model_to_external_data(model, location="weights.bin", size_threshold=0)
    onnx.save_model(model, folder / "m.onnx")
    rng = np.random.default_rng(0)
    X = rng.standard_normal((64, 3)).astype(np.float32)
    target = rng.standard_normal((3, 4)).astype(np.float32)
    np.savez(tmp_path / "data.npz", X=X, y=X @ target)
    # 0.05 is a step size for the mean loss: on the default sum over a batch of 32 it diverges
    result = run_in_process(
        "train", folder / "m.onnx", "--data", "data.npz", "-o", "trained.onnx",
        "--epochs", "30", "--lr", "0.05", "--optimizer", "sgd", "--reduction", "mean", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert len(list(tmp_path.glob("trained.onnx.*.data"))) == 1
    trained = numpy_helper.to_array(_named(onnx.load(tmp_path / "trained.onnx"), "W"))
    assert np.abs(trained - target).max() < 0.5 * np.abs(W - target).max()
