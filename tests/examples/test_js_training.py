"""The JavaScript example trains onnxgrad's artifacts in Node (onnxruntime-node) and in
headless Chromium (onnxruntime-web, WASM) exactly as Python's runner does.

For a skl2onnx MLPRegressor (Adam), a small CNN exported by torch (momentum) and an
attention over 128 tokens whose train step computes the attention in tiles (Adam), the loss
of every step equals the Python :class:`TrainingRunner`'s within float32 tolerance, the
first one equals the squared error (summed over the batch) of scikit-learn's / torch's own
prediction, and the trained checkpoint each runtime writes, merged back into the model,
predicts what the model merged with the runner's weights predicts.

The set-up (``examples/js/setup.py``: ``npm ci``, Debian's chromium) runs first; the tests
skip, saying why, only where node, npm or the browser cannot be installed.
"""

from __future__ import annotations

import importlib.util
import io
import json
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxgrad.training import (
    Checkpoint,
    OrtDataLoader,
    TrainingRunner,
    generate_artifacts,
    merge_checkpoint,
    parse_device,
)
from onnxgrad.training.artifacts.checkpoint import load_checkpoint, save_tensors
from tests.graph.sklearn_models import mlp_regressor

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "js"
EPOCHS, BATCH = 3, 8


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_js_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def js_env():
    if shutil.which("node") is None:
        pytest.skip("node is not installed: the JavaScript example cannot run here")
    if not _load("setup").ensure_js_env(ROOT):
        pytest.skip("examples/js/setup.py could not install npm packages or chromium (stderr)")


@pytest.fixture(scope="module")
def server(js_env, tmp_path_factory):
    """The example page on 127.0.0.1, ``/artifacts/`` mapped to a folder set per case."""
    root = tmp_path_factory.mktemp("served")
    httpd = _load("serve").make_server(root)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()
    httpd.server_close()


class InOrder(OrtDataLoader):
    """Batches in row order, as the JavaScript example takes them."""

    def epoch_order(self) -> np.ndarray:
        return np.arange(len(self), dtype=np.int64)


def _mlp_case():
    mlp = mlp_regressor()
    X, y = mlp.X.astype(np.float32), mlp.y.astype(np.float32).reshape(-1, 1)
    first = np.sum((mlp.estimator.predict(X[:BATCH]).reshape(-1, 1) - y[:BATCH]) ** 2)
    return mlp.onnx, "adam", X, y, first


def _cnn_case():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)

    class SmallCNN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 4, 3)
            self.fc = torch.nn.Linear(4 * 6 * 6, 2)

        def forward(self, x):
            return self.fc(torch.relu(self.conv(x)).flatten(1))

    net = SmallCNN().eval()
    rng = np.random.default_rng(3)
    X = rng.standard_normal((32, 1, 8, 8)).astype(np.float32)
    y = rng.standard_normal((32, 2)).astype(np.float32)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            net,
            (torch.from_numpy(X[:2]),),
            buffer,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "N"}, "y": {0: "N"}},
            opset_version=17,
            dynamo=False,
        )
    with torch.no_grad():
        batch, target = torch.from_numpy(X[:BATCH]), torch.from_numpy(y[:BATCH])
        first = torch.nn.functional.mse_loss(net(batch), target, reduction="sum").item()
    return onnx.load_from_string(buffer.getvalue()), "momentum", X, y, first


