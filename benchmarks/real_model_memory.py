"""Peak memory of one run of a real model's graphs: forward, input gradient, weight gradient,
train step (Adam, squared error), each in a fresh process that only loads onnxruntime, the
feeds and the graph (built beforehand by this script). The peak resident size is reset once
the feeds are loaded (Linux ``/proc/self/clear_refs``), so "added" is what creating the
session and running it once cost.

Default: the PP-OCRv4 text detector of the ``rapidocr-onnxruntime`` 1.4.4 wheel (PaddlePaddle,
converted by paddle2onnx) on one 800x608 image, one thread.

    python benchmarks/real_model_memory.py [--model PATH] [--height 608] [--width 800]
        [--python INTERPRETER]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

from onnxgrad import onnx_derivative
from onnxgrad.normalize import normalized_model
from onnxgrad.training import generate_artifacts

_CHILD = r"""
import json, sys
import numpy as np, onnxruntime as ort
def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field + ":")) / 1024
path, feeds_path = sys.argv[1], sys.argv[2]
feeds = dict(np.load(feeds_path))
options = ort.SessionOptions()
options.intra_op_num_threads = options.inter_op_num_threads = 1
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current resident size
before = status("VmRSS")
session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
wanted = {i.name for i in session.get_inputs()}
session.run(None, {k: v for k, v in feeds.items() if k in wanted})
print(json.dumps({"baseline_mb": before, "peak_mb": status("VmHWM")}))
"""


def default_model() -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.realmodels.wheels import wheel_models

    paths = wheel_models("rapidocr-onnxruntime", "1.4.4")
    return next(p for p in paths if p.name == "ch_PP-OCRv4_det_infer.onnx")


def graphs(model: Path, folder: Path, x: np.ndarray) -> dict[str, tuple[Path, dict]]:
    """``{name: (graph file, feeds)}`` of the four runs."""
    original = onnx.load(str(model))
    (output,) = [o.name for o in original.graph.output]
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"x": x})
    seed = {f"{output}_grad": np.ones_like(y)}
    runs = {"forward": (model, {"x": x})}
    wrt_input = onnx_derivative(original, weights=[])
    wrt_weights = onnx_derivative(original, inputs=[])
    initial = normalized_model(original).graph.initializer
    weights = {i.name: onnx.numpy_helper.to_array(i) for i in initial}
    for name, graph in (("input gradient", wrt_input), ("weight gradient", wrt_weights)):
        path = folder / f"{name.replace(' ', '_')}.onnx"
        onnx.save(graph, str(path))
        inputs = {i.name for i in graph.graph.input}
        values = {k: v for k, v in weights.items() if k in inputs}
        runs[name] = (path, {"x": x, **seed, **values})
    art = generate_artifacts(original, folder=folder / "artifacts")
    step = art.train_step
    feeds = {"x": x, step.label: np.zeros_like(y), **art.checkpoint.weights}
    feeds.update(art.checkpoint.optimizer_state)
    feeds[step.learning_rate] = np.array(art.learning_rate, np.float32)
    runs["train step"] = (art.path("training_model.onnx"), feeds)
    return runs


def measure(path: Path, feeds: dict, folder: Path, python: str) -> dict:
    feeds_path = folder / "feeds.npz"
    np.savez(feeds_path, **feeds)
    done = subprocess.run(
        [python, "-c", _CHILD, str(path), str(feeds_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--height", type=int, default=608)
    parser.add_argument("--width", type=int, default=800)
    parser.add_argument(
        "--python", default=sys.executable, help="the interpreter of the runs (its onnxruntime)"
    )
    args = parser.parse_args()
    model = args.model or default_model()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, args.height, args.width)).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        runs = graphs(model, folder, x)
        print(f"{model.name} at {args.width}x{args.height}, one thread")
        print(f"{'run':<16} {'peak RSS MB':>12} {'before the session MB':>22} {'added MB':>9}")
        for name, (path, feeds) in runs.items():
            found = measure(Path(path), feeds, folder, args.python)
            peak, base = found["peak_mb"], found["baseline_mb"]
            print(f"{name:<16} {peak:>12.0f} {base:>22.0f} {peak - base:>9.0f}")


if __name__ == "__main__":
    main()
