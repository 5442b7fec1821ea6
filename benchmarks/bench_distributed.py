"""Data-parallel training: rows per second on 1 and 2 ranks, and where a step's time goes.

Two models, every rank on one onnxruntime thread, gloo on localhost:

* the MLP of ``bench_mlp.py`` (100 -> 50 -> 10 -> 1, ReLU), 1000 rows, SGD with Nesterov
  momentum, 16 rows per rank and batch;
* the transformer classifier of ``bench_train.py`` (embedding, 2 encoder layers, mean pool,
  linear; exported by the dynamo exporter), 1024 sequences of 16 tokens, Adam, 32 rows per
  rank and batch.

For each, one process runs the fused train step (the single-process path) and the split
step (gradient graph, all-reduce, update graph) on a group of one rank, then ``torchrun``
starts 2 ranks on the split step (a group of one rank skips the all-reduce). Setups of one
process alternate, ``--repeat`` times, and each keeps its fastest run. Rows/s counts the
rows of the whole job by the wall clock; rows per CPU second are a rank's (less disturbed
by a busy machine). The step's parts (gradient graph, all-reduce, update graph) are shares
of the wall time; the all-reduce's share includes the wait for the slower rank.

    python benchmarks/bench_distributed.py [--epochs 3] [--repeat 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
CASES = {"mlp": {"batch": 16, "rows": 1000}, "transformer": {"batch": 32, "rows": 1024}}


def mlp_model(rng) -> onnx.ModelProto:
    sizes = [100, 50, 10, 1]
    nodes, weights, x = [], [], "X"
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        w = (rng.standard_normal((a, b)) * np.sqrt(2 / a)).astype(np.float32)
        weights += [
            numpy_helper.from_array(w, f"W{i}"),
            numpy_helper.from_array(np.zeros(b, np.float32), f"b{i}"),
        ]
        nodes += [
            helper.make_node("MatMul", [x, f"W{i}"], [f"m{i}"]),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
        ]
        x = f"a{i}"
        if i < len(sizes) - 2:
            nodes.append(helper.make_node("Relu", [x], [f"r{i}"]))
            x = f"r{i}"
    nodes[-1].output[0] = "Y"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 100])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 1])],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def prepare(folder: Path) -> None:
    """Write each case's model and data into ``folder``."""
    rng = np.random.default_rng(0)
    onnx.save(mlp_model(rng), folder / "mlp.onnx")
    X = rng.standard_normal((CASES["mlp"]["rows"], 100)).astype(np.float32)
    y = (X @ rng.standard_normal((100, 1)) / 10).astype(np.float32)
    np.savez(folder / "mlp.npz", X=X, y=y)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from bench_train import export, text_data, transformer

    torch.manual_seed(0)
    X, y = text_data(rng, n=CASES["transformer"]["rows"])
    onnx.save(export(torch, transformer(torch), X[:2], dynamo=True), folder / "transformer.onnx")
    np.savez(folder / "transformer.npz", X=X, y=y)


def _step(case: str, split: bool, model):
    from onnxgrad.training import make_train_step
    from onnxgrad.training.step.learning_rate import LearningRateAdam, LearningRateSGDNesterov
    from onnxgrad.training.step.losses import select_learning_loss
    from onnxgrad.training.step.split_step import make_split_step

    build = make_split_step if split else make_train_step
    if case == "mlp":
        options = {
            "loss": select_learning_loss("squared_error"),
            "learning_rate": LearningRateSGDNesterov(),
        }
    else:
        options = {
            "loss": select_learning_loss("cross_entropy_logits"),
            "learning_rate": LearningRateAdam(),
        }
    return build(model, layout="flat", **options)


