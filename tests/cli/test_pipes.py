"""A reader that stops reading (``onnxgrad text m.onnx | head -1``) is no error: status 0,
nothing on stderr, and a command that writes files still writes them."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.cli.helpers import run_onnxgrad_into_closed_pipe, save

#: Enough nodes and initializers that `text` and `info` print far more than a pipe holds.
CHAIN_LENGTH = 3000


def long_chain_model():
    """``y = x + b0 + b1 + ...``: one Add node and one trainable bias per link."""
    nodes, biases = [], []
    previous = "X"
    for k in range(CHAIN_LENGTH):
        output = "Y" if k == CHAIN_LENGTH - 1 else f"sum{k}"
        nodes.append(helper.make_node("Add", [previous, f"bias{k}"], [output]))
        biases.append(numpy_helper.from_array(np.full(2, k, np.float32), f"bias{k}"))
        previous = output
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 2])],
        biases,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


@pytest.mark.parametrize(("command", "first"), [("text", "opset:"), ("info", "model: chain")])
def test_closed_pipe_after_the_first_line(tmp_path, command, first):
    save(long_chain_model(), tmp_path / "chain.onnx")
    status, line, stderr = run_onnxgrad_into_closed_pipe(command, "chain.onnx", cwd=tmp_path)
    assert line.startswith(first), line
    assert (status, stderr) == (0, "")


def test_demo_into_a_closed_pipe_still_writes_its_files(tmp_path):
    status, line, stderr = run_onnxgrad_into_closed_pipe(
        "demo", "-o", "demo", "--epochs", "2", cwd=tmp_path
    )
    assert line.startswith("data: 800 training"), line
    assert status == 0, stderr
    assert "Broken pipe" not in stderr and "Traceback" not in stderr
    written = {path.name for path in (tmp_path / "demo").iterdir()}
    assert written >= {"mlp.onnx", "mlp_gradient.onnx", "mlp_train_step.onnx", "mlp_trained.onnx"}
