"""What is checked is what is read (second round): files swapped while they are read.

A second process flips a checkpoint's data file, a model's external data, or a whole artifact
folder between two states while this one loads them in a loop: every load must give one
state whole or a one-line error, never bytes from outside the folder or a mix of two runs.
A hard link out of the folder is refused, and a model over 2 GiB saved and killed between
its two renames still loads as it was. References: the bytes each state holds (numpy).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import convert_model_to_external_data

from onnxgrad import _files
from onnxgrad._onnx_utils import load_model
from onnxgrad.training import Checkpoint, generate_artifacts, load_train_step, save_checkpoint
from onnxgrad.training.artifacts.checkpoint import load_tensors
from tests.models import linear_regression_model

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX links and renames")

#: Seconds each race runs.
RACE_SECONDS = 2.0

_FLIPPER = r"""
import os, shutil, sys
target, states = sys.argv[1], sys.argv[2:]
staging = target + ".staging"
while True:
    for state in states:
        if os.path.islink(state):
            os.symlink(os.readlink(state), staging)
        else:
            shutil.copyfile(state, staging)
        os.replace(staging, target)
"""


class Flipper:
    """A child process replacing ``target`` by each of ``states`` in turn (a link is put
    in place as a link), by rename, as fast as it can."""

    def __init__(self, target: Path, *states: Path):
        args = [sys.executable, "-c", _FLIPPER, str(target), *map(str, states)]
        self.process = subprocess.Popen(args)

    def __enter__(self):
        time.sleep(0.2)  # let it start flipping
        return self

    def __exit__(self, *exc):
        self.process.kill()
        self.process.wait()


def _race(load, classify) -> dict[str, int]:
    """Load for :data:`RACE_SECONDS`; ``{outcome: count}`` where an outcome is what
    ``classify(result)`` says, or ``'refused'`` for a ValueError or OSError."""
    outcomes: dict[str, int] = {}
    end = time.monotonic() + RACE_SECONDS
    while time.monotonic() < end:
        try:
            outcome = classify(load())
        except (ValueError, OSError):
            outcome = "refused"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


INSIDE = np.arange(64, dtype=np.float32)
OUTSIDE = np.full(64, 7.0, np.float32)


def _which(array: np.ndarray) -> str:
    for name, reference in (("inside", INSIDE), ("outside", OUTSIDE)):
        if np.array_equal(array, reference):
            return name
    return "other"


def test_a_checkpoint_data_file_flipping_to_a_link_out_never_gives_outside_bytes(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_checkpoint(Checkpoint({"w": INSIDE}), folder / "c.json")
    copy, secret = tmp_path / "copy.bin", tmp_path / "secret.bin"
    shutil.copyfile(folder / "c.bin", copy)
    secret.write_bytes(OUTSIDE.tobytes())
    link = tmp_path / "link"
    link.symlink_to(secret)
    with Flipper(folder / "c.bin", copy, link):
        outcomes = _race(lambda: load_tensors(folder / "c.json")[0]["w"], _which)
    assert outcomes.get("inside", 0) > 0, outcomes
    assert set(outcomes) <= {"inside", "refused"}, outcomes


def test_external_data_flipping_to_a_link_out_never_gives_outside_bytes(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64])],
        [numpy_helper.from_array(INSIDE, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    convert_model_to_external_data(model, location="w.bin", size_threshold=0)
    onnx.save(model, folder / "m.onnx")
    copy, secret = tmp_path / "copy.bin", tmp_path / "secret.bin"
    shutil.copyfile(folder / "w.bin", copy)
    secret.write_bytes(OUTSIDE.tobytes())
    link = tmp_path / "link"
    link.symlink_to(secret)

    def weight(loaded):
        return _which(numpy_helper.to_array(loaded.graph.initializer[0]))

    with Flipper(folder / "w.bin", copy, link):
        outcomes = _race(lambda: load_model(folder / "m.onnx"), weight)
    assert outcomes.get("inside", 0) > 0, outcomes
    assert set(outcomes) <= {"inside", "refused"}, outcomes


def test_a_checkpoint_data_file_hard_linked_out_of_its_folder_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_checkpoint(Checkpoint({"w": INSIDE}), folder / "c.json")
    secret = tmp_path / "secret.bin"
    secret.write_bytes(OUTSIDE.tobytes())
    (folder / "c.bin").unlink()
    os.link(secret, folder / "c.bin")
    with pytest.raises(ValueError, match=r"c\.bin' has 2 hard links"):
        load_tensors(folder / "c.json")


def _states(tmp_path: Path) -> dict[str, Path]:
    """Two artifact folders of one model, with different optimizers."""
    model = linear_regression_model(np.array([1.0, 2.0]), np.array([0.5]))
    folders = {}
    for optimizer in ("sgd", "adam"):
        folders[optimizer] = tmp_path / optimizer
        generate_artifacts(model, optimizer=optimizer, folder=folders[optimizer])
    return folders


_REGENERATOR = r"""
import os, shutil, sys
target, states = sys.argv[1], sys.argv[2:]
while True:
    for state in states:
        for name in sorted(os.listdir(state)):
            shutil.copyfile(os.path.join(state, name), os.path.join(target, name + ".new"))
            os.replace(os.path.join(target, name + ".new"), os.path.join(target, name))
