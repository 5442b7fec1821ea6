"""``onnxgrad train``: train a model on the arrays of an ``.npz`` file (registered by
:mod:`onnxgrad.cli`; the estimator is
:class:`~onnxgrad.training.OrtGradientForwardBackwardOptimizer`)."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from onnxgrad._interrupt import finishing
from onnxgrad._progress import draws_bars
from onnxgrad.cli_common import (
    CommandError,
    add_loss_options,
    add_optimizer_option,
    add_recompute_options,
    check_destination,
    number,
    one_line,
    positive_float,
    positive_int,
    read_model,
    read_training_data,
    recompute_option,
    subcommand,
)
from onnxgrad.cli_feeds import add_feed_option, read_feeds, with_feeds


def cmd_train(args: argparse.Namespace) -> None:
    from onnxgrad.training.running.distributed import finish, rank0_prints

    with rank0_prints():
        _train(args)
    finish()


def _train(args: argparse.Namespace) -> None:
    import numpy as np

    from onnxgrad._files import save_model
    from onnxgrad.training import (
        ElasticLearningPenalty,
        OrtGradientForwardBackwardOptimizer,
        learning_rate_from_name,
    )
    from onnxgrad.training.estimators.resume import checkpoint_epochs
    from onnxgrad.training.running.distributed import rank, threads_per_rank
    from onnxgrad.training.step.losses import select_learning_loss

    if args.resume and not args.checkpoint:
        raise CommandError("--resume needs --checkpoint FILE.json, the checkpoint to resume")
    model = read_model(args.model)
    destination = check_destination(args.output)
    curve = check_destination(args.curve) if args.curve else None
    X, y = read_training_data(args.data, model)
    X, feeds = with_feeds(model, X, read_feeds(args.feed))
    l1, l2 = parse_penalty(args.penalty)
    loss = select_learning_loss(args.loss, args.reduction)
    bar = draws_bars()  # else one line per epoch, printed as it ends
    estimator = OrtGradientForwardBackwardOptimizer(
        model,
        weights_to_train=args.weights,
        max_iter=args.epochs,
        batch_size=args.batch_size,
        learning_rate=learning_rate_from_name(args.optimizer, eta0=_lr(args), schedule="constant"),
        learning_loss=loss,
        learning_penalty=ElasticLearningPenalty(l1=l1, l2=l2) if l1 or l2 else None,
        device=args.device,
        random_state=args.seed,
        validation_every=1,
        warm_start=True,
        verbose=int(bar),
        intra_op_num_threads=threads_per_rank(),
        recompute=recompute_option(args),
    )
    (X, y), validation = _split(X, y, args.val_fraction, np.random.default_rng(args.seed))
    with _class_label_hint(loss, y):
        estimator.initialize(X, y, feeds=feeds)
    weights = ", ".join(estimator.runner_.step.weights)
    print(f"training {weights} on {len(X)} rows" + _val_rows(validation))
    start = estimator.objective(X, y)
    print(f"starting loss {start:.6g}" + _val_loss(estimator, validation))
    if args.checkpoint:
        saver = checkpoint_epochs(estimator, args.checkpoint, {"start": start})
        start = saver.restore(estimator)["start"] if args.resume else start
    estimator.max_iter = args.epochs - estimator.n_iter_
    epoch_lines = _EpochLines(estimator, args.epochs, validation is not None)
    if not bar:
        epoch_lines.print_new()  # the epochs a resumed run restored
        estimator.epoch_callbacks = [*estimator.__dict__.get("epoch_callbacks", ()), epoch_lines]
    if estimator.max_iter > 0:
        validating = {} if validation is None else dict(zip(("X_val", "y_val"), validation))
        estimator.fit(X, y, feeds=feeds, **validating)
    epoch_lines.print_new()
    val = estimator.validation_losses_ if validation is not None else []
    if curve is not None:
        written = write_curve(curve, start, estimator.train_losses_, val)
        print(f"wrote {written}")
    if rank() == 0:
        with finishing():
            save_model(estimator.get_trained_onnx(), destination)
            print(f"wrote {destination}")


class _EpochLines:
    """Prints ``epoch 3/10  loss 0.25  validation 0.3`` for each epoch the estimator ends:
    called after every epoch (an ``epoch_callbacks`` entry) or once after training."""

    def __init__(self, estimator, epochs: int, validating: bool):
        self._estimator, self._epochs, self._validating = estimator, epochs, validating
        self._printed = 0

    def __call__(self, estimator) -> None:
        self.print_new()

    def print_new(self) -> None:
        losses = self._estimator.train_losses_
        val = self._estimator.validation_losses_ if self._validating else []
        for epoch in range(self._printed + 1, len(losses) + 1):
            shown = f"  validation {val[epoch - 1]:.6g}" if epoch <= len(val) else ""
            print(f"epoch {epoch:3d}/{self._epochs}  loss {losses[epoch - 1]:.6g}{shown}")
        self._printed = len(losses)


@contextlib.contextmanager
def _class_label_hint(loss, y):
    """A ``ValueError`` raised while ``y`` holds class labels (integers, booleans or strings)
    and ``loss`` is a regression loss becomes a ``CommandError`` naming the classification
    losses: the shapes differ because each label is one number, not one per output column."""
    try:
        yield
    except ValueError as exc:
        if loss.classification or y.dtype.kind not in "iubUSO":
            raise
        raise CommandError(
            f"{one_line(exc)}; y holds class labels ({y.dtype}) and --loss {loss.loss_name} "
            "compares numbers: train a classifier with --loss cross_entropy_logits (an output "
            "of logits) or --loss cross_entropy (probabilities)"
        ) from None


#: The command's optimizer and Adam's rate when none is named: the one candidate of
#: benchmarks/bench_defaults.py that trains a CNN, an MLP regression, a 2-layer BERT and a
#: converted classifier in 10 epochs (docs/getting-started.md has the table).
DEFAULT_OPTIMIZER = "adam"
DEFAULT_ADAM_LR = 0.003


def _lr(args: argparse.Namespace) -> float:
    """``--lr``; by default 0.003 for Adam (scale-free), else 0.01 per row: ``0.01 / B`` on
    the loss summed over a global batch of ``B = batch size * ranks`` rows (the default
    reduction), so that ranks train as one process with the global batch; 0.01 on its mean."""
    from onnxgrad.training.running.distributed import world_size

    if args.lr is not None:
        return args.lr
    if args.optimizer == "adam":
        return DEFAULT_ADAM_LR
    return 0.01 if args.reduction == "mean" else 0.01 / (args.batch_size * world_size())


def parse_penalty(spec: str | None) -> tuple[float, float]:
    """``'l1:0.1,l2:0.01'`` -> ``(0.1, 0.01)``; a bare number is an L2 coefficient."""
    if spec is None:
        return 0.0, 0.0
    coefs = {"l1": 0.0, "l2": 0.0}
    for term in spec.split(","):
        kind, sep, value = term.rpartition(":")
        kind = kind if sep else "l2"
        if kind not in coefs:
            raise CommandError(f"--penalty {spec!r}: unknown penalty kind {kind!r}, use l1 or l2")
        coefs[kind] = number(value, f"--penalty {spec!r}")
        if not coefs[kind] >= 0:
            raise CommandError(f"--penalty {spec!r}: coefficients must be >= 0")
    return coefs["l1"], coefs["l2"]


def _split(X, y, fraction: float | None, rng):
    if not fraction:
        return (X, y), None
    if not 0 < fraction < 1:
        raise CommandError(f"--val-fraction must be in (0, 1), got {fraction}")
    n_val = round(fraction * len(X))
    if not 0 < n_val < len(X):
        raise CommandError(f"--val-fraction {fraction} of {len(X)} rows leaves an empty part")
    order = rng.permutation(len(X))
    held, kept = sorted(order[:n_val]), sorted(order[n_val:])
    return (X[kept], y[kept]), (X[held], y[held])


def _val_rows(validation) -> str:
    return "" if validation is None else f", validating on {len(validation[0])}"


def _val_loss(estimator, validation) -> str:
    return "" if validation is None else f"  validation {estimator.objective(*validation):.6g}"


def write_curve(path: Path, start: float, train: list[float], validation: list[float]) -> Path:
    """The loss per epoch (epoch 0: the starting loss) as a PNG picture when matplotlib is
    installed and ``path`` does not end in ``.csv``, else as CSV (``epoch,train[,validation]``,
    written next to ``path`` with the suffix ``.csv``). Returns the path written."""
    from onnxgrad._files import write_atomically

    losses = [start, *train]
    if path.suffix.lower() != ".csv":
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            path = path.with_suffix(".csv")
        else:
            fig, ax = plt.subplots(figsize=(6, 4))
            try:
                ax.plot(range(len(losses)), losses, marker="o", markersize=3, label="training")
                if validation:
                    ax.plot(range(1, len(validation) + 1), validation, label="validation")
                ax.set_xlabel("epoch")
                ax.set_ylabel("loss")
                ax.grid(True, alpha=0.3)
                ax.legend()
                write_atomically(path, lambda tmp: fig.savefig(tmp, format="png"))
            finally:
                plt.close(fig)
            return path
    header = "epoch,train" + (",validation" if validation else "")
    rows = []
    for epoch, loss in enumerate(losses):
        row = f"{epoch},{loss!r}"
        if validation:
            row += f",{validation[epoch - 1]!r}" if 0 < epoch <= len(validation) else ","
        rows.append(row)
    write_atomically(path, lambda tmp: Path(tmp).write_text("\n".join([header, *rows]) + "\n"))
    return path


def add_train(commands) -> None:
    sub = subcommand(
        commands,
        "train",
        cmd_train,
        "Train a model on the arrays X and y of an .npz file and write the trained model.",
        """
        python -c "import numpy as np; X = np.random.rand(100, 3).astype('float32'); \\
            np.savez('data.npz', X=X, y=X.sum(axis=1))"
        onnxgrad train model.onnx --data data.npz -o trained.onnx
        onnxgrad train model.onnx --data data.npz -o trained.onnx --optimizer adam --lr 1e-3
        onnxgrad train clf.onnx --data data.npz -o trained.onnx --loss cross_entropy_logits \\
            --penalty l2:1e-4 --val-fraction 0.2 --curve loss.png
        """,
    )
    sub.add_argument("model", help="ONNX file of a model that predicts (no loss output)")
    sub.add_argument("--data", required=True, help=".npz file holding the arrays X and y")
    sub.add_argument("-o", "--output", required=True, help="ONNX file to write")
    sub.add_argument("--epochs", type=positive_int, default=10, help="default: %(default)s")
    sub.add_argument("--batch-size", type=positive_int, default=32, help="default: %(default)s")
    add_optimizer_option(
        sub,
        DEFAULT_OPTIMIZER,
        "momentum is classical momentum, nesterov Nesterov's",
    )
    sub.add_argument(
        "--lr",
        type=positive_float,
        help="constant learning rate (default: 0.003 for adam; for sgd, momentum and nesterov "
        "0.01 / batch size on the summed loss, the global batch of all ranks, 0.01 with "
        "--reduction mean)",
    )
    add_loss_options(sub, "--loss")
    sub.add_argument(
        "--penalty",
        metavar="l1:A,l2:B",
        help="add A*sum|W| + B*sum W^2 over every trained weight W (a bare B means l2:B)",
    )
    sub.add_argument(
        "--weights",
        nargs="+",
        metavar="NAME",
        help="the initializers to train (default: every float initializer a weight can be)",
    )
    sub.add_argument(
        "--val-fraction",
        type=float,
        metavar="F",
        help="hold out this fraction of the rows (drawn with --seed) and report its loss",
    )
    sub.add_argument(
        "--curve",
        metavar="FILE",
        help="write the loss per epoch: a PNG picture (matplotlib), or CSV (FILE.csv, or "
        "without matplotlib)",
    )
    add_feed_option(sub)
    sub.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    sub.add_argument("--seed", type=int, default=0, help="seed of the batch shuffling")
    add_recompute_options(sub, "attention")
    sub.add_argument(
        "--checkpoint",
        metavar="FILE.json",
        help="write the training state there at every epoch's end (rank 0 only)",
    )
    sub.add_argument(
        "--resume", action="store_true", help="continue from --checkpoint's last epoch"
    )