def _attention_case():
    """A one-head attention over 128 tokens, mean-pooled into 2 outputs: its scores (128 x
    128) are large enough for the train step to compute them in tiles (``Loop``s)."""
    from onnx import TensorProto, helper, numpy_helper

    tokens, width, rng = 128, 8, np.random.default_rng(5)
    weights = {
        name: (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
        for name, shape in {"Wq": (4, width), "Wk": (4, width), "Wv": (4, width)}.items()
    }
    weights["Wo"] = (rng.standard_normal((width, 2)) / np.sqrt(width)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "Wq"], ["q"]),
        helper.make_node("MatMul", ["x", "Wk"], ["k"]),
        helper.make_node("MatMul", ["x", "Wv"], ["v"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["scores"]),
        helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
        helper.make_node("Softmax", ["scaled"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["o"]),
        helper.make_node("ReduceMean", ["o", "tokens_axis"], ["pooled"], keepdims=0),
        helper.make_node("MatMul", ["pooled", "Wo"], ["y"]),
    ]
    inits = [numpy_helper.from_array(value, name) for name, value in weights.items()]
    inits.append(numpy_helper.from_array(np.array(width**-0.5, np.float32), "scale"))
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "tokens_axis"))
    graph = helper.make_graph(
        nodes,
        "attention",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", tokens, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    X = rng.standard_normal((32, tokens, 4)).astype(np.float32)
    y = rng.standard_normal((32, 2)).astype(np.float32)
    first = float(np.sum((_predict(model, "x", X[:BATCH]) - y[:BATCH]) ** 2))
    return model, "adam", X, y, first


CASES = {"mlp": _mlp_case, "cnn": _cnn_case, "attention": _attention_case}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    model, optimizer, X, y, first = CASES[request.param]()
    folder = tmp_path_factory.mktemp(request.param)
    art = generate_artifacts(model, optimizer=optimizer, learning_rate=0.01, folder=folder)
    if request.param == "attention":  # the default recompute="attention" tiled it
        ops = [n.op_type for n in art.train_step.model.graph.node]
        assert ops.count("Loop") == 2 and "Softmax" not in ops
    feature, label = art.train_step.features[0], art.train_step.label
    save_tensors({feature: X, label: y}, folder / "data.json")
    runner = TrainingRunner(
        art.train_step, parse_device("cpu"), art.checkpoint.weights, art.checkpoint.optimizer_state
    )
    loader = InOrder(X, y, batch_size=BATCH)
    losses = np.concatenate([runner.run_epoch(loader, art.learning_rate) for _ in range(EPOCHS)])
    expected = merge_checkpoint(folder, Checkpoint(runner.get_weights()))
    return {
        "art": art,
        "X": X,
        "feature": feature,
        "losses": losses,
        "first": first,
        "model": expected,
    }


def _predict(model, feature, X):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {feature: X})[0]


def _check(case, report, trained_folder):
    assert "error" not in report, report
    losses = np.array(report["losses"], dtype=np.float64)
    assert losses.shape == case["losses"].shape
    np.testing.assert_allclose(losses[0], case["first"], rtol=1e-5)
    np.testing.assert_allclose(losses, case["losses"], rtol=1e-4, atol=1e-6)
    trained = load_checkpoint(trained_folder / "checkpoint.json")
    initial = case["art"].checkpoint
    assert list(trained.weights) == list(initial.weights)
    assert {k: v.dtype for k, v in trained.optimizer_state.items()} == {
        k: v.dtype for k, v in initial.optimizer_state.items()
    }
    merged = merge_checkpoint(case["art"].directory, trained_folder / "checkpoint.json")
    X, feature = case["X"], case["feature"]
    np.testing.assert_allclose(
        _predict(merged, feature, X), _predict(case["model"], feature, X), rtol=1e-4, atol=1e-5
    )


def test_node_trains_like_python(js_env, case, tmp_path):
    folder = case["art"].directory
    command = [
        "node",
        str(EXAMPLE / "train-node.mjs"),
        str(folder),
        "--epochs",
        str(EPOCHS),
        "--batch-size",
        str(BATCH),
        "--out",
        str(tmp_path),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=EXAMPLE)
    assert result.returncode == 0, result.stderr
    _check(case, json.loads(result.stdout), tmp_path)


def test_node_refuses_to_write_over_the_artifacts_checkpoint(js_env, case):
    folder = case["art"].directory
    before = (folder / "checkpoint.bin").read_bytes()
    command = ["node", str(EXAMPLE / "train-node.mjs"), str(folder), "--out", str(folder)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=EXAMPLE)
    assert result.returncode == 2 and "holds artifacts" in result.stderr, result.stderr
    assert (folder / "checkpoint.bin").read_bytes() == before


def test_browser_trains_like_python(server, case, tmp_path):
    served, base = server
    name = case["art"].directory.name
    shutil.copytree(case["art"].directory, served / name)  # the server follows no link out
    url = f"{base}/index.html?artifacts=/artifacts/{name}/&epochs={EPOCHS}&batch={BATCH}"
    command = ["node", str(EXAMPLE / "run-browser.mjs"), url, "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=EXAMPLE)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads(result.stdout)
    assert report["runtime"].startswith("onnxruntime-web") and "wasm" in report["runtime"]
    _check(case, report, tmp_path)
