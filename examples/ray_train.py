"""Data-parallel onnxgrad training under Ray Train's ``TorchTrainer``.

Ray starts the workers (on one machine or a cluster) and their ``torch.distributed`` group;
each worker runs the same function: load the model and the data, ``fit``. onnxgrad sees the
started group and trains data-parallel (each worker takes its shard of every global batch
of ``workers x batch_size`` rows, the gradients are all-reduced); worker 0 writes the model.

    python examples/ray_train.py model.onnx data.npz trained.onnx --workers 2

On a cluster, ``model``, ``data`` and ``output`` must be paths every node reaches (a
shared file system).
"""

from __future__ import annotations

import argparse
import os


def train_loop_per_worker(config: dict) -> None:
    """What every Ray worker runs: the same code as one process."""
    import numpy as np
    import onnx
    import ray.train

    from onnxgrad import OrtGradientForwardBackwardOptimizer
    from onnxgrad.training.running.distributed import rank

    data = np.load(config["data"])
    estimator = OrtGradientForwardBackwardOptimizer(
        onnx.load(config["model"]),
        max_iter=config["epochs"],
        batch_size=config["batch_size"],
        learning_rate=config["learning_rate"],
        random_state=config["seed"],
        intra_op_num_threads=1,
    )
    estimator.fit(data["X"], data["y"])
    if rank() == 0:
        onnx.save(estimator.get_trained_onnx(), config["output"])
    ray.train.report({"loss": estimator.train_losses_[-1]})


def train(
    model: str,
    data: str,
    output: str,
    workers: int = 2,
    epochs: int = 5,
    batch_size: int = 32,
    learning_rate: float = 0.01,
    seed: int = 0,
):
    """Train ``model`` on ``data`` (an .npz with X and y) with ``workers`` Ray workers (CPU,
    gloo); ``batch_size`` rows per worker and batch. Returns Ray's ``Result``."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    config = {
        "model": os.path.abspath(model),
        "data": os.path.abspath(data),
        "output": os.path.abspath(output),
        "epochs": epochs,
        "batch_size": batch_size,
        "learning_rate": learning_rate,
        "seed": seed,
    }
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
    )
    return trainer.fit()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("data")
    parser.add_argument("output")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = train(
        args.model,
        args.data,
        args.output,
        args.workers,
        args.epochs,
        args.batch_size,
        args.lr,
        args.seed,
    )
    print(f"final training loss {result.metrics['loss']:.6g}; wrote {args.output}")


if __name__ == "__main__":
    main()
