"""``onnxgrad artifacts``: the on-device training artifacts of a model (registered by
:mod:`onnxgrad.cli`; see :func:`onnxgrad.training.generate_artifacts`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from onnxgrad.cli_common import (
    CommandError,
    add_loss_options,
    add_optimizer_option,
    add_recompute_options,
    positive_float,
    positive_int,
    read_model,
    read_training_data,
    recompute_option,
    subcommand,
)

DATA_FILE = "data.json"


def cmd_artifacts(args: argparse.Namespace) -> None:
    from onnxgrad._onnx_utils import real_inputs
    from onnxgrad.graph.lora import add_lora
    from onnxgrad.training.artifacts.generate import generate_artifacts
    from onnxgrad.training.step.losses import select_learning_loss

    model = read_model(args.model)
    folder = Path(args.output)
    if folder.exists() and not folder.is_dir():
        raise CommandError(f"the output {args.output!r} exists and is not a folder")
    data = read_training_data(args.data, model) if args.data else None
    if data is not None and len(real_inputs(model)) != 1:
        names = [i.name for i in real_inputs(model)]
        raise CommandError(f"--data feeds one input, the model has {names}")
    if args.lora is not None:
        model = add_lora(model, args.lora or None, rank=args.lora_rank)
    artifacts = generate_artifacts(
        model,
        requires_grad=args.train,
        frozen_params=args.freeze,
        loss=select_learning_loss(args.loss, args.reduction),
        optimizer=args.optimizer,
        learning_rate=args.lr,
        artifact_directory=folder,
        data=data,
        recompute=recompute_option(args),
        target=args.target,
    )
    step = artifacts.train_step
    print(
        f"train step inputs: {', '.join(step.data_inputs)}, {len(step.weights)} weights, "
        f"{len(step.state)} optimizer state tensors, {step.learning_rate}"
    )
    print(f"trained: {', '.join(step.weights)}")
    for path in sorted(folder.iterdir()):
        if not path.name.startswith("."):
            print(f"  {path.name:24s} {path.stat().st_size:>10,d} bytes")
    print(f"wrote {folder}")


def add_artifacts(commands) -> None:
    sub = subcommand(
        commands,
        "artifacts",
        cmd_artifacts,
        "Write on-device training artifacts: train step, eval and inference models, checkpoint.",
        """
        onnxgrad artifacts model.onnx -o artifacts/
        onnxgrad artifacts model.onnx -o artifacts/ --optimizer sgd --lr 0.05 --data data.npz
        onnxgrad artifacts model.onnx -o artifacts/ --freeze W1 b1
        onnxgrad artifacts model.onnx -o artifacts/ --lora W1 W2 --lora-rank 4
        onnxgrad artifacts model.onnx -o artifacts/ --target webgpu
        onnxgrad artifacts model.onnx -o artifacts/ --target webgpu
        """,
    )
    sub.add_argument("model", help="ONNX file of a model that predicts (no loss output)")
    sub.add_argument(
        "-o",
        "--output",
        required=True,
        help="folder to write (created with its parents; a folder of earlier artifacts is "
        "replaced as a whole)",
    )
    add_loss_options(sub, "--loss")
    add_optimizer_option(sub, "adam", "the update fused into the train step")
    sub.add_argument(
        "--lr", type=positive_float, help="learning rate (default: 0.01, 0.001 for adam)"
    )
    sub.add_argument("--train", nargs="+", metavar="NAME", help="initializers to train only")
    add_recompute_options(sub, "attention")
    sub.add_argument(
        "--freeze", nargs="+", metavar="NAME", help="initializers kept constant (folded)"
    )
    sub.add_argument(
        "--lora",
        nargs="*",
        metavar="NAME",
        help="add low-rank adapters to these MatMul/Gemm/Conv weights (none named: all of "
        "them) and train the adapters only",
    )
    sub.add_argument(
        "--lora-rank", type=positive_int, default=4, help="adapter rank (default: %(default)s)"
    )
    sub.add_argument(
        "--data",
        help=f".npz file with arrays X and y, written beside the artifacts as {DATA_FILE} "
        "for the JavaScript example",
    )
    sub.add_argument(
        "--target",
        choices=("cpu", "webgpu"),
        default="cpu",
        help="webgpu: only operators with a kernel in onnxruntime-web's WebGPU provider "
        "(attention untiled, Sum as Adds; default: %(default)s)",
    )
