"""Every notebook of ``notebooks/`` runs from top to bottom (its cells assert their results
against scikit-learn, numpy closed forms or finite differences), and is committed without
outputs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("sklearn")
pytest.importorskip("skl2onnx")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "onnxgrad-tests"


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 5


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


@pytest.fixture
def kernel_dir(tmp_path, monkeypatch):
    """A kernel spec running this very interpreter, so the notebooks see this environment.

    PyTorch is blocked in the kernel: no notebook needs it (it is a test extra only).
    """
    blocked = tmp_path / "blocked" / "torch"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('torch is blocked')\n")
    paths = [str(blocked.parent), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p), "MPLBACKEND": "Agg"}
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": KERNEL, "language": "python", "env": env}
    (spec / "kernel.json").write_text(json.dumps(kernel))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return tmp_path


def _runnable(path: Path):
    """A notebook that names the ``"ort"`` backend needs onnxruntime-training's builder."""
    uses_ort = '\\"ort\\"' in path.read_text()  # the JSON spelling of "ort"
    return pytest.param(path, marks=pytest.mark.ort_training) if uses_ort else path


@pytest.mark.parametrize("path", [_runnable(p) for p in NOTEBOOKS], ids=lambda p: p.stem)
def test_notebook_runs(path, kernel_dir):
    notebook = nbformat.read(path, as_version=4)
    work = kernel_dir / "work"
    work.mkdir()
    client = nbclient.NotebookClient(
        notebook,
        kernel_name=KERNEL,
        timeout=180,
        resources={"metadata": {"path": str(work)}},
    )
    client.execute()
    errors = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == "error"
    ]
    assert errors == []