"""


def test_a_folder_regenerated_while_it_is_loaded_gives_one_run_whole(tmp_path):
    """A second process rewrites the folder file by file, alternating two runs: each load
    gives one run's state slots with that run's training model, or an error."""
    states = _states(tmp_path)
    target = tmp_path / "art"
    shutil.copytree(states["sgd"], target)
    expected = {}
    for optimizer, folder in states.items():
        step = load_train_step(folder)
        expected[(step.state, step.model.SerializeToString())] = optimizer

    def which(step) -> str:
        return expected.get((step.state, step.model.SerializeToString()), "mixed")

    args = [sys.executable, "-c", _REGENERATOR, str(target), *map(str, states.values())]
    process = subprocess.Popen(args)
    try:
        time.sleep(0.2)
        outcomes = _race(lambda: load_train_step(target), which)
    finally:
        process.kill()
        process.wait()
    assert "mixed" not in outcomes, outcomes
    assert sum(outcomes.get(k, 0) for k in states) > 0, outcomes


def _big_model(value: float) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64])],
        [numpy_helper.from_array(np.full(64, value, np.float32), "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_big_save_killed_between_its_renames_leaves_the_old_model_whole(tmp_path, monkeypatch):
    """Past the (lowered) 2 GiB limit the weights go to a data file first, the header
    second: a save killed after the first leaves the old header with the old data."""
    monkeypatch.setattr(_files, "PROTOBUF_LIMIT", 100)
    monkeypatch.setattr(_files, "EXTERNAL_THRESHOLD", 40)
    path = tmp_path / "m.onnx"
    _files.save_model(_big_model(1.0), path)

    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(_files, "write_bytes", killed)
    with pytest.raises(KeyboardInterrupt):
        _files.save_model(_big_model(2.0), path)
    loaded = numpy_helper.to_array(load_model(path).graph.initializer[0])
    np.testing.assert_array_equal(loaded, np.full(64, 1.0, np.float32))
    monkeypatch.undo()
    monkeypatch.setattr(_files, "PROTOBUF_LIMIT", 100)
    monkeypatch.setattr(_files, "EXTERNAL_THRESHOLD", 40)
    _files.save_model(_big_model(3.0), path)
    loaded = numpy_helper.to_array(load_model(path).graph.initializer[0])
    np.testing.assert_array_equal(loaded, np.full(64, 3.0, np.float32))
    data_files = sorted(p.name for p in tmp_path.iterdir() if p.name != "m.onnx")
    assert len(data_files) == 1, data_files  # the earlier saves' data files are removed


def test_an_artifact_folder_past_the_limit_loads_its_data_from_the_digested_bytes(
    tmp_path, monkeypatch
):
    """Models past the (lowered) 2 GiB limit keep external data files in the folder: the
    loaders take them from the bytes whose digests were checked, and a data file changed
    since is refused by name."""
    from onnxgrad.training import load_checkpoint, merge_checkpoint

    monkeypatch.setattr(_files, "PROTOBUF_LIMIT", 100)
    monkeypatch.setattr(_files, "EXTERNAL_THRESHOLD", 8)
    coefs = np.arange(40.0)
    art = tmp_path / "art"
    generate_artifacts(linear_regression_model(coefs, np.ones(1)), optimizer="sgd", folder=art)
    assert any(p.name.startswith("inference_model.onnx.") for p in art.iterdir())
    load_train_step(art)
    merged = merge_checkpoint(art, load_checkpoint(art / "checkpoint.json"))
    weights = {i.name: numpy_helper.to_array(i) for i in merged.graph.initializer}
    np.testing.assert_array_equal(weights["coefs"].ravel(), coefs.astype(np.float32))
    data = next(p for p in art.iterdir() if p.name.startswith("inference_model.onnx."))
    data.write_bytes(b"\0" * data.stat().st_size)
    with pytest.raises(ValueError, match=r"inference_model\.onnx\.[0-9a-f]{16}\.data.*digest"):
        merge_checkpoint(art, load_checkpoint(art / "checkpoint.json"))
