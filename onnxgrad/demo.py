"""The demo job (``onnxgrad demo``): an MLP regression trained end to end by onnxgrad.

Nothing but the runtime dependencies is needed: the data are generated with numpy, the
network is an ONNX graph written with ``onnx.helper``, and the rest is onnxgrad's pipeline —

1. :func:`~onnxgrad.add_loss_output` appends the squared error;
2. :func:`~onnxgrad.onnx_derivative` builds the gradient graph of that loss (saved);
3. :func:`~onnxgrad.make_train_step` fuses forward, loss, gradient and the Nesterov update
   into one graph, which :class:`~onnxgrad.TrainingRunner` runs epoch after epoch;
4. the trained weights go back into the network (:func:`~onnxgrad.replace_initializers_into_onnx`),
   evaluated on held-out data with a plain onnxruntime ``InferenceSession``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np
import onnxruntime as ort
from onnx import ModelProto, TensorProto, helper, numpy_helper
from tqdm import tqdm

from onnxgrad._files import save_model, write_atomically
from onnxgrad._onnx_utils import MAX_IR_VERSION
from onnxgrad._progress import draws_bars
from onnxgrad.derivative import DerivativeOptions, onnx_derivative
from onnxgrad.exceptions import ConvergenceError
from onnxgrad.graph import add_loss_output, replace_initializers_into_onnx
from onnxgrad.training import (
    LearningRateSGDNesterov,
    OrtDataLoader,
    TrainingRunner,
    check_device,
    make_train_step,
)

__all__ = [
    "DemoResult",
    "make_regression_data",
    "mlp_regression_model",
    "r2_score",
    "run_demo",
    "write_loss_curve",
]

#: The default-domain opset of the demo network.
DEMO_OPSET = 18
#: Hidden layer sizes of the demo network.
HIDDEN = (32, 16)
#: Epochs when ``run_demo`` is not told.
DEFAULT_EPOCHS = 30


@dataclass(frozen=True)
class DemoResult:
    """What :func:`run_demo` produced: the losses, the held-out fit and the files written."""

    train_losses: list[float]
    r2_test: float
    files: dict[str, Path]
    seconds: float


def make_regression_data(
    n_samples: int = 1000, n_features: int = 8, noise: float = 0.1, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Features ``X ~ N(0, 1)`` and a smooth non-linear target, both float32.

    ``y = sin(2 x0) + x1 x2 + x3^2 / 2 + X w + noise * eps`` with random ``w ~ N(0, 0.5^2)``
    and ``eps ~ N(0, 1)``, then standardised; ``y`` has shape ``(n_samples, 1)``.
    """
    if n_features < 4:
        raise ValueError(f"n_features must be at least 4, got {n_features}")
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n_samples, n_features))
    w = rng.normal(0.0, 0.5, size=n_features)
    y = np.sin(2 * X[:, 0]) + X[:, 1] * X[:, 2] + X[:, 3] ** 2 / 2 + X @ w
    y += noise * rng.standard_normal(n_samples)
    y = (y - y.mean()) / y.std()
    return X.astype(np.float32), y.reshape((-1, 1)).astype(np.float32)


