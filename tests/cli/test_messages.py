"""Messages of ``onnxgrad train`` in the command line's words, read as a user reads them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tests.cli.helpers import assert_failed, run_in_process, run_onnxgrad, save
from tests.models import linear_regression_model


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A 3-class linear model computing logits, int64 labels."""
    folder = tmp_path_factory.mktemp("messages")
    rng = np.random.default_rng(0)
    save(
        linear_regression_model(rng.standard_normal((3, 4)) * 0.1, np.zeros(3)), folder / "clf.onnx"
    )
    X = rng.standard_normal((60, 4)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64) + (X[:, 1] > 0)
    np.savez(folder / "cls.npz", X=X, y=y)
    return folder


TRAIN = ("train", "clf.onnx", "--data", "cls.npz", "-o", "trained.onnx", "--epochs", "2")


def test_class_labels_with_a_regression_loss_name_the_classification_losses(workdir):
    line = assert_failed(run_in_process(*TRAIN, cwd=workdir), 2, "y holds class labels (int64)")
    assert "--loss cross_entropy_logits" in line and "--loss cross_entropy " in line


def test_a_probabilities_loss_on_logits_warns_once_in_the_commands_words(workdir):
    result = run_onnxgrad(*TRAIN, "--loss", "cross_entropy", cwd=workdir)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("onnxgrad train: warning: loss 'cross_entropy' expects probabil")
    assert lines[0].endswith("use --loss cross_entropy_logits")
    assert "UserWarning" not in result.stderr and "learning_loss=" not in result.stderr


def _trained(workdir, optimizer: str) -> dict[str, np.ndarray]:
    result = run_in_process(
        *TRAIN, "--loss", "cross_entropy_logits", "--optimizer", optimizer, cwd=workdir
    )
    assert result.returncode == 0, result.stderr
    model = onnx.load(workdir / "trained.onnx")
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def test_optimizer_names_are_case_insensitive(workdir):
    lower, upper = _trained(workdir, "sgd"), _trained(workdir, "SGD")
    assert lower.keys() == upper.keys()
    for name, value in lower.items():
        np.testing.assert_array_equal(upper[name], value)
    assert _trained(workdir, "Adam")


def test_saving_into_a_missing_folder_names_the_folder(tmp_path):
    from onnxgrad import Checkpoint, save_checkpoint

    missing = tmp_path / "not_there"
    with pytest.raises(FileNotFoundError) as info:
        save_checkpoint(Checkpoint({"w": np.ones(2, np.float32)}), missing / "ck.json")
    assert info.value.filename == str(missing)
    assert ".tmp" not in str(info.value) and "no such folder" in str(info.value)
    assert not tmp_path.joinpath("not_there").exists()


def test_the_readme_states_the_statuses_the_command_gives():
    """2 for a bad input (tests/cli/test_errors.py), 1 for a diverged training."""
    from pathlib import Path

    from onnxgrad.cli import JOB_FAILED
    from onnxgrad.cli_common import USAGE_ERROR

    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    assert f"one line on standard error with exit status {USAGE_ERROR}" in readme
    assert f"`training diverged: ...`, and exit status {JOB_FAILED}" in readme
