"""Importing onnxgrad stays light: no PyTorch, no onnxruntime.training."""

import subprocess
import sys


def test_import_onnxgrad_does_not_import_torch_or_onnxruntime_training():
    code = (
        "import sys, onnxgrad\n"
        "print('torch' in sys.modules, 'onnxruntime.training' in sys.modules)\n"
        "import onnxruntime\n"
        "print(onnxruntime.__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    flags, version = out.stdout.split("\n")[:2]
    assert flags == "False False"
    assert version == "1.19.2"


def test_public_names_are_importable():
    import onnxgrad

    missing = [name for name in onnxgrad.__all__ if not hasattr(onnxgrad, name)]
    assert not missing
    for name in ["add_loss_output", "onnx_derivative", "DerivativeOptions", "function_onnx_graph"]:
        assert name in onnxgrad.__all__
