"""Data-parallel training through torchrun: 2 gloo ranks on localhost, one thread each.

Reference: the same estimator in one process with the global batch (2 x the per-rank
batch); the weights after training must agree to rtol 1e-5 (the ranks sum their shards'
gradients, one process sums the batch's: the same terms in another order).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxgrad.cli import main as cli_main
from tests.distributed.cases import BATCH, CASES, RANKS, estimators, mlp_regression

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None,
        reason="torch.distributed is the optional extra onnxgrad[distributed], absent here",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")


def torchrun(
    *args: str, timeout: float = 120, cwd: Path = ROOT, **env: str
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=2 ARGS``, finished within ``timeout``."""
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        **env,
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={RANKS}", *args]
    return subprocess.run(
        command, capture_output=True, text=True, env=environment, timeout=timeout, cwd=cwd
    )


def check(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fit")
    check(torchrun(str(WORKER), "fit", str(out)))
    return out


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_equal_one_process_with_the_global_batch(fitted, case):
    estimator, X, y = estimators(BATCH * RANKS, [case])[case]
    estimator.fit(X, y)
    distributed = np.load(fitted / f"{case}.npz")
    for name, value in estimator.get_state().items():
        np.testing.assert_allclose(distributed[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(distributed["train_losses_"], estimator.train_losses_, rtol=1e-5)
    np.testing.assert_allclose(
        distributed["validation_scores_"], estimator.validation_scores_, rtol=1e-5
    )


@pytest.mark.parametrize(
    ("given", "named"),
    [("data", "the training data (ranks [1])"), ("model", "the initial weights (ranks [1])")],
)
def test_ranks_given_other_data_or_models_are_refused_by_name(fitted, given, named):
    for rank in range(RANKS):
        message = (fitted / f"{given}.{rank}.txt").read_text()
        assert f"{named} differ from rank 0's" in message


def _weights(path: Path) -> dict[str, np.ndarray]:
    return {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(path).graph.initializer}


def test_command_trains_data_parallel_and_resumes(tmp_path, capsys, monkeypatch):
    model, X, y = mlp_regression()
    onnx.save(model, tmp_path / "mlp.onnx")
    np.savez(tmp_path / "data.npz", X=X, y=y)
    common = ["mlp.onnx", "--data", "data.npz", "--seed", "3", "--optimizer", "adam"]
    checkpoint = ["--checkpoint", "ckpt.json"]

    def dp(epochs: int, *extra: str) -> str:
        args = ["-m", "onnxgrad", "train", *common, "--batch-size", str(BATCH)]
        epochs_output = ["--epochs", str(epochs), "-o", "dp.onnx"]
        result = torchrun(*args, *epochs_output, *checkpoint, *extra, cwd=tmp_path)
        check(result)
        assert "\r" not in result.stderr and "it/s" not in result.stderr  # no bar in a log
        return result.stdout

    def single(epochs: int, output: str) -> dict[str, np.ndarray]:
        monkeypatch.chdir(tmp_path)  # restored after the test: later tests run from the repo
        args = ["train", *common, "--batch-size", str(BATCH * RANKS), "-o", output]
        assert cli_main([*args, "--epochs", str(epochs)]) in (0, None)
        return _weights(tmp_path / output)

    out = dp(2)
    assert out.count("wrote dp.onnx") == 1
    assert out.count("epoch   1/2") == 1 and out.count("epoch   2/2") == 1  # rank 0's
    expected = single(2, "two.onnx")
    for name, value in _weights(tmp_path / "dp.onnx").items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-7, err_msg=name)
    out = dp(3, "--resume")
    assert "epoch   3/3" in out
    expected = single(3, "three.onnx")
    for name, value in _weights(tmp_path / "dp.onnx").items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-7, err_msg=name)
    capsys.readouterr()


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        ("kill", "exitcode  : -9"),
        ("hang", "did not answer within 5 s"),
    ],
)
def test_a_dead_or_hung_rank_ends_the_job_with_an_error(tmp_path, scenario, message):
    result = torchrun(str(WORKER), scenario, str(tmp_path), timeout=90, ONNXGRAD_DIST_TIMEOUT="5")
    assert result.returncode != 0
    assert message in result.stdout + result.stderr, result.stderr[-5000:]
