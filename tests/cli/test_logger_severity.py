"""onnxruntime's logger severity: the level the command line chooses survives the CUDA probe,
which silences onnxruntime while it tries to load the provider."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from onnxgrad._runtime import logger_severity, set_logger_severity
from tests.cli.helpers import ROOT, command_environment

#: Sets the severity, probes CUDA, then builds a session on a model with an unused
#: initializer, which onnxruntime reports at warning level (2) on stderr.
PROBE_THEN_WARN = textwrap.dedent(
    """
    import sys
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    from onnxgrad._runtime import set_logger_severity
    from onnxgrad.training import check_device

    set_logger_severity(int(sys.argv[1]))
    try:
        check_device("cuda")
    except ValueError:
        pass
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        [numpy_helper.from_array(np.zeros(1, np.float32), "unused")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=9)
    ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    """
)


def _stderr_after_probe(level: int) -> str:
    """The probe's stderr, run as the command runs: PyTorch blocked (onnxruntime-training
    1.19 would otherwise load it at import, 2 s of the probe's 2.2)."""
    with tempfile.TemporaryDirectory() as blocked_folder:
        result = subprocess.run(
            [sys.executable, "-c", PROBE_THEN_WARN, str(level)],
            cwd=ROOT,
            env=command_environment(Path(blocked_folder)),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_cuda_probe_keeps_the_recorded_severity():
    assert "Removing initializer 'unused'" in _stderr_after_probe(2)
    assert "Removing initializer" not in _stderr_after_probe(4)


def test_set_logger_severity_records_and_returns_the_previous_level():
    original = logger_severity()
    try:
        assert set_logger_severity(3) == original
        assert logger_severity() == 3
        assert set_logger_severity(1) == 3
    finally:
        set_logger_severity(original)
    assert logger_severity() == original


@pytest.mark.parametrize("level", [5, -1, True, 2.0, "2"])
def test_set_logger_severity_rejects(level):
    original = logger_severity()
    with pytest.raises(ValueError, match="logger severity"):
        set_logger_severity(level)
    assert logger_severity() == original


def test_command_restores_the_caller_severity(tmp_path):
    from onnxgrad.cli import ORT_LOG_SEVERITY, main

    original = set_logger_severity(1)
    try:
        assert main(["derivative", "missing.onnx", "-o", str(tmp_path / "g.onnx")]) == 2
        assert logger_severity() == 1 != ORT_LOG_SEVERITY
    finally:
        set_logger_severity(original)
