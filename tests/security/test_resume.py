"""``onnxgrad train --resume`` given a checkpoint from elsewhere: its three files are read
confined, bounded and once, every progress field is checked with its range, and each bad
file ends in a one-line error with status 2 (never a hang, a MemoryError, a billion epochs
or a raw KeyError).

Each case runs the command in one capped child (tests/security/isolated.py); the
reference is the rule the tampered file breaks.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.cli.helpers import run_in_process, save
from tests.models import linear_regression_model
from tests.security.isolated import refused, run_cases

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX files and resource limits")

_ARGS = ["train", "lr.onnx", "--data", "data.npz", "-o", "out.onnx", "--epochs", "3"]
_RESUME = [*_ARGS, "--checkpoint", "ckpt.json", "--resume"]
_CODE = f"""
import contextlib, io
from onnxgrad.cli import main
err = io.StringIO()
with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    status = main({_RESUME!r})
lines = err.getvalue().strip().splitlines()  # a progress bar may come first
if status == 2 and "Traceback" not in err.getvalue():
    raise ValueError(lines[-1])
raise AssertionError(f"status {{status}}: {{err.getvalue()}}")
"""


def _progress(field: str, value):
    def tamper(folder: Path) -> None:
        path = folder / "ckpt.progress.json"
        progress = json.loads(path.read_text())
        if value is _MISSING:
            del progress[field]
        else:
            progress[field] = value
        path.write_text(json.dumps(progress))

    return tamper


_MISSING = object()


def _fifo(folder: Path) -> None:
    (folder / "ckpt.progress.json").unlink()
    os.mkfifo(folder / "ckpt.progress.json")


def _dev_zero(folder: Path) -> None:
    (folder / "ckpt.bin").unlink()
    (folder / "ckpt.bin").symlink_to("/dev/zero")


def _hard_link_out(folder: Path) -> None:
    outside = folder.parent / f"{folder.name}-outside.bin"
    shutil.copy(folder / "ckpt.bin", outside)
    (folder / "ckpt.bin").unlink()
    os.link(outside, folder / "ckpt.bin")


#: id -> (tampering, fragments of the one-line error)
CASES = {
    "progress-fifo": (_fifo, ("ckpt.progress.json", "a FIFO")),
    "bin-dev-zero": (_dev_zero, ("ckpt.bin", "outside the folder")),
    "bin-hard-link": (_hard_link_out, ("ckpt.bin", "2 hard links")),
    "n-iter-negative": (_progress("n_iter", -(10**9)), ("n_iter is -1000000000", "[0, 3]")),
    "n-iter-past-epochs": (_progress("n_iter", 10**9), ("n_iter is 1000000000",)),
    "n-iter-missing": (_progress("n_iter", _MISSING), ("n_iter is None",)),
    "t-string": (_progress("t", "7"), ("t is '7'",)),
    "curve-of-strings": (_progress("train_losses_", ["a"]), ("train_losses_ is ['a']",)),
    "shuffling-garbage": (_progress("shuffling", {"state": 1}), ("shuffling state",)),
    "extra-missing": (_progress("extra", {}), ("extra is {}", "['start']")),
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    base = tmp_path_factory.mktemp("base")
    save(linear_regression_model(np.zeros(2), np.zeros(1)), base / "lr.onnx")
    rng = np.random.default_rng(0)
    X = rng.standard_normal((20, 2)).astype(np.float32)
    np.savez(base / "data.npz", X=X, y=(X @ [1.5, -2.0]).astype(np.float32))
    args = [*_ARGS[:-1], "1", "--checkpoint", "ckpt.json"]
    result = run_in_process(*args, cwd=base)
    assert result.returncode == 0, result.stderr
    cases = {}
    for key, (tamper, _) in CASES.items():
        folder = tmp_path_factory.mktemp(key)
        for file in base.iterdir():
            shutil.copy(file, folder / file.name)
        tamper(folder)
        cases[key] = (folder, _CODE)
    cases["untouched"] = (base, _CODE.replace("status == 2", "status != 0"))
    return run_cases(cases)


@pytest.mark.parametrize("key", sorted(CASES))
def test_a_bad_checkpoint_is_one_line_with_status_2(reports, key):
    refused(reports[key], "ValueError", "cannot resume" if "n-iter" in key else "", *CASES[key][1])
    assert reports[key]["message"].startswith("onnxgrad train: error: ")


def test_the_untouched_checkpoint_resumes(reports):
    refused(reports["untouched"], "AssertionError", "status 0")
