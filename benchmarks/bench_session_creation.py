"""Session creation time of the forward, gradient and train-step graphs against depth.

For each model and depth the parent builds (with onnxgrad) the loss model (``forward``), its
gradient (``gradient``, weights as inputs) and the fused Adam train step in both update layouts
(``step_flat``, ``step_per_weight``), then times ``onnxruntime.InferenceSession(...)`` on each
in a fresh process per measure (best of ``--repeat``, CPU seconds of the process, one thread),
for every interpreter of ``--python`` (each with its own onnxruntime; the child needs only
onnxruntime and onnxgrad's source) and every option set of ``--options``:

* ``onnxgrad``: :func:`onnxgrad.training.running.session_options.training_session_options`;
* ``ort``: onnxruntime's defaults;
* either followed by ``+name=value`` overrides of ``SessionOptions`` attributes
  (``graph_optimization_level=ORT_DISABLE_ALL``, ``enable_mem_reuse=0``), e.g.
  ``onnxgrad+enable_mem_reuse=1``, or ``+disabled_optimizers=Name:Name``: graph transformers
  the session skips (``InferenceSession(disabled_optimizers=...)``).

``--orders``: ``original`` times the graphs as built, ``ready`` with their nodes rearranged by
:func:`onnxgrad.training.step.node_order.put_in_ready_order` (fewer cells walked by onnxruntime
1.19's topological sorts).

Models: ``mlp`` (MatMul, Add, Relu per layer, hidden 128, written directly) and ``llama``
(the Llama-like LM of ``bench_memory.py`` at hidden 64, exported by PyTorch: slow, about 6 min
for 64 layers, so ``--folder`` keeps the built graphs for later runs).

    python benchmarks/bench_session_creation.py [--models mlp,llama] [--depths 8,16,32,64]
        [--graphs forward,gradient,step_flat,step_per_weight] [--options onnxgrad,ort]
        [--orders original,ready] [--python PATH ...] [--repeat 3] [--folder DIR]
        [--json out.json]
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GRAPHS = ("forward", "gradient", "step_flat", "step_per_weight")
LLAMA = {"batch": 4, "tokens": 32, "vocab": 256, "hidden": 64}


# -- building (parent) -------------------------------------------------------------------------
def mlp(depth: int, hidden: int = 128):
    """``y = relu(...relu(x W0 + B0)... W_{depth-1} + B_{depth-1})``, inputs ``x`` [N, hidden]."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, weights, x = [], [], "x"
    for i in range(depth):
        w = (rng.standard_normal((hidden, hidden)) * hidden**-0.5).astype(np.float32)
        weights += [numpy_helper.from_array(w, f"W{i}"), numpy_helper.from_array(0 * w[0], f"B{i}")]
        nodes += [
            helper.make_node("MatMul", [x, f"W{i}"], [f"m{i}"]),
            helper.make_node("Add", [f"m{i}", f"B{i}"], [f"a{i}"]),
            helper.make_node("Relu", [f"a{i}"], [f"h{i}"]),
        ]
        x = f"h{i}"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes,
        "mlp",
        [value("x", TensorProto.FLOAT, ["N", hidden])],
        [value("y", TensorProto.FLOAT, ["N", hidden])],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def llama(depth: int, folder: Path):
    """The Llama-like LM of ``bench_memory.py`` with ``depth`` layers and its loss."""
    import onnx

    sys.path.insert(0, str(HERE))
    from bench_memory import export_case

    export_case("llama", {**LLAMA, "layers": depth}, folder)
    return onnx.load(folder / "model.onnx")


def build(name: str, depth: int, folder: Path) -> dict[str, Path]:
    """``graph -> path`` of the four graphs of one model and depth (built once per folder)."""
    paths = {graph: folder / f"{name}-{depth}-{graph}.onnx" for graph in GRAPHS}
    if all(path.exists() for path in paths.values()):
        return paths
    import onnx

    from onnxgrad.training.step.composition import loss_gradient, make_loss_model, make_train_step
    from onnxgrad.training.step.learning_rate import LearningRateAdam
    from onnxgrad.training.step.losses import SquareLearningLoss

    if name == "mlp":
        model, loss = mlp(depth), SquareLearningLoss()
    else:
        work = folder / f"{name}-{depth}-export"
        work.mkdir(exist_ok=True)
        model, loss = llama(depth, work), None
    lm = make_loss_model(model, loss)
    onnx.save(lm.model, paths["forward"])
    onnx.save(loss_gradient(lm), paths["gradient"])
    for layout in ("flat", "per_weight"):
        step = make_train_step(model, loss=loss, learning_rate=LearningRateAdam(), layout=layout)
        onnx.save(step.model, paths[f"step_{layout}"])
    return paths