def mlp_regression_model(
    n_features: int, hidden: Sequence[int] = (32, 16), seed: int = 0
) -> ModelProto:
    """A ReLU multi-layer perceptron ``X [N, n_features] -> Y [N, 1]`` as an ONNX graph.

    Layer ``k`` computes ``h_k = relu(h_{k-1} W_k + b_k)`` (no ReLU on the last one). Weights
    ``W_k`` are drawn from Glorot's uniform law ``U(-a, a)``, ``a = sqrt(6 / (fan_in +
    fan_out))``, as scikit-learn's MLP does; biases too. Initializers are named
    ``coefficient{k}`` and ``intercept{k}``.
    """
    rng = np.random.default_rng(seed)
    sizes = [n_features, *hidden, 1]
    nodes, initializers = [], []
    previous = "X"
    for k, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        bound = np.sqrt(6.0 / (fan_in + fan_out))
        coef = rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32)
        bias = rng.uniform(-bound, bound, (fan_out,)).astype(np.float32)
        initializers += [
            numpy_helper.from_array(coef, f"coefficient{k}"),
            numpy_helper.from_array(bias, f"intercept{k}"),
        ]
        last = k == len(sizes) - 2
        product, affine = f"matmul{k}", "Y" if last else f"affine{k}"
        nodes.append(helper.make_node("MatMul", [previous, f"coefficient{k}"], [product]))
        nodes.append(helper.make_node("Add", [product, f"intercept{k}"], [affine]))
        if not last:
            previous = f"hidden{k}"
            nodes.append(helper.make_node("Relu", [affine], [previous]))
    graph = helper.make_graph(
        nodes,
        "mlp_regression",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", n_features])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
        initializers,
    )
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", DEMO_OPSET)],
        ir_version=MAX_IR_VERSION,
        producer_name="onnxgrad.demo",
    )


