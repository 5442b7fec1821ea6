"""Importing onnxgrad stays light: its public names load their subpackage on first use."""

import importlib
import subprocess
import sys

import pytest

import onnxgrad

#: Libraries no part of onnxgrad may load at ``import onnxgrad`` or ``onnxgrad --help``.
HEAVY = ("onnxruntime", "onnxscript", "networkx", "matplotlib", "torch", "tqdm", "sympy")


def _modules_loaded_by(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_import_onnxgrad_loads_no_runtime_and_no_heavy_library():
    loaded = _modules_loaded_by("import onnxgrad")
    assert not [name for name in HEAVY if name in loaded]
    assert "numpy" not in loaded and "onnx" not in loaded


def test_command_help_loads_no_heavy_library():
    code = (
        "import sys\nfrom onnxgrad.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
    )
    loaded = _modules_loaded_by(code)
    assert not [name for name in (*HEAVY, "numpy", "onnx") if name in loaded]


@pytest.mark.parametrize(
    ("name", "allowed"),
    [
        ("add_loss_output", ()),
        ("onnx_derivative", ()),
        ("function_onnx_graph", ("onnxscript", "sympy")),
    ],
)
def test_core_names_need_no_onnxruntime(name, allowed):
    loaded = _modules_loaded_by(f"from onnxgrad import {name}")
    assert not [m for m in HEAVY if m in loaded and m not in allowed]


def test_training_names_do_not_load_torch_or_onnxruntime_training():
    loaded = _modules_loaded_by("from onnxgrad import OrtGradientOptimizer")
    assert "onnxruntime" in loaded
    assert "torch" not in loaded and "onnxruntime.training" not in loaded


def test_lazy_table_matches_the_subpackages():
    for module, names in onnxgrad._EXPORTS.items():
        exported = getattr(importlib.import_module(module), "__all__", None)
        if module in ("onnxgrad.exceptions", "onnxgrad.plotting"):
            assert set(names) <= set(dir(importlib.import_module(module)))
        else:
            missing, extra = sorted(set(exported) - set(names)), sorted(set(names) - set(exported))
            assert not missing and not extra, (
                f"onnxgrad._EXPORTS[{module!r}]: add {missing}, drop {extra}"
            )


def test_public_names_are_importable():
    missing = [name for name in onnxgrad.__all__ if not hasattr(onnxgrad, name)]
    assert not missing
    for name in ["add_loss_output", "onnx_derivative", "DerivativeOptions", "function_onnx_graph"]:
        assert name in onnxgrad.__all__
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        onnxgrad.not_a_name  # noqa: B018


def _small_model(folder) -> str:
    """``Y = X W + b``: a linear model of 3 features and 2 outputs."""
    import numpy as np
    from onnx import save

    from tests.models import linear_regression_model

    path = str(folder / "small.onnx")
    save(linear_regression_model(np.ones((2, 3)), np.zeros(2)), path)
    return path


#: What the commands that run no model must not load: a runtime, the authored graphs'
#: onnxscript (and the onnx_ir and sympy it pulls), a progress bar, pictures, PyTorch.
NOT_FOR_MODEL_READING = (
    "onnxruntime",
    "onnxscript",
    "onnx_ir",
    "sympy",
    "tqdm",
    "networkx",
    "matplotlib",
    "torch",
)


@pytest.mark.parametrize(
    "command",
    [
        ["info", "{model}"],
        ["text", "{model}"],
        ["derivative", "{model}", "-o", "{out}/grad.onnx"],
        ["derivative", "{model}", "-o", "{out}/grad.onnx", "--weights", "--fill-grad"],
        ["add-loss", "{model}", "-o", "{out}/loss.onnx"],
        ["add-loss", "{model}", "-o", "{out}/loss.onnx", "--score", "l1"],
    ],
    ids=["info", "text", "derivative", "derivative-fill-grad", "add-loss", "add-loss-l1"],
)
def test_model_reading_commands_load_no_runtime_and_no_onnxscript(tmp_path, command):
    model = _small_model(tmp_path)
    argv = [part.format(model=model, out=tmp_path) for part in command]
    code = (
        "import contextlib, io, sys\nfrom onnxgrad.cli import main\n"
        f"with contextlib.redirect_stdout(io.StringIO()):\n    status = main({argv!r})\n"
        "assert status == 0, status\n"
    )
    loaded = _modules_loaded_by(code)
    assert not [name for name in NOT_FOR_MODEL_READING if name in loaded]
