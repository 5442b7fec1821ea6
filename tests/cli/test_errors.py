"""Error discipline: one line on stderr, status 2 (1 for a divergence), no traceback, and
never a file left at the destination."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import ModelProto, TensorProto, helper, numpy_helper

from onnxgrad._files import write_atomically
from onnxgrad.cli import CommandError, parse_penalties
from onnxgrad.training import check_device
from tests.cli.helpers import assert_failed, run_in_process, run_onnxgrad, save
from tests.models import linear_regression_model, seed004_model


@pytest.fixture
def workdir(tmp_path):
    save(linear_regression_model(np.array([1.0, 2.0]), np.array([0.5])), tmp_path / "lr.onnx")
    rng = np.random.default_rng(0)
    X = rng.standard_normal((64, 2)).astype(np.float32)
    np.savez(tmp_path / "data.npz", X=X, y=X @ np.array([1.0, 2.0], dtype=np.float32))
    (tmp_path / "out").mkdir()
    return tmp_path


def _check(workdir, result, status, *fragments):
    assert_failed(result, status, *fragments)
    assert list((workdir / "out").iterdir()) == [], "a file was left behind"


COMMANDS = {
    "info": ["info", "{model}"],
    "text": ["text", "{model}"],
    "plot": ["plot", "{model}", "-o", "out/graph.png"],
    "add-loss": ["add-loss", "{model}", "-o", "out/loss.onnx"],
    "derivative": ["derivative", "{model}", "-o", "out/grad.onnx"],
    "train": ["train", "{model}", "--data", "data.npz", "-o", "out/trained.onnx"],
}


def _args(command: str, model: str) -> list[str]:
    return [a.format(model=model) for a in COMMANDS[command]]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_missing_model_file(workdir, command):
    result = run_onnxgrad(*_args(command, "missing.onnx"), cwd=workdir)
    _check(workdir, result, 2, f"onnxgrad {command}: error:", "'missing.onnx'", "does not exist")


@pytest.mark.parametrize("command", ["info", "derivative"])
def test_corrupt_model_file(workdir, command):
    (workdir / "bad.onnx").write_bytes(np.random.default_rng(1).bytes(300))
    result = run_in_process(*_args(command, "bad.onnx"), cwd=workdir)
    _check(workdir, result, 2, "'bad.onnx'", "not a valid ONNX model")


def test_truncated_model_file(workdir):
    data = (workdir / "lr.onnx").read_bytes()
    (workdir / "cut.onnx").write_bytes(data[: len(data) // 2])
    result = run_in_process(*_args("add-loss", "cut.onnx"), cwd=workdir)
    _check(workdir, result, 2, "'cut.onnx'")


def _model(nodes, initializers=(), width: int = 3) -> ModelProto:
    graph = helper.make_graph(
        nodes,
        "invalid",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(value, name) for name, value in initializers],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def inconsistent_matmul_model() -> ModelProto:
    """``X [N, 3] @ W [4, 1]``: onnx's shape inference rejects it."""
    return _model(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])], [("W", np.zeros((4, 1), np.float32))]
    )


def cyclic_model() -> ModelProto:
    """``a = X + b``, ``b = Relu(a)``: a cycle onnx's checker rejects."""
    return _model(
        [
            helper.make_node("Add", ["X", "b"], ["a"]),
            helper.make_node("Relu", ["a"], ["b"]),
            helper.make_node("ReduceSum", ["a"], ["Y"], keepdims=1),
        ]
    )


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (inconsistent_matmul_model, "Incompatible dimensions for matrix multiplication"),
        (cyclic_model, "the graph has a cycle"),
    ],
)
def test_invalid_model_is_named_in_one_line(workdir, command, model, reason):
    save(model(), workdir / "invalid.onnx")
    np.savez(workdir / "data.npz", X=np.zeros((8, 3), np.float32), y=np.zeros(8, np.float32))
    run = run_onnxgrad if command in ("add-loss", "derivative", "train") else run_in_process
    result = run(*_args(command, "invalid.onnx"), cwd=workdir)
    _check(workdir, result, 2, "'invalid.onnx' is not a valid ONNX model", reason)


