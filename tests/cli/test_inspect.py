"""``onnxgrad info``, ``text`` and ``plot``: what they print and draw, checked against the
protos they read."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.cli.helpers import assert_failed, run_in_process, run_onnxgrad, save
from tests.models import seed004_model


@pytest.fixture
def workdir(tmp_path):
    save(seed004_model(), tmp_path / "seed004.onnx")
    return tmp_path


def _sections(text: str) -> dict[str, list[str]]:
    """``info`` output as {section title: indented lines}."""
    sections: dict[str, list[str]] = {}
    title = None
    for line in text.splitlines():
        if line.startswith("  "):
            sections[title].append(line.strip())
        else:
            title = re.sub(r" \(.*\)", "", line).rstrip(":")
            sections[title] = []
    return sections


def test_info_lists_io_weights_and_ops(workdir):
    result = run_onnxgrad("info", "seed004.onnx", cwd=workdir)
    assert result.returncode == 0, result.stderr
    sections = _sections(result.stdout)
    model = seed004_model()
    assert sections["inputs"] == ["x  float32 [?, 2]"]
    assert sections["outputs"] == ["y  float32 [?, 1]"]
    float_inits = [i.name for i in model.graph.initializer if i.data_type == TensorProto.FLOAT]
    trainable = [line.split()[0] for line in sections["trainable initializers"]]
    assert trainable == float_inits == ["init", "init_1", "init_b10"]
    others = [line.split()[0] for line in sections["other initializers"]]
    assert others == [i.name for i in model.graph.initializer if i.name not in float_inits]
    assert "trainable initializers (3, 5 values):" in result.stdout
    counts = Counter(node.op_type for node in model.graph.node)
    expected_ops = ", ".join(f"{op} x{n}" for op, n in sorted(counts.items()))
    assert " ".join(sections["ops"]) == expected_ops


def test_info_names_ops_without_native_rule(workdir):
    graph = helper.make_graph(
        [
            helper.make_node("Shape", ["x"], ["s"]),
            helper.make_node("Frobnicate", ["x", "w"], ["y"], domain="com.example"),
        ],
        "custom",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("s", TensorProto.INT64, [1]),
        ],
        [numpy_helper.from_array(np.ones(2, dtype=np.float32), "w")],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)],
        ir_version=8,
    )
    save(model, workdir / "custom.onnx")
    result = run_in_process("info", "custom.onnx", cwd=workdir)
    assert result.returncode == 0, result.stderr
    missing = _sections(result.stdout)["ops without a native gradient rule"]
    assert missing == ["com.example::Frobnicate (opset 1)"]


def test_info_names_shared_weights(workdir):
    """A weight two nodes read (the PyTorch exporter merges equal initializers) is trained as
    one tensor: info says so."""
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "scale"], ["a"]),
            helper.make_node("Tanh", ["a"], ["t"]),
            helper.make_node("Mul", ["t", "scale"], ["b"]),
            helper.make_node("Add", ["b", "bias"], ["y"]),
        ],
        "tied",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3])],
        [
            numpy_helper.from_array(np.ones(3, dtype=np.float32), "scale"),
            numpy_helper.from_array(np.zeros(3, dtype=np.float32), "bias"),
        ],
    )
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), workdir / "t.onnx")
    result = run_in_process("info", "t.onnx", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert _sections(result.stdout)["shared trainable initializers"] == ["scale  read by 2 nodes"]
    plain = run_in_process("info", "seed004.onnx", cwd=workdir)
    assert "shared trainable initializers" not in plain.stdout


def test_text_prints_every_node_in_order(workdir):
    result = run_onnxgrad("text", "seed004.onnx", cwd=workdir)
    assert result.returncode == 0, result.stderr
    calls = [line.strip() for line in result.stdout.splitlines() if "->" in line]
    expected = [
        f"{n.op_type}({', '.join(n.input)}) -> {', '.join(n.output)}"
        for n in seed004_model().graph.node
    ]
    assert sorted(calls) == sorted(expected)
    assert "input: name='x'" in result.stdout and "output: name='y'" in result.stdout


def test_plot_writes_a_png(workdir):
    pytest.importorskip("matplotlib")
    result = run_onnxgrad("plot", "seed004.onnx", "-o", "graph.png", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert (workdir / "graph.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {p.name for p in workdir.iterdir()} == {"seed004.onnx", "graph.png"}


def test_plot_writes_dot_text_without_matplotlib(workdir):
    result = run_onnxgrad(
        "plot", "seed004.onnx", "-o", "graph.dot", cwd=workdir, blocked=("matplotlib",)
    )
    assert result.returncode == 0, result.stderr
    dot = (workdir / "graph.dot").read_text()
    graph = seed004_model().graph
    vertices = len(graph.input) + len(graph.initializer) + len(graph.node) + len(graph.output)
    assert len(re.findall(r"^  v\d+ \[", dot, flags=re.M)) == vertices
    if shutil.which("dot"):
        subprocess.run(
            ["dot", "-Tsvg", str(workdir / "graph.dot")], check=True, capture_output=True
        )


def test_plot_png_without_matplotlib_says_how_to_install_it(workdir):
    result = run_onnxgrad(
        "plot", "seed004.onnx", "-o", "graph.png", cwd=workdir, blocked=("matplotlib",)
    )
    assert_failed(result, 2, "matplotlib is not installed", "onnxgrad[plot]")
    assert not (workdir / "graph.png").exists()


def test_plot_rejects_unknown_picture_format(workdir):
    pytest.importorskip("matplotlib")
    result = run_in_process("plot", "seed004.onnx", "-o", "graph.xyz", cwd=workdir)
    assert_failed(result, 2, "'graph.xyz'", ".png")
    assert not (workdir / "graph.xyz").exists()


def test_help_of_every_command_has_examples(workdir):
    from onnxgrad.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) == {
        "demo",
        "info",
        "text",
        "plot",
        "add-loss",
        "derivative",
        "train",
        "artifacts",
    }
    for name, sub in commands.items():
        text = sub.format_help()
        assert "examples:" in text and f"onnxgrad {name}" in text, name
    result = run_onnxgrad("--help", cwd=workdir)
    assert result.returncode == 0 and all(name in result.stdout for name in commands)


def test_console_script_is_installed(workdir):
    script = Path(sys.executable).parent / "onnxgrad"
    if not script.exists():
        pytest.skip("onnxgrad is not installed in this environment")
    result = run_onnxgrad("--version", cwd=workdir, program=(str(script),))
    assert result.returncode == 0 and result.stdout.startswith("onnxgrad ")
