"""External data is read by onnxgrad itself, confined to the model's folder, whatever onnx
version is installed (onnxgrad/_external_data.py).

Each case saves a model whose weight ``W`` lives in an external file, then breaks one rule;
the cases run in one capped child (a link to /dev/zero or a FIFO must not be read or
waited on). The reference for the valid case is the array saved.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad._onnx_utils import load_model
from tests.security.isolated import refused, run_cases

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX links and FIFOs")

W = np.arange(12, dtype=np.float32).reshape(3, 4)


def _save(folder: Path, location: str = "w.bin", offset: int = 0, length=None) -> None:
    """``m.onnx`` in ``folder`` reading ``W`` from ``location`` (which is not written)."""
    weight = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=list(W.shape))
    weight.data_location = TensorProto.EXTERNAL
    entries = {"location": location, "offset": str(offset)}
    if length is not None:
        entries["length"] = str(length)
    for key, value in entries.items():
        weight.external_data.add(key=key, value=value)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 4])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    (folder / "m.onnx").write_bytes(model.SerializeToString())


def _data(folder: Path, name: str = "w.bin") -> None:
    (folder / name).write_bytes(W.tobytes())


def _outside(folder: Path) -> Path:
    secret = folder.parent / f"{folder.name}-secret.bin"
    secret.write_bytes(np.full(12, 7, np.float32).tobytes())
    return secret


def absolute(folder):
    _save(folder, str(_outside(folder)))


def parent(folder):
    _outside(folder)
    _save(folder, f"../{folder.name}-secret.bin")


def inner_parent(folder):
    _outside(folder)
    (folder / "sub").mkdir()
    _save(folder, f"sub/../../{folder.name}-secret.bin")


def symlink_out(folder):
    (folder / "w.bin").symlink_to(_outside(folder))
    _save(folder)


def symlinked_folder(folder):
    (folder / "sub").symlink_to(_outside(folder).parent, target_is_directory=True)
    _save(folder, f"sub/{folder.name}-secret.bin")


def hardlink(folder):
    os.link(_outside(folder), folder / "w.bin")
    _save(folder)


def dev_zero(folder):
    (folder / "w.bin").symlink_to("/dev/zero")
    _save(folder)


def fifo(folder):
    os.mkfifo(folder / "w.bin")
    _save(folder)


def past_the_end(folder):
    _data(folder)
    _save(folder, offset=8, length=48)


def length_unlike_dims(folder):
    _data(folder)
    _save(folder, length=2**40)


def huge_offset(folder):
    _data(folder)
    _save(folder, offset=2**62, length=48)


CASES = {
    "absolute": (absolute, "relative path"),
    "parent": (parent, "relative path"),
    "inner-parent": (inner_parent, "relative path"),
    "symlink-out": (symlink_out, "outside the folder"),
    "symlinked-folder": (symlinked_folder, "outside the folder"),
    "hardlink": (hardlink, "hard links"),
    "dev-zero": (dev_zero, "outside the folder"),
    "fifo": (fifo, "a FIFO"),
    "past-the-end": (past_the_end, "needs bytes 8 to 56"),
    "length-unlike-dims": (length_unlike_dims, "(48 bytes)"),
    "huge-offset": (huge_offset, "needs bytes"),
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    cases = {}
    for key, (build, _) in CASES.items():
        folder = tmp_path_factory.mktemp(key)
        build(folder)
        code = "from onnxgrad._onnx_utils import load_model\nload_model('m.onnx')\n"
        cases[key] = (folder, code)
    return run_cases(cases)


@pytest.mark.parametrize("key", sorted(CASES))
def test_external_data_outside_the_rules_is_refused(reports, key):
    refused(reports[key], "ValueError", CASES[key][1], "'W'")


def test_external_data_in_the_folder_loads(tmp_path):
    (tmp_path / "sub").mkdir()
    _data(tmp_path / "sub", "w.bin")
    _save(tmp_path, "sub/w.bin")
    model = load_model(tmp_path / "m.onnx")
    np.testing.assert_array_equal(numpy_helper.to_array(model.graph.initializer[0]), W)
    assert model.graph.initializer[0].data_location == TensorProto.DEFAULT


def test_the_command_refuses_it_in_one_line(tmp_path):
    from tests.cli.helpers import run_in_process

    symlink_out(tmp_path)
    result = run_in_process("info", tmp_path / "m.onnx", cwd=tmp_path)
    assert result.returncode == 2
    assert "outside the folder" in result.stderr and "Traceback" not in result.stderr
    onnx.load(tmp_path / "m.onnx", load_external_data=False)  # the file itself is fine
