"""Building graphs of a big model holds its weights once more at most: the private normalised
copy. Measured in a child process as the growth of its peak resident memory (``VmHWM``,
reset through ``/proc/self/clear_refs``) over the memory it had with the model loaded, big
blocks returned to the system when freed (``MALLOC_MMAP_THRESHOLD_``).

Protobuf keeps what an in-place rewrite drops until the whole message goes, and its
``ByteSize`` serialises the message to measure it: each showed here as a whole extra copy of
the weights (``make_train_step`` grew by 3x the model, ``save_model`` by 2x)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS, SIDE = 8, 2048  # 128 MiB of float32 weights

_CHILD = """
import json, sys
import numpy as np
from onnx import TensorProto, helper
import onnxgrad
from onnxgrad import onnx_derivative
from onnxgrad.training import make_train_step
from onnxgrad._files import save_model

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))

def model():
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "X"
    for i in range({layers}):
        w = TensorProto(name=f"W{{i}}", data_type=TensorProto.FLOAT, dims=[{side}, {side}])
        w.raw_data = rng.standard_normal(({side}, {side}), dtype=np.float32).tobytes()
        inits.append(w)
        nodes += [helper.make_node("MatMul", [prev, f"W{{i}}"], [f"m{{i}}"]),
                  helper.make_node("Tanh", [f"m{{i}}"], [f"t{{i}}"])]
        prev = f"t{{i}}"
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", {side}])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, ["N", {side}])])
    graph.initializer.extend(inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])

m = model()
growth = {{}}
for name, build in [
    ("onnx_derivative", lambda: onnx_derivative(m)),
    ("make_train_step", lambda: make_train_step(m)),
    ("save_model", lambda: save_model(m, sys.argv[1])),
]:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM restarts from the current resident memory
    before = status("VmRSS:")
    result = build()
    growth[name] = (status("VmHWM:") - before) / (128 * 2**20)
    del result
print(json.dumps(growth))
"""


@pytest.fixture(scope="module")
def growth(tmp_path_factory) -> dict[str, float]:
    path = tmp_path_factory.mktemp("memory") / "model.onnx"
    code = textwrap.dedent(_CHILD.format(layers=LAYERS, side=SIDE))
    # big blocks mapped and unmapped at once: resident memory is the memory in use
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    result = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux /proc needed")
@pytest.mark.parametrize("entry", ["onnx_derivative", "make_train_step", "save_model"])
def test_a_build_holds_the_weights_once_more_at_most(growth, entry):
    # the private normalised copy is one model's worth, the graphs built are small (a few
    # tensors' worth of transients); a save holds a few tensors' bytes at a time (before:
    # 3.0 and 2.0 models' worth, any whole extra copy passes 2.0)
    limit = 0.6 if entry == "save_model" else 1.5
    assert growth[entry] < limit, growth
