"""Which onnxruntime flavour is installed, and the errors that say what to install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from onnxgrad import _runtime, onnx_derivative
from tests.models import seed004_model


def test_this_environment_has_exactly_one_flavour():
    flavours = _runtime.installed_flavours()
    assert len(flavours) == 1, flavours
    name, version = flavours[0]
    assert name in _runtime.FLAVOURS
    import onnxruntime

    assert onnxruntime.__version__ == version
    assert _runtime.has_training_builder() == (name in _runtime.TRAINING_FLAVOURS)


def test_two_flavours_over_one_folder_are_named(monkeypatch):
    monkeypatch.delitem(sys.modules, "onnxruntime", raising=False)
    monkeypatch.setattr(
        _runtime,
        "installed_flavours",
        lambda: [("onnxruntime", "1.31.1"), ("onnxruntime-training", "1.19.2")],
    )
    with pytest.raises(ImportError, match=r"onnxruntime 1.31.1 and onnxruntime-training 1.19.2"):
        _runtime.import_onnxruntime()


def test_no_flavour_says_the_command_to_run():
    """In a child whose onnxruntime cannot be imported and no distribution is installed."""
    code = (
        "import sys\n"
        "sys.modules['onnxruntime'] = None\n"
        "from onnxgrad import _runtime\n"
        "_runtime.installed_flavours = lambda: []\n"
        "try:\n"
        "    _runtime.import_onnxruntime()\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert 'pip install "onnxgrad[cpu]"' in out.stdout


def test_ort_backend_without_the_training_build_names_the_wheel(monkeypatch):
    monkeypatch.setattr(_runtime, "has_training_builder", lambda: False)
    with pytest.raises(ImportError) as info:
        onnx_derivative(seed004_model(), backend="ort")
    message = str(info.value)
    assert "onnxruntime-training-cpu 1.19.2" in message
    assert "Python 3.10 and 3.11" in message
    assert _runtime.flavour_description() in message


def test_the_core_runs_without_onnxruntime(tmp_path):
    """Rewrites and the native derivative, in a child where onnxruntime cannot be imported."""
    code = (
        "import sys\n"
        "sys.modules['onnxruntime'] = None\n"
        "from onnxgrad import add_loss_output, get_train_initializer, onnx_derivative\n"
        "from tests.models import seed004_model\n"
        "model = seed004_model()\n"
        "weights = list(get_train_initializer(model))\n"
        "grad = onnx_derivative(add_loss_output(model), weights=weights)\n"
        "print(len(grad.graph.output))\n"
    )
    root = Path(__file__).resolve().parents[1]  # where ``tests`` imports from
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 2
