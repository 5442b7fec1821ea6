"""Deep graphs: the derivative's memory and time grow linearly with the nodes.

A chain of Add, Mul and Tanh nodes (a weight of 8 floats per Add and Mul) is saved, then
``onnx.load``-ed and differentiated in a child process with a capped address space, once at
:data:`SMALL` and once at :data:`LARGE` nodes. The child reports the growth of its peak
resident memory (``VmHWM``, reset through ``/proc/self/clear_refs``) over the memory it had
with the model loaded, and the CPU time of ``onnx_derivative``.

Before: 23 KB a node at 12k nodes (a detached protobuf copy of every node, 1.6 KB each, at every
rewrite of the node list, and the emitted nodes each in an arena of its own), and a name
check quadratic in the weights (52 s of 235 at 50k nodes); then 13 KB (onnx's checker and
strict inference of the whole gradient graph, stale copies of its node list left by
reordering rewrites, the engine's tables alive through the clean-up).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import GraphProto, ModelProto, TensorProto, helper, numpy_helper, save_model

ROOT = Path(__file__).resolve().parents[2]
SMALL, LARGE = 3000, 12000
#: The address space a child may map (its imports take about 0.2 GiB).
ADDRESS_SPACE = 2 << 30

_CHILD = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
import onnx
from onnxgrad import onnx_derivative

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

model = onnx.load(sys.argv[1])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM restarts from the current resident memory
before = status("VmRSS:")
start = time.process_time()
gradient = onnx_derivative(model)
seconds = time.process_time() - start
print(json.dumps({{"growth": status("VmHWM:") - before, "seconds": seconds,
                  "gradient_nodes": len(gradient.graph.node)}}))
"""


def chain(nodes: int) -> ModelProto:
    """``nodes`` nodes: Add, Mul, Tanh, Add... each Add and Mul with its own weight."""
    model = helper.make_model(
        GraphProto(name="chain"), opset_imports=[helper.make_opsetid("", 17)], ir_version=8
    )
    graph, value = model.graph, "X"
    graph.input.append(helper.make_tensor_value_info(value, TensorProto.FLOAT, ["N", 8]))
    for i in range(nodes):
        op = ("Add", "Mul", "Tanh")[i % 3]
        node = graph.node.add(op_type=op, name=f"n{i}", input=[value], output=[f"v{i}"])
        if op != "Tanh":
            node.input.append(f"w{i}")
            graph.initializer.append(numpy_helper.from_array(np.full(8, 0.5, np.float32), f"w{i}"))
        value = f"v{i}"
    graph.output.append(helper.make_tensor_value_info(value, TensorProto.FLOAT, ["N", 8]))
    return model


def _measure(path: Path) -> dict:
    code = _CHILD.format(limit=ADDRESS_SPACE)
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def measures(tmp_path_factory) -> dict[int, dict]:
    folder = tmp_path_factory.mktemp("deep")
    found = {}
    for nodes in (SMALL, LARGE):
        path = folder / f"chain_{nodes}.onnx"
        save_model(chain(nodes), path)
        found[nodes] = _measure(path)
    return found


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux /proc needed"),
]


def test_the_gradient_of_a_chain_is_complete(measures):
    # the forward nodes, at least one gradient node each, one output per weight: a child
    # that stopped early would report a small growth
    for nodes, measure in measures.items():
        assert measure["gradient_nodes"] >= 2 * nodes + 2 * nodes // 3, measure


def test_memory_per_node_is_bounded(measures):
    # about 8 KB a node at 12k (the gradient graph, with three times as many nodes as the
    # forward, and the clean-up's tables over it; onnx's check runs in pieces); 13 KB before
    per_node = {n: m["growth"] / n / 1024 for n, m in measures.items()}
    assert per_node[LARGE] < 11, per_node


def test_time_grows_linearly(measures):
    # four times the nodes, four times the time: a pass quadratic in the nodes, even a
    # tenth of the time at the small size, shows as a ratio near 2
    per_node = {n: m["seconds"] / n for n, m in measures.items()}
    assert per_node[LARGE] < 1.5 * per_node[SMALL], per_node
