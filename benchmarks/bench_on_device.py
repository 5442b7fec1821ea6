"""On-device training: one train step of the same artifacts in Python, Node and a browser.

For a scikit-learn MLPRegressor (converted by skl2onnx) and a small CNN (exported by torch):
the artifact sizes, and the median time of one train step (Adam, batch 32) with

* ``python_runner``: onnxgrad's :class:`TrainingRunner` (IOBinding, ping-pong buffers);
* ``python_loop``: ``InferenceSession.run`` in a plain loop, as the JavaScript example does;
* ``node``: onnxruntime-node (``examples/js/train-node.mjs``);
* ``wasm``: onnxruntime-web's WebAssembly backend in headless Chromium (``index.html``).

One thread everywhere. Needs ``examples/js/setup.py`` (npm packages, Debian's chromium)
and torch for the CNN.

    python benchmarks/bench_on_device.py [--epochs 10] [--json results.json]
"""

from __future__ import annotations

import argparse
import io
import json
import runpy
import statistics
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from onnxgrad.training import (
    OrtDataLoader,
    TrainingRunner,
    generate_artifacts,
    parse_device,
)
from onnxgrad.training.artifacts.checkpoint import save_tensors

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "js"
BATCH = 32


def mlp_case():
    from skl2onnx import to_onnx
    from sklearn.neural_network import MLPRegressor

    rng = np.random.default_rng(0)
    X = rng.standard_normal((512, 16)).astype(np.float32)
    y = (X @ rng.standard_normal(16) + 0.1 * rng.standard_normal(512)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = MLPRegressor(hidden_layer_sizes=(64, 64), max_iter=5, random_state=0).fit(X, y)
    return to_onnx(est, X[:1], target_opset=15), X, y.reshape(-1, 1)


def cnn_case():
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 7 * 7, 10),
    ).eval()
    rng = np.random.default_rng(0)
    X = rng.standard_normal((512, 1, 16, 16)).astype(np.float32)
    y = rng.standard_normal((512, 10)).astype(np.float32)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net, (torch.from_numpy(X[:2]),), buffer, input_names=["x"], output_names=["y"],
            dynamic_axes={"x": {0: "N"}, "y": {0: "N"}}, opset_version=17, dynamo=False,
        )  # fmt: skip
    return onnx.load_from_string(buffer.getvalue()), X, y


class InOrder(OrtDataLoader):
    def epoch_order(self) -> np.ndarray:
        return np.arange(len(self), dtype=np.int64)


def one_thread() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return options


def python_runner_ms(art, X, y, epochs) -> float:
    runner = TrainingRunner(
        art.train_step,
        parse_device("cpu"),
        art.checkpoint.weights,
        art.checkpoint.optimizer_state,
        session_options=one_thread(),
    )
    loader = InOrder(X, y, batch_size=BATCH)
    times = []
    for _ in range(epochs):
        start = time.perf_counter()
        runner.run_epoch(loader, art.learning_rate)
        times.append((time.perf_counter() - start) / loader.n_batches * 1e3)
    return statistics.median(times[1:] or times)


def python_loop_ms(art, X, y, epochs) -> float:
    step = art.train_step
    session = ort.InferenceSession(
        str(art.path("training_model.onnx")), one_thread(), providers=["CPUExecutionProvider"]
    )
    values = {**art.checkpoint.weights, **art.checkpoint.optimizer_state}
    names = [*step.weights, *step.state]
    outputs = [step.loss, *step.new_weights, *step.new_state]
    lr = np.array(art.learning_rate, dtype=np.float32)
    times = []
    for _ in range(epochs):
        for start in range(0, len(X), BATCH):
            batch = slice(start, start + BATCH)
            feeds = {step.features[0]: X[batch], step.label: y[batch], **values}
            feeds[step.learning_rate] = lr
            t0 = time.perf_counter()
            _, *new = session.run(outputs, feeds)
            times.append((time.perf_counter() - t0) * 1e3)
            values = dict(zip(names, new))
    return statistics.median(times)


def node_ms(folder, epochs) -> float:
    command = ["node", "train-node.mjs", str(folder), "--epochs", str(epochs),
               "--batch-size", str(BATCH)]  # fmt: skip
    result = subprocess.run(command, cwd=EXAMPLE, capture_output=True, text=True, check=True)
    return json.loads(result.stdout)["medianStepMs"]


def wasm_ms(folder, epochs) -> float:
    server = runpy.run_path(str(EXAMPLE / "serve.py"))["make_server"](folder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = (
        f"http://127.0.0.1:{server.server_port}/index.html?artifacts=/artifacts/"
        f"&epochs={epochs}&batch={BATCH}"
    )
    try:
        result = subprocess.run(
            ["node", "run-browser.mjs", url, "--timeout", "600"],
            cwd=EXAMPLE, capture_output=True, text=True, check=True,
        )  # fmt: skip
    finally:
        server.shutdown()
    return json.loads(result.stdout)["medianStepMs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--json", help="write the rows there")
    args = parser.parse_args()
    if not runpy.run_path(str(EXAMPLE / "setup.py"))["ensure_js_env"](ROOT):
        raise SystemExit("the JavaScript example cannot be set up here (see above)")
    rows = []
    for name, make in (("mlp", mlp_case), ("cnn", cnn_case)):
        model, X, y = make()
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            art = generate_artifacts(model, optimizer="adam", folder=folder)
            save_tensors({art.train_step.features[0]: X, art.train_step.label: y},
                         folder / "data.json")  # fmt: skip
            sizes = {p.name: p.stat().st_size for p in folder.iterdir()}
            row = {
                "model": name,
                "weights": int(sum(w.size for w in art.checkpoint.weights.values())),
                "python_runner_ms": python_runner_ms(art, X, y, args.epochs),
                "python_loop_ms": python_loop_ms(art, X, y, args.epochs),
                "node_ms": node_ms(folder, args.epochs),
                "wasm_ms": wasm_ms(folder, args.epochs),
                "training_model_bytes": sizes["training_model.onnx"],
                "eval_model_bytes": sizes["eval_model.onnx"],
                "inference_model_bytes": sizes["inference_model.onnx"],
                "checkpoint_bytes": sizes["checkpoint.bin"] + sizes["checkpoint.json"],
            }
        print(json.dumps(row))
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
