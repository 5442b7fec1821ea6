"""One rank of the data-parallel tests, started by torchrun:
``torchrun --standalone --nproc_per_node=2 worker.py SCENARIO OUTDIR``.

* ``fit``: every case of :mod:`tests.distributed.cases`; rank 0 saves the weights and
  curves to ``OUTDIR/CASE.npz``; then a fit where rank 1 holds other data, and one where it
  holds another model, whose errors each rank writes to ``OUTDIR/{data,model}.RANK.txt``.
* ``kill``: rank 1 kills itself during its second epoch.
* ``hang``: rank 1 stops answering during its second epoch.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
from onnx import numpy_helper

from onnxgrad.training.running.distributed import DistributedError, DistributedRunner, rank
from tests.distributed.cases import BATCH, estimators


def fit(out: Path) -> None:
    for name, (estimator, X, y) in estimators(BATCH).items():
        estimator.fit(X, y)
        if rank() == 0:
            curves = {
                k: np.array(getattr(estimator, k)) for k in ("train_losses_", "validation_scores_")
            }
            np.savez(out / f"{name}.npz", **estimator.get_state(), **curves)
    estimator, X, y = estimators(BATCH, ["cnn"])["cnn"]
    try:
        estimator.fit(X if rank() == 0 else X + 1, y)
    except DistributedError as exc:
        (out / f"data.{rank()}.txt").write_text(str(exc))
    estimator, X, y = estimators(BATCH, ["cnn"])["cnn"]
    if rank() == 1:
        bias = next(i for i in estimator.model_onnx.graph.initializer if i.name == "fc_b")
        bias.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(bias) + 1, "fc_b"))
    try:
        estimator.fit(X, y)
    except DistributedError as exc:
        (out / f"model.{rank()}.txt").write_text(str(exc))


def fail_in_second_epoch(action) -> None:
    run_epoch = DistributedRunner.run_epoch
    calls = []

    def failing(self, loader, learning_rate):
        calls.append(1)
        if rank() == 1 and len(calls) == 2:
            action()
        return run_epoch(self, loader, learning_rate)

    DistributedRunner.run_epoch = failing
    estimator, X, y = estimators(BATCH, ["mlp"])["mlp"]
    estimator.fit(X, y)


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    if scenario == "fit":
        fit(out)
    elif scenario == "kill":
        fail_in_second_epoch(lambda: os.kill(os.getpid(), signal.SIGKILL))
    elif scenario == "hang":
        fail_in_second_epoch(lambda: time.sleep(3600))
    else:
        raise ValueError(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main()