def r2_score(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Coefficient of determination ``1 - sum (y - p)^2 / sum (y - mean y)^2``."""
    y_true = np.asarray(y_true, dtype=np.float64).ravel()
    y_pred = np.asarray(y_pred, dtype=np.float64).ravel()
    residual = np.sum((y_true - y_pred) ** 2)
    total = np.sum((y_true - y_true.mean()) ** 2)
    return float(1.0 - residual / total)


def run_demo(
    folder: str | os.PathLike = "onnxgrad-demo",
    epochs: int | None = None,
    *,
    batch_size: int = 16,
    learning_rate: float = 0.002,
    seed: int = 0,
    backend: str = "onnx",
    out: TextIO | None = None,
) -> DemoResult:
    """Train the demo MLP and write what was built into ``folder`` (created if needed).

    SGD with Nesterov momentum 0.9 and a constant ``learning_rate`` minimises the squared
    error summed over each batch of ``batch_size`` rows for ``epochs`` epochs (default
    :data:`DEFAULT_EPOCHS`) on 800 rows; the fit is the R² on 200 held-out rows.

    Files: ``mlp.onnx`` (the untrained network), ``mlp_gradient.onnx`` (the gradient of the
    loss with respect to every weight), ``mlp_train_step.onnx`` (the fused train step),
    ``mlp_trained.onnx`` and ``loss_curve.png``, or ``loss_curve.csv`` when matplotlib is
    not installed. Progress and results go to ``out`` (default: standard output), the
    progress bar to standard error. Raises :class:`~onnxgrad.ConvergenceError` if the loss
    stops being finite.
    """
    out = sys.stdout if out is None else out
    epochs = DEFAULT_EPOCHS if epochs is None else epochs
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be a positive integer, got {epochs!r}")
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{str(folder)!r} exists and is not a folder")
    start = time.perf_counter()

    X, y = make_regression_data(seed=seed)
    n_train = int(0.8 * len(X))
    mlp = mlp_regression_model(X.shape[1], HIDDEN, seed=seed)
    layers = " -> ".join(str(n) for n in (X.shape[1], *HIDDEN, 1))
    _say(
        out, f"data: {n_train} training and {len(X) - n_train} held-out rows, {X.shape[1]} features"
    )
    _say(out, f"model: MLP {layers} (ReLU), {len(mlp.graph.node)} ONNX nodes")

    weights = [init.name for init in mlp.graph.initializer]
    loss_model = add_loss_output(mlp, score_name="squared_error", reduction="sum")
    gradient = onnx_derivative(
        loss_model,
        weights=weights,
        inputs=[],
        options=DerivativeOptions.Loss,
        label="label",
        backend=backend,
    )
    _say(out, f"gradient graph ({backend} backend): {len(gradient.graph.node)} nodes")

    optimizer = LearningRateSGDNesterov(
        eta0=learning_rate, learning_rate="constant", momentum=0.9, nesterov=True
    )
    step = make_train_step(
        loss_model,
        weights,
        loss=None,
        label_name="label",
        learning_rate=optimizer,
        backend=backend,
    )
    _say(out, f"train step: {len(step.model.graph.node)} nodes, Nesterov, lr {learning_rate}")
    initial = {init.name: numpy_helper.to_array(init) for init in mlp.graph.initializer}
    runner = TrainingRunner(step, check_device("cpu"), initial)
    loader = OrtDataLoader(X[:n_train], y[:n_train], batch_size=batch_size, random_state=seed)
    losses = _train(runner, loader, optimizer, epochs, out)

    trained = replace_initializers_into_onnx(mlp, runner.get_weights())
    session = ort.InferenceSession(trained.SerializeToString(), providers=["CPUExecutionProvider"])
    r2 = r2_score(y[n_train:], session.run(None, {"X": X[n_train:]})[0])
    _say(out, f"held-out R2: {r2:.4f}")

    models = {"mlp": mlp, "mlp_gradient": gradient, "mlp_train_step": step.model}
    models["mlp_trained"] = trained
    files = _write_files(folder, models, losses)
    for path in files.values():
        _say(out, f"wrote {path}")
    return DemoResult(losses, r2, files, time.perf_counter() - start)


def _say(out: TextIO, line: str) -> None:
    """Print a progress line; a reader that stopped reading (``| head``) does not stop the demo."""
    with contextlib.suppress(BrokenPipeError):
        tqdm.write(line, file=out)


def _train(
    runner: TrainingRunner,
    loader: OrtDataLoader,
    optimizer: LearningRateSGDNesterov,
    epochs: int,
    out: TextIO,
) -> list[float]:
    """Run ``epochs`` epochs; the loss of an epoch is the mean squared error per row."""
    optimizer.init_learning_rate()
    losses: list[float] = []
    seen = 0
    epoch_numbers = range(1, epochs + 1)
    with tqdm(epoch_numbers, desc="training", unit="epoch", disable=not draws_bars()) as bar:
        for epoch in bar:
            optimizer.update_learning_rate(seen)
            batch_losses = runner.run_epoch(loader, optimizer.value)
            seen += len(loader)
            losses.append(float(np.sum(batch_losses, dtype=np.float64) / len(loader)))
            if not np.isfinite(losses[-1]):
                raise ConvergenceError(
                    f"the loss is not finite at epoch {epoch}: lower the learning rate"
                )
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            _say(out, f"epoch {epoch:3d}/{epochs}  loss {losses[-1]:.5f}")
    return losses


def _write_files(
    folder: Path, models: dict[str, ModelProto], losses: Sequence[float]
) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, model in models.items():
        files[name] = folder / f"{name}.onnx"
        save_model(model, files[name])
    files["loss_curve"] = write_loss_curve(losses, folder)
    return files


def write_loss_curve(losses: Sequence[float], folder: str | os.PathLike) -> Path:
    """Write the loss per epoch into ``folder``: ``loss_curve.png`` (log scale) when
    matplotlib is installed, else ``loss_curve.csv`` (columns ``epoch, loss``). Returns the
    path written."""
    folder = Path(folder)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        path = folder / "loss_curve.csv"
        rows = "".join(f"{i},{loss!r}\n" for i, loss in enumerate(losses, start=1))
        write_atomically(path, lambda tmp: Path(tmp).write_text("epoch,loss\n" + rows))
        return path
    path = folder / "loss_curve.png"
    fig, ax = plt.subplots(figsize=(6, 4))
    try:
        ax.plot(range(1, len(losses) + 1), losses, marker="o", markersize=3)
        ax.set_xlabel("epoch")
        ax.set_ylabel("training loss (mean squared error)")
        ax.set_yscale("log")
        ax.set_title("onnxgrad demo: MLP regression, SGD with Nesterov momentum")
        ax.grid(True, alpha=0.3)
        write_atomically(path, lambda tmp: fig.savefig(tmp, format="png", bbox_inches="tight"))
    finally:
        plt.close(fig)
    return path