class _Clock:
    """Seconds spent in a wrapped callable."""

    def __init__(self, function):
        self.function, self.seconds = function, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.function(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def _setup(folder: Path, case: str, split: bool, all_reduce: _Clock) -> dict:
    """The runner of ``case`` (split or fused), its loader and its clocks."""
    import onnxruntime as ort

    from onnxgrad.training.running.data import OrtDataLoader
    from onnxgrad.training.running.devices import check_device
    from onnxgrad.training.running.distributed import DistributedRunner, world_size
    from onnxgrad.training.running.runner import TrainingRunner

    model = onnx.load(folder / f"{case}.onnx")
    data = np.load(folder / f"{case}.npz")
    step = _step(case, split, model)
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    weights = {w: weights[w] for w in step.weights}
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    runner_type = DistributedRunner if split else TrainingRunner
    runner = runner_type(step, check_device("cpu"), weights, None, options)
    ranks = world_size() if split else 1
    batch = CASES[case]["batch"] * ranks
    loader = OrtDataLoader(data["X"], data["y"], batch_size=batch, random_state=0)
    clocks = {"all-reduce": all_reduce} if split else {}
    if split:
        for name, session in (("gradient", runner.session), ("update", runner.update_session)):
            clocks[name] = _Clock(session.run_with_iobinding)
            session.run_with_iobinding = clocks[name]
    runner.run_epoch(loader, 1e-3)
    row = {"model": case, "ranks": ranks, "step": "split" if split else "fused"}
    row["batch_per_rank"] = CASES[case]["batch"]
    return {"runner": runner, "loader": loader, "clocks": clocks, "row": row, "best": np.inf}


def measure(setups: list[dict], epochs: int, repeat: int) -> list[dict]:
    """Time ``epochs`` epochs of every setup in turn, ``repeat`` times; keep each one's
    fastest run: rows/s of the job (wall clock), rows per CPU second of a rank, and the
    shares of a step's wall time."""
    for _ in range(repeat):
        for setup in setups:
            for clock in setup["clocks"].values():
                clock.seconds = 0.0
            runner, loader = setup["runner"], setup["loader"]
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(epochs):
                runner.run_epoch(loader, 1e-3)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
            if seconds < setup["best"]:
                setup["best"] = seconds
                rows = len(loader) * epochs
                setup["row"].update(
                    rows_per_s=rows / seconds,
                    rows_per_cpu_s=rows / setup["row"]["ranks"] / cpu,
                    **{f"{k}_share": c.seconds / seconds for k, c in setup["clocks"].items()},
                )
    return [setup["row"] for setup in setups]


def worker(folder: Path, epochs: int, repeat: int, single: bool) -> None:
    """One rank: every case, split step (and the fused step when ``single``, in turn)."""
    from datetime import timedelta

    import torch

    torch.set_num_threads(1)
    if single:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29517"))
        torch.distributed.init_process_group(
            "gloo", rank=0, world_size=1, timeout=timedelta(seconds=60)
        )
    all_reduce = _Clock(torch.distributed.all_reduce)
    torch.distributed.all_reduce = all_reduce
    rows = []
    for case in CASES:
        kinds = (False, True) if single else (True,)
        rows += measure([_setup(folder, case, k, all_reduce) for k in kinds], epochs, repeat)
    if torch.distributed.get_rank() == 0:
        (folder / f"results{torch.distributed.get_world_size()}.json").write_text(json.dumps(rows))


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="write the rows there")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(Path(args.worker), args.epochs, args.repeat, args.single)
        return []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="bench-distributed-") as tmp:
        folder = Path(tmp)
        prepare(folder)
        common = [__file__, "--worker", tmp, "--epochs", str(args.epochs)]
        common += ["--repeat", str(args.repeat)]
        subprocess.run([sys.executable, *common, "--single"], env=env, check=True)
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        subprocess.run([*launcher, "--nproc_per_node=2", *common], env=env, check=True)
        rows = json.loads((folder / "results1.json").read_text())
        rows += json.loads((folder / "results2.json").read_text())
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        "| model | step | ranks | rows/rank/batch | rows/s | rows/CPU s/rank | gradient "
        "| all-reduce | update |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        shares = [
            f"{100 * r[k]:.0f} %" if k in r else "-"
            for k in ("gradient_share", "all-reduce_share", "update_share")
        ]
        print(
            f"| {r['model']} | {r['step']} | {r['ranks']} | {r['batch_per_rank']} | "
            f"{r['rows_per_s']:,.0f} | {r['rows_per_cpu_s']:,.0f} | " + " | ".join(shares) + " |"
        )


if __name__ == "__main__":
    main()
