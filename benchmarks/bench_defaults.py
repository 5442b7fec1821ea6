"""Which optimizer and learning rate ``onnxgrad train`` should use when the user names none.

    python benchmarks/bench_defaults.py [--epochs 10] [--markdown]

Each candidate trains each kind of model the docs show, through the command itself
(``onnxgrad.cli.main``, batch 32, ``--epochs``), from the same start: a CNN on scikit-learn's
digits (8x8 images, 10 classes), the same on 3 digits and 240 rows, an MLP regression
(Friedman #1), a 2-layer BERT classifying token sequences and a converted scikit-learn
MLPClassifier fine-tuned on its probabilities. Per
run: the training loss after the last epoch over the starting loss (lower is better), and the
held-out metric (accuracy, or R2 for the regression) computed by onnxruntime on the written
model. A good default trains every kind in the command's default 10 epochs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

#: (label, --optimizer, --lr or None for the command's default rate)
CANDIDATES = [
    ("nesterov, 0.01/row (0.1.0 default)", "nesterov", None),
    ("nesterov, 0.1/row", "nesterov", "per-row:0.1"),
    ("sgd, 0.01/row", "sgd", None),
    ("adam 1e-3", "adam", "0.001"),
    ("adam 3e-3", "adam", "0.003"),
    ("adam 1e-2", "adam", "0.01"),
]
BATCH = 32


def _digits():
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    return (X / 16).astype(np.float32), y.astype(np.int64)


def _split(X, y, seed=0):
    order = np.random.default_rng(seed).permutation(len(X))
    cut = len(X) * 4 // 5
    return (X[order[:cut]], y[order[:cut]]), (X[order[cut:]], y[order[cut:]])


def _export(module, example) -> onnx.ModelProto:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from _zoo import export

    return export(module, example, dynamo=False, opset=17)


def cnn_case():
    import torch

    torch.manual_seed(0)
    nn = torch.nn
    net = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 2 * 2, 10),
    )  # fmt: skip
    X, y = _digits()
    X = X.reshape(-1, 1, 8, 8)
    return (
        "CNN, digits",
        _export(net, torch.from_numpy(X[:2])),
        _split(X, y),
        "cross_entropy_logits",
    )


def small_cnn_case():
    """Few rows, few steps: 3 digits, 240 training rows (8 batches an epoch)."""
    _, model, _, loss = cnn_case()
    X, y = _digits()
    keep = np.flatnonzero(y < 3)[:300]
    X, y = X[keep].reshape(-1, 1, 8, 8), y[keep]
    return "CNN, 3 digits, 240 rows", _retarget(model, 3), _split(X, y), loss


def _retarget(model: onnx.ModelProto, classes: int) -> onnx.ModelProto:
    """``model`` with its last Gemm's output cut to ``classes`` columns."""
    from onnx import numpy_helper

    gemm = [n for n in model.graph.node if n.op_type == "Gemm"][-1]
    for init in model.graph.initializer:
        if init.name in gemm.input[1:]:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init)[:classes], init.name))
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = classes
    return model


def mlp_case():
    import torch
    from sklearn.datasets import make_friedman1

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(10, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 1),
    )  # fmt: skip
    X, y = make_friedman1(2000, noise=0.5, random_state=0)
    X, y = X.astype(np.float32), ((y - y.mean()) / y.std()).astype(np.float32).reshape(-1, 1)
    return "MLP regression", _export(net, torch.from_numpy(X[:2])), _split(X, y), "squared_error"


def transformer_case():
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from _zoo import tiny_bert

    torch.manual_seed(0)
    vocab = 16
    rng = np.random.default_rng(0)
    X = rng.integers(0, vocab, (1200, 8)).astype(np.int64)
    y = (X[:, 1] % 4).astype(np.int64)
    model = _export(tiny_bert(vocab), torch.from_numpy(X[:2]))
    return "BERT (2 layers)", model, _split(X, y), "cross_entropy_logits"


def converted_case():
    import warnings

    from skl2onnx import to_onnx
    from sklearn.neural_network import MLPClassifier

    X, y = _digits()
    (X_train, y_train), test = _split(X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stopped early on purpose: there is room to train
        clf = MLPClassifier((32,), max_iter=3, random_state=0).fit(X_train, y_train)
    model = to_onnx(clf, X[:1], target_opset=17, options={"zipmap": False})
    return "converted MLPClassifier", model, ((X_train, y_train), test), "cross_entropy"


CASES = [cnn_case, small_cnn_case, mlp_case, transformer_case, converted_case]


def _train(folder: Path, loss: str, optimizer: str, lr: str | None, epochs: int) -> tuple:
    from onnxgrad.cli import main

    args = ["train", "model.onnx", "--data", "data.npz", "-o", "trained.onnx", "--loss", loss]
    args += ["--optimizer", optimizer, "--epochs", str(epochs), "--batch-size", str(BATCH)]
    if lr is not None:
        rate = float(lr.split(":")[1]) / BATCH if lr.startswith("per-row:") else float(lr)
        args += ["--lr", repr(rate)]
    out = io.StringIO()
    with contextlib.chdir(folder), contextlib.redirect_stdout(out):
        status = main(args)
    text = out.getvalue()
    if status != 0:
        return None, None
    start = float(re.search(r"starting loss (\S+)", text).group(1))
    last = float(re.findall(r"epoch +\d+/\d+ +loss (\S+)", text)[-1])
    return start, last


def _held_out(path: Path, test, classifier: bool) -> float:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    X, y = test
    outputs = session.run(None, {session.get_inputs()[0].name: X})
    scores = next(o for o in outputs if o.dtype == np.float32)
    if classifier:
        return float(np.mean(scores.argmax(axis=1) == y))
    return float(1 - np.sum((scores - y) ** 2) / np.sum((y - y.mean()) ** 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args()
    rows = []
    for case in CASES:
        name, model, (train, test), loss = case()
        classifier = loss != "squared_error"
        with tempfile.TemporaryDirectory() as folder:
            folder = Path(folder)
            onnx.save(model, folder / "model.onnx")
            np.savez(folder / "data.npz", X=train[0], y=train[1])
            for label, optimizer, lr in CANDIDATES:
                begin = time.perf_counter()
                start, last = _train(folder, loss, optimizer, lr, args.epochs)
                seconds = time.perf_counter() - begin
                if start is None:
                    rows.append((name, label, "failed", "", seconds))
                    continue
                metric = _held_out(folder / "trained.onnx", test, classifier)
                kind = "accuracy" if classifier else "R2"
                rows.append((name, label, f"{last / start:.3f}", f"{kind} {metric:.3f}", seconds))
                print(f"{name:24} {label:36} loss x{last / start:.3f}  {kind} {metric:.3f}  "
                      f"({seconds:.1f} s)", flush=True)  # fmt: skip
    if args.markdown:
        print("\n| model | optimizer, rate | last / starting loss | held out |")
        print("| --- | --- | --- | --- |")
        for name, label, ratio, metric, _ in rows:
            print(f"| {name} | {label} | {ratio} | {metric} |")


if __name__ == "__main__":
    main()
