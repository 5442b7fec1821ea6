"""dev.py finds an environment a doc's install line broke, and keeps its runtime when adding
extras (the full round trip, a fresh clone's demo then each doc's pip line then the demo
again, is a manual check: it downloads the wheels)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEV = runpy.run_path(str(ROOT / "dev.py"))
EDITABLE = {"dir_info": {"editable": True}, "url": f"file://{ROOT}"}


def problems(flavours, onnxgrad=EDITABLE, import_error="", extra="training"):
    probe = {"flavours": flavours, "onnxgrad": onnxgrad, "import_error": import_error}
    return DEV["environment_problems"](probe, extra, ROOT)


def test_a_healthy_environment_has_no_problem():
    assert problems(["onnxruntime-training-cpu"]) == []
    assert problems(["onnxruntime"], extra="cpu,genai") == []


def test_the_current_onnxruntime_installed_over_the_training_build():
    """What ``pip install ".[cpu,distributed]"`` did to the training .venv."""
    found = problems(
        ["onnxruntime", "onnxruntime-training-cpu"],
        onnxgrad={"url": f"file://{ROOT}", "dir_info": {}},
    )
    assert found == [
        "onnxruntime installed beside or over onnxruntime-training-cpu",
        f"onnxgrad is installed from {ROOT}, not editable from {ROOT}",
    ]


@pytest.mark.parametrize(
    ("flavours", "import_error", "expected"),
    [
        ([], "", "onnxruntime-training-cpu is not installed"),
        (["onnxruntime"], "", "onnxruntime installed beside or over onnxruntime-training-cpu"),
        (["onnxruntime-training-cpu"], "ImportError: x", "onnxruntime does not import"),
    ],
)
def test_a_missing_wrong_or_broken_runtime(flavours, import_error, expected):
    assert problems(flavours, import_error=import_error)[0].startswith(expected)


def test_onnxgrad_missing_or_from_another_checkout():
    assert problems(["onnxruntime-training-cpu"], onnxgrad=None) == ["onnxgrad is not installed"]
    other = {"dir_info": {"editable": True}, "url": "file:///elsewhere"}
    assert "not editable from" in problems(["onnxruntime-training-cpu"], onnxgrad=other)[0]


def test_the_probe_reads_this_interpreters_environment():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", DEV["PROBE"]], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert '"flavours"' in out.stdout and '"import_error": ""' in out.stdout


@pytest.mark.parametrize("extras", [["cpu"], ["training", "distributed"], ["nope"], []])
def test_extras_refuses_runtimes_and_unknown_names(extras, capsys):
    assert DEV["cmd_extras"](extras) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_the_tests_write_bytecode_and_name_the_inference_interpreter():
    """``PYTHONDONTWRITEBYTECODE`` would make every process the tests start compile the
    checkout again; a chosen matplotlib backend stays."""
    environ = {"PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "pdf", "HOME": "/home/u"}
    env = DEV["test_environment"](Path("/venv/bin/python"), environ)
    assert env == {
        "MPLBACKEND": "pdf",
        "HOME": "/home/u",
        "ONNXGRAD_INFERENCE_PYTHON": str(Path("/venv/bin/python")),
    }
    assert environ["PYTHONDONTWRITEBYTECODE"] == "1"
    assert DEV["test_environment"](Path("p"), {})["MPLBACKEND"] == "Agg"