def test_runtime_failure_of_onnxruntime_is_one_line(workdir):
    """Reshape to ``[-1, 4]`` needs an even batch: onnxruntime fails on 9 rows."""
    pairs = _model(
        [
            helper.make_node("Reshape", ["X", "pairs"], ["paired"]),
            helper.make_node("MatMul", ["paired", "W"], ["product"]),
            helper.make_node("Reshape", ["product", "column"], ["Y"]),
        ],
        [
            ("pairs", np.array([-1, 4])),
            ("W", np.ones((4, 2), np.float32)),
            ("column", np.array([-1, 1])),
        ],
        width=2,
    )
    save(pairs, workdir / "pairs.onnx")
    X = np.random.default_rng(0).standard_normal((9, 2)).astype(np.float32)
    np.savez(workdir / "odd.npz", X=X, y=X.sum(axis=1))
    result = run_onnxgrad(
        "train", "pairs.onnx", "--data", "odd.npz", "-o", "out/t.onnx", "--batch-size", "3",
        cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("onnxgrad train: error:"), last
    # the starting loss, computed batch by batch as the epochs are, fails on the first batch
    assert "Reshape" in last and "{3,2}" in last, last
    assert list((workdir / "out").iterdir()) == []


def test_folder_given_as_model(workdir):
    result = run_in_process(*_args("text", "out"), cwd=workdir)
    _check(workdir, result, 2, "'out' is a folder")


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["derivative", "lr.onnx", "-o", "out/g.onnx", "--bogus"], ["unrecognized arguments"]),
        (["derivative", "lr.onnx"], ["required", "-o/--output"]),
        (["derivative", "lr.onnx", "-o", "out/g.onnx", "--backend", "tf"], ["invalid choice"]),
        (["add-loss", "lr.onnx", "-o", "out/l.onnx", "--penalty", "coefs=l3:1"], ["'l3'"]),
        (["add-loss", "lr.onnx", "-o", "out/l.onnx", "--penalty", "coefs=l1:x"], ["'x'"]),
        (["add-loss", "lr.onnx", "-o", "out/l.onnx", "--score", "hinge"], ["'hinge'"]),
        (["train", "lr.onnx", "--data", "data.npz", "-o", "out/t.onnx", "--epochs", "0"], ["'0'"]),
        (["train", "lr.onnx", "--data", "data.npz", "-o", "out/t.onnx", "--lr", "-1"], ["'-1'"]),
        (["fly"], ["invalid choice: 'fly'"]),
        ([], ["required: COMMAND"]),
    ],
)
def test_bad_options(workdir, args, fragments):
    _check(workdir, run_in_process(*args, cwd=workdir), 2, *fragments)


@pytest.mark.parametrize("args", [["derivative", "lr.onnx", "-o", "out/g.onnx", "--bogus"], []])
def test_bad_options_in_a_process(workdir, args):
    result = run_onnxgrad(*args, cwd=workdir)
    _check(workdir, result, 2, "error:", "--help")


def test_output_folder_missing(workdir):
    result = run_in_process("derivative", "lr.onnx", "-o", "nowhere/g.onnx", cwd=workdir)
    _check(workdir, result, 2, "'nowhere/g.onnx'", "does not exist")
    assert not (workdir / "nowhere").exists()


def test_library_rejection_names_the_weight(workdir):
    result = run_in_process(
        "derivative", "lr.onnx", "-o", "out/g.onnx", "--weights", "nope", cwd=workdir
    )
    _check(workdir, result, 2, "unknown weights ['nope']")


def test_add_loss_on_model_without_float_output(workdir):
    model = seed004_model()
    model.graph.output[0].type.tensor_type.elem_type = 7  # int64
    save(model, workdir / "int.onnx")
    result = run_in_process("add-loss", "int.onnx", "-o", "out/l.onnx", cwd=workdir)
    _check(workdir, result, 2, "add-loss: error:")


