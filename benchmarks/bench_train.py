"""Training time per epoch: onnxgrad's ``fit`` against PyTorch eager, side by side.

Two models, same synthetic data, batch size, optimizer and initial weights (the ONNX model
is exported from the PyTorch module before training), every framework on one thread:

* a LeNet-like CNN (2 conv + 2 linear) on 28x28 images, batch 64, SGD with momentum 0.9;
* a small transformer classifier (embedding, 2 encoder layers, mean pool, linear) on
  sequences of 16 tokens, batch 32, Adam.

Both minimise the mean cross-entropy of the logits. The batch orders differ (each framework
shuffles with its own generator), so the final training losses agree within a tolerance,
not exactly. Runs alternate ``--repeat`` times; the table keeps the best wall-clock and CPU
times (the CPU seconds of this process, which a busy machine disturbs less) and the spread.
The CNN is exported by the TorchScript exporter, the transformer by the dynamo exporter.

    python benchmarks/bench_train.py [--epochs 5] [--repeat 3]
"""

from __future__ import annotations

import argparse
import io
import time
import warnings

import numpy as np
import onnx
from threadpoolctl import threadpool_limits

from onnxgrad import CrossEntropyLearningLoss, OrtGradientForwardBackwardOptimizer


def lenet(torch):
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 8, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(1),
        nn.Linear(256, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def transformer(torch, vocab=100, dim=32, classes=4):
    nn = torch.nn

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(vocab, dim)
            layer = nn.TransformerEncoderLayer(
                dim, 2, dim_feedforward=64, dropout=0.0, batch_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(dim, classes)

        def forward(self, ids):
            return self.head(self.encoder(self.embedding(ids)).mean(dim=1))

    return Classifier()


def cnn_data(rng, n=2048):
    X = rng.standard_normal((n, 1, 28, 28)).astype(np.float32)
    teacher = rng.standard_normal((28 * 28, 10)).astype(np.float32)
    y = (X.reshape(n, -1) @ teacher).argmax(axis=1).astype(np.int64)
    return X, y


def text_data(rng, n=1024, tokens=16, vocab=100):
    X = rng.integers(0, vocab, (n, tokens)).astype(np.int64)
    y = (X[:, :4].sum(axis=1) % 4).astype(np.int64)
    return X, y


def export(torch, module, example, dynamo=False) -> onnx.ModelProto:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            program = torch.onnx.export(
                module.eval(),
                (torch.from_numpy(example),),
                dynamo=True,
                opset_version=18,
                input_names=["X"],
                output_names=["logits"],
                dynamic_shapes=({0: torch.export.Dim("N", min=1)},),
                verbose=False,
            )
            return program.model_proto
        torch.onnx.export(
            module.eval(),
            (torch.from_numpy(example),),
            buffer,
            dynamo=False,
            opset_version=18,
            input_names=["X"],
            output_names=["logits"],
            dynamic_axes={"X": {0: "N"}, "logits": {0: "N"}},
        )
    return onnx.load_from_string(buffer.getvalue())


def torch_fit(torch, module, make_optimizer, X, y, batch, epochs) -> tuple[float, float, float]:
    """(seconds, CPU seconds, mean loss of the last epoch) of PyTorch eager training."""
    module.train()
    optimizer = make_optimizer(module.parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    Xt, yt = torch.from_numpy(X), torch.from_numpy(y)
    generator = torch.Generator().manual_seed(0)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(epochs):
        order = torch.randperm(len(Xt), generator=generator)
        losses = []
        for s in range(0, len(Xt), batch):
            rows = order[s : s + batch]
            optimizer.zero_grad()
            loss = loss_fn(module(Xt[rows]), yt[rows])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return time.perf_counter() - start, time.process_time() - cpu, float(np.mean(losses))


def onnxgrad_fit(estimator, X, y) -> tuple[float, float, float]:
    start, cpu = time.perf_counter(), time.process_time()
    estimator.fit(X, y)
    return time.perf_counter() - start, time.process_time() - cpu, estimator.train_losses_[-1]


def bench(torch, name, factory, data, batch, torch_opt, onnxgrad_opt, epochs, repeat):
    rng = np.random.default_rng(0)
    X, y = data(rng)
    torch.manual_seed(0)
    initial = factory(torch)
    model = export(torch, initial, X[:2], dynamo=X.dtype == np.int64)
    state = {k: v.clone() for k, v in initial.state_dict().items()}
    estimator = OrtGradientForwardBackwardOptimizer(
        model,
        max_iter=epochs,
        batch_size=batch,
        learning_rate=onnxgrad_opt,
        learning_loss=CrossEntropyLearningLoss(reduction="mean"),  # torch's default
        validation_every=0,
        random_state=0,
        intra_op_num_threads=1,
    )
    start = time.perf_counter()
    estimator.fit(X, y)  # builds the graphs and sessions, kept for the timed fits
    build = time.perf_counter() - start
    results = {"torch": [], "onnxgrad": []}
    for _ in range(repeat):
        module = factory(torch)
        module.load_state_dict(state)
        results["torch"].append(torch_fit(torch, module, torch_opt, X, y, batch, epochs))
        results["onnxgrad"].append(onnxgrad_fit(estimator, X, y))
    row = {"model": name, "epochs": epochs, "batch": batch, "build_s": build}
    for framework, runs in results.items():
        seconds = [s for s, _, _ in runs]
        cpu = [c for _, c, _ in runs]
        row[f"{framework}_epoch_s"] = min(seconds) / epochs
        row[f"{framework}_cpu_epoch_s"] = min(cpu) / epochs
        row[f"{framework}_spread"] = (max(seconds) - min(seconds)) / min(seconds)
        row[f"{framework}_loss"] = runs[0][2]
    row["ratio"] = row["onnxgrad_epoch_s"] / row["torch_epoch_s"]
    row["cpu_ratio"] = row["onnxgrad_cpu_epoch_s"] / row["torch_cpu_epoch_s"]
    return row


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed: nothing to compare with")
        return []
    torch.set_num_threads(1)
    rows = []
    with threadpool_limits(1):
        rows.append(
            bench(
                torch,
                "lenet 28x28 b64 momentum",
                lenet,
                cnn_data,
                64,
                lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
                _momentum(0.01),
                args.epochs,
                args.repeat,
            )
        )
        rows.append(
            bench(
                torch,
                "transformer 2 layers b32 adam",
                transformer,
                text_data,
                32,
                lambda p: torch.optim.Adam(p, lr=1e-3),
                "Adam",
                args.epochs,
                args.repeat,
            )
        )
    print(
        f"{'model':30s} {'torch s/ep':>10s} {'onnxgrad':>8s} {'ratio':>5s} "
        f"{'spread t/o':>10s} {'cpu torch':>9s} {'onnxgrad':>8s} {'ratio':>5s} "
        f"{'loss torch':>10s} {'onnxgrad':>8s}"
    )
    for r in rows:
        print(
            f"{r['model']:30s} {r['torch_epoch_s']:10.4f} {r['onnxgrad_epoch_s']:8.4f} "
            f"{r['ratio']:5.2f} {r['torch_spread']:4.0%}/{r['onnxgrad_spread']:<5.0%} "
            f"{r['torch_cpu_epoch_s']:9.4f} {r['onnxgrad_cpu_epoch_s']:8.4f} "
            f"{r['cpu_ratio']:5.2f} {r['torch_loss']:10.4f} {r['onnxgrad_loss']:8.4f}"
        )
    return rows


def _momentum(lr):
    from onnxgrad.training.step.learning_rate import LearningRateSGDNesterov

    return LearningRateSGDNesterov(eta0=lr, learning_rate="constant", nesterov=False)


if __name__ == "__main__":
    main()