def reordered(path: Path, order: str) -> Path:
    """``path`` itself (``original``) or a copy in ready order (built once)."""
    if order == "original":
        return path
    if order != "ready":
        raise ValueError(f"unknown node order {order!r}: original or ready")
    ready = path.with_name(f"{path.stem}-ready.onnx")
    if not ready.exists():
        import onnx

        from onnxgrad.training.step.node_order import put_in_ready_order

        onnx.save(put_in_ready_order(onnx.load(path)), ready)
    return ready


# -- timing (child) ----------------------------------------------------------------------------
def session_options(spec: str):
    """``(SessionOptions, disabled optimizers)`` of an option set (``onnxgrad`` or ``ort``,
    then ``+name=value``)."""
    import onnxruntime as ort

    base, *overrides = spec.split("+")
    values, disabled = {}, []
    for item in overrides:
        key, value = item.split("=")
        if key == "disabled_optimizers":
            disabled += value.split(":")
        elif key == "graph_optimization_level":
            values[key] = getattr(ort.GraphOptimizationLevel, value)
        elif key == "execution_order":
            values[key] = getattr(ort.ExecutionOrder, value)
        else:
            values[key] = bool(int(value))
    if base == "onnxgrad":
        from onnxgrad.training.running.session_options import training_session_options

        options = training_session_options(1, **values)
    elif base == "ort":
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        for key, value in values.items():
            setattr(options, key, value)
    else:
        raise ValueError(f"unknown option set {spec!r}: onnxgrad or ort, then +name=value")
    options.inter_op_num_threads = 1
    return options, disabled


def child(path: str, spec: str) -> dict:
    import onnxruntime as ort

    options, disabled = session_options(spec)
    extra = {"disabled_optimizers": disabled} if disabled else {}
    data = Path(path).read_bytes()
    wall, cpu = time.perf_counter(), time.process_time()
    ort.InferenceSession(data, options, providers=["CPUExecutionProvider"], **extra)
    return {"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall}


def measure(python: str, path: Path, spec: str, repeat: int) -> float:
    """Best CPU seconds of ``repeat`` session creations, each in a fresh process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    best = float("inf")
    for _ in range(repeat):
        command = [python, __file__, "--child", str(path), spec]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        best = min(best, json.loads(done.stdout.strip().splitlines()[-1])["cpu"])
    return best


def ort_version(python: str) -> str:
    command = [python, "-c", "import onnxruntime; print(onnxruntime.__version__)"]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


# -- report ------------------------------------------------------------------------------------
def print_row(row: dict, depths: list[int]) -> None:
    times = [row["seconds"][str(d)] for d in depths]
    ratios = " ".join(f"x{b / a:.1f}" for a, b in itertools.pairwise(times))
    cells = " ".join(f"{1e3 * t:8.0f}" for t in times)
    print(
        f"ort {row['onnxruntime']:7s} {row['model']:5s} {row['graph']:15s}"
        f" {row.get('order', 'original'):8s} {row['options']:32s}"
        f" {cells} ms  per doubling {ratios}",
        flush=True,
    )


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,llama")
    parser.add_argument("--depths", default="8,16,32,64")
    parser.add_argument("--graphs", default=",".join(GRAPHS))
    parser.add_argument("--options", default="onnxgrad,ort")
    parser.add_argument("--orders", default="original,ready")
    parser.add_argument("--python", action="append", default=[])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--folder", default=None, help="keep the built graphs here")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "OPTIONS"))
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return []
    depths = [int(d) for d in args.depths.split(",")]
    pythons = args.python or [sys.executable]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-session-") as tmp:
        folder = Path(args.folder or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for name in args.models.split(","):
            paths = {d: build(name, d, folder) for d in depths}
            for python in pythons:
                version = ort_version(python)
                cases = itertools.product(
                    args.graphs.split(","), args.orders.split(","), args.options.split(",")
                )
                for graph, order, spec in cases:
                    files = {d: reordered(paths[d][graph], order) for d in depths}
                    seconds = {str(d): measure(python, files[d], spec, args.repeat) for d in depths}
                    row = {
                        "onnxruntime": version,
                        "model": name,
                        "graph": graph,
                        "order": order,
                        "options": spec,
                        "seconds": seconds,
                    }
                    rows.append(row)
                    print_row(row, depths)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