@pytest.mark.parametrize(
    ("data", "fragments"),
    [
        ("none.npz", ["'none.npz'", "does not exist"]),
        ("broken.npz", ["'broken.npz'", "not a readable .npz"]),
        ("no_y.npz", ["no array 'y'", "['X', 'z']"]),
        ("wrong_width.npz", ["shape (64, 3)", "'X'"]),
    ],
)
def test_bad_training_data(workdir, data, fragments):
    (workdir / "broken.npz").write_bytes(b"PK\x03\x04 not really a zip")
    X = np.zeros((64, 2), dtype=np.float32)
    np.savez(workdir / "no_y.npz", X=X, z=X[:, 0])
    np.savez(workdir / "wrong_width.npz", X=np.zeros((64, 3)), y=np.zeros(64))
    result = run_in_process(
        "train", "lr.onnx", "--data", data, "-o", "out/t.onnx", "--epochs", "1", cwd=workdir
    )
    _check(workdir, result, 2, *fragments)


def test_cuda_without_gpu_names_the_provider(workdir):
    try:
        check_device("cuda")
    except ValueError:
        pass
    else:
        pytest.skip("a CUDA device is available here")
    result = run_onnxgrad(
        "train",
        "lr.onnx",
        "--data",
        "data.npz",
        "-o",
        "out/t.onnx",
        "--device",
        "cuda",
        cwd=workdir,
    )
    _check(workdir, result, 2, "CUDAExecutionProvider")


def test_divergence_exits_1_and_writes_nothing(workdir):
    rng = np.random.default_rng(0)
    X = (rng.standard_normal((64, 2)) * 1e3).astype(np.float32)
    np.savez(workdir / "big.npz", X=X, y=X.sum(axis=1))
    result = run_onnxgrad(
        "train",
        "lr.onnx",
        "--data",
        "big.npz",
        "-o",
        "out/t.onnx",
        "--optimizer",
        "sgd",
        "--lr",
        "1e6",
        "--epochs",
        "20",
        cwd=workdir,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("onnxgrad train: error: training diverged")
    assert list((workdir / "out").iterdir()) == []


def test_failed_write_leaves_no_file(tmp_path):
    target = tmp_path / "model.onnx"

    def write(temporary):
        with open(temporary, "wb") as f:
            f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(target, write)
    assert list(tmp_path.iterdir()) == []


def test_write_replaces_an_existing_file_whole(tmp_path):
    target = tmp_path / "model.onnx"
    target.write_bytes(b"old")
    write_atomically(target, lambda temporary: Path(temporary).write_bytes(b"new"))
    assert target.read_bytes() == b"new"
    assert list(tmp_path.iterdir()) == [target]


@pytest.mark.parametrize(
    ("specs", "expected"),
    [
        (["coef=l1:0.1,l2:0.01"], {"coef": {"l1": 0.1, "l2": 0.01}}),
        (["b=0.5"], {"b": {"l2": 0.5}}),
        (["a=l1:1", "b=l2:2"], {"a": {"l1": 1.0}, "b": {"l2": 2.0}}),
        (None, {}),
    ],
)
def test_parse_penalties(specs, expected):
    assert parse_penalties(specs) == expected


@pytest.mark.parametrize("spec", ["coef", "=l1:1", "coef=", "coef=l1:1,l7:2"])
def test_parse_penalties_rejects(spec):
    with pytest.raises(CommandError, match="--penalty"):
        parse_penalties([spec])


def test_a_missing_onnxruntime_is_one_line_even_while_checking_options(tmp_path):
    """`train --optimizer` checks its choices against the library, which needs onnxruntime."""
    result = run_onnxgrad(
        "train",
        "m.onnx",
        "--data",
        "d.npz",
        "-o",
        "t.onnx",
        "--optimizer",
        "sgd",
        cwd=tmp_path,
        blocked=("onnxruntime",),
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "onnxruntime" in lines[0], result.stderr
