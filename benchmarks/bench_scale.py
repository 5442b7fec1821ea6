"""Scale: derivatives of models with 1 GiB and 2.25 GiB of weights, a 4 GiB model end to end,
a 5,000-node graph and deep graphs.

For each big model (a chain of 4096x4096 float32 MatMuls: 16 of them weigh 1 GiB, 36 weigh
2.25 GiB, past protobuf's 2 GiB limit, so stored with external data), two measures, each in
a child process whose peak resident memory the parent reads from ``wait4``'s rusage:

* ``api``: ``onnx.load`` then ``onnx_derivative(model)``; the time is the derivative's, the
  peak includes the loaded model; ``step`` and ``artifacts`` the same for
  ``make_train_step(model)`` and ``generate_artifacts(model)`` (Adam: its state is written
  into the checkpoint), with the GiB that passed through the entry's ``write`` and ``read``
  calls (``/proc/self/io``);
* ``cli``: ``onnxgrad derivative model.onnx -o grad.onnx`` end to end (read, check, derive,
  write).

``4gib`` (64 MatMuls saved with external data) goes end to end from its path, each stage in
its own child: ``derivative`` (``onnx_derivative(path)``), ``artifacts``
(``generate_artifacts(path)``, Adam), ``cli-artifacts`` (``onnxgrad artifacts --optimizer
sgd``), ``train`` (three steps of the SGD artifacts' train step through the
:class:`~onnxgrad.training.running.runner.TrainingRunner`, the trained weights saved as a
checkpoint), ``merge`` (``merge_checkpoint`` of that folder and checkpoint, saved with
external data) and ``check`` (onnxruntime runs the merged file; its output against numpy's
product of the trained weights). ``e2e-test`` runs the same stages on 4 such MatMuls.

For the 5,000-node chain (Add, Mul, Tanh): the native gradient graph's node count against
the forward graph's, onnxruntime's session-creation time and the median run time.

Deep graphs (``deep``): chains of ``--deep-sizes`` nodes (Add, Mul, Tanh with 8-float
weights, and an MLP of 16-wide MatMul, Add, Tanh layers), each in a child that
``onnx.load``s the file: one row per normalisation pass (the private copy, then each pass of
:data:`onnxgrad.normalize.pipeline.PASSES`), then the derivative built from the normalised
model, then ``onnx_derivative`` as a whole in a fresh child; each row gives the step's time,
its time per node and the process's peak RSS after it, the loaded model included, and the
peak over the loaded model per node.

    python benchmarks/bench_scale.py [--only 1gib,2gib,4gib,chain,deep] [--workdir DIR]
        [--json FILE]

The models (3.3 GB, 4 GiB more and its artifacts for ``4gib``) are written into ``--workdir``
and kept there, or into a temporary folder removed at the end.
Children that pass ``--max-rss-gib`` (default 16) are stopped and reported as such.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from bench_gradient import chain_model  # the same 5,000-node chain

ROOT = Path(__file__).resolve().parents[1]
SIDE = 4096
GIB = 1 << 30
BIG_MODELS = {"1gib": 16, "2gib": 36}
#: Models taken end to end from their path (external data), by name: their MatMul count.
END_TO_END = {"4gib": 64, "e2e-test": 4}
E2E_STAGES = ("derivative", "artifacts", "cli-artifacts", "train", "merge", "check")
E2E_BATCH, E2E_STEPS = 8, 3


def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


# ----------------------------------------------------------------------------- models


def write_matmul_chain(path: Path, count: int, external: bool) -> None:
    """``Y = X @ W0 @ ... @ W{count-1}``, ``X: [N, 4096]``; weights inline or in
    ``<path>.data`` (written straight from numpy, never held all at once)."""
    from onnx import TensorProto, helper, save_model

    rng = np.random.default_rng(0)
    data_path = path.with_name(path.name + ".data")
    nodes, inits, prev = [], [], "X"
    with open(data_path, "wb") if external else open(os.devnull, "wb") as data:
        for i in range(count):
            # one weight in memory at a time: the data file is written in pieces
            w = (rng.standard_normal((SIDE, SIDE), dtype=np.float32) / SIDE**0.5).tobytes()
            tensor = TensorProto(name=f"W{i}", data_type=TensorProto.FLOAT, dims=[SIDE, SIDE])
            if external:
                offset = data.tell()
                data.write(w)
                tensor.data_location = TensorProto.EXTERNAL
                for key, value in (("location", data_path.name), ("offset", offset)):
                    tensor.external_data.add(key=key, value=str(value))
                tensor.external_data.add(key="length", value=str(len(w)))
            else:
                tensor.raw_data = w
            inits.append(tensor)
            nodes.append(helper.make_node("MatMul", [prev, f"W{i}"], [f"Y{i}"], name=f"mm{i}"))
            prev = f"Y{i}"
    nodes.append(helper.make_node("Identity", [prev], ["Y"], name="out"))
    graph = helper.make_graph(
        nodes,
        "matmul_chain",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", SIDE])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", SIDE])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    save_model(model, path)


def child_api(model_path: str, entry: str) -> dict:
    """``onnx.load`` then ``entry`` of the loaded model: ``derivative`` (onnx_derivative),
    ``step`` (make_train_step) or ``artifacts`` (generate_artifacts, Adam, into a
    temporary folder); the time is the entry's, the peak includes the loaded model."""
    import onnx

    from onnxgrad import onnx_derivative
    from onnxgrad.training import generate_artifacts, make_train_step

    model = onnx.load(model_path)
    io_before = _io_counts()
    start = time.perf_counter()
    if entry == "derivative":
        nodes = len(onnx_derivative(model).graph.node)
    elif entry == "step":
        nodes = len(make_train_step(model).model.graph.node)
    else:
        with tempfile.TemporaryDirectory(prefix="onnxgrad-artifacts-") as folder:
            nodes = len(
                generate_artifacts(model, artifact_directory=folder).train_step.model.graph.node
            )
    seconds = time.perf_counter() - start
    moved = {f"{k}_gib": (v - io_before[k]) / GIB for k, v in _io_counts().items()}
    return {"derivative_s": seconds, "gradient_nodes": nodes, **moved}


def _io_counts() -> dict:
    """``{"written", "read"}`` so far: the bytes through the process's ``write`` and ``read``
    calls (``/proc/self/io``'s ``wchar`` and ``rchar``; empty where there is none)."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return {}
    counts = dict(line.split(": ") for line in text.splitlines())
    return {"written": int(counts["wchar"]), "read": int(counts["rchar"])}


def child_e2e(stage: str, workdir: str) -> dict:
    """One stage of the end-to-end run on ``workdir/model.onnx`` (module docstring); the
    time is the stage's, the model is read from its path inside it."""
    folder = Path(workdir)
    model_path = folder / "model.onnx"
    start = time.perf_counter()
    if stage == "derivative":
        from onnxgrad import onnx_derivative

        result = {"gradient_nodes": len(onnx_derivative(str(model_path)).graph.node)}
    elif stage == "artifacts":
        from onnxgrad.training import generate_artifacts

        art = generate_artifacts(str(model_path), artifact_directory=folder / "adam")
        result = {"gradient_nodes": len(art.train_step.model.graph.node)}
        del art
        shutil.rmtree(folder / "adam")  # disk: the next stages use the SGD artifacts
    elif stage == "train":
        result = _train_stage(folder)
    elif stage == "merge":
        from onnxgrad._files import save_model
        from onnxgrad.training import merge_checkpoint

        merged = merge_checkpoint(folder / "sgd", folder / "trained.json")
        save_model(merged, folder / "merged.onnx")
        result = {}
    else:
        result = _check_stage(folder)
    return {"derivative_s": time.perf_counter() - start, **result}


def _e2e_data(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    X = rng.standard_normal((E2E_BATCH, SIDE), dtype=np.float32)
    return X, rng.standard_normal((E2E_BATCH, SIDE), dtype=np.float32)


def _train_stage(folder: Path) -> dict:
    """``E2E_STEPS`` steps of the SGD artifacts' train step (one batch each), the trained
    weights saved as ``trained.json``."""
    from onnxgrad.training import load_train_step
    from onnxgrad.training.artifacts.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
    from onnxgrad.training.running.data import OrtDataLoader
    from onnxgrad.training.running.devices import parse_device
    from onnxgrad.training.running.runner import TrainingRunner

    step = load_train_step(folder / "sgd")
    initial = load_checkpoint(folder / "sgd" / "checkpoint.json", mapped=True)
    runner = TrainingRunner(step, parse_device("cpu"), initial.weights, initial.optimizer_state)
    del initial
    loader = OrtDataLoader(*_e2e_data(folder), batch_size=E2E_BATCH)
    losses = [float(runner.run_epoch(loader, 1e-6)[0]) for _ in range(E2E_STEPS)]
    save_checkpoint(Checkpoint(weights=runner.get_weights()), folder / "trained.json")
    return {"losses": losses}


def _check_stage(folder: Path) -> dict:
    """onnxruntime runs ``merged.onnx`` (no pre-packed copy of its weights); the largest
    relative difference from numpy's ``X @ W0 @ W1 ...`` with the trained weights."""
    import onnxruntime

    from onnxgrad.training.artifacts.checkpoint import load_checkpoint

    X, _ = _e2e_data(folder)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.disable_prepacking", "1")
    session = onnxruntime.InferenceSession(
        str(folder / "merged.onnx"), options, providers=["CPUExecutionProvider"]
    )
    (got,) = session.run(None, {"X": X})
    del session
    weights = load_checkpoint(folder / "trained.json", mapped=True).weights
    expected = X.astype(np.float64)
    for i in range(len(weights)):
        expected = expected @ weights[f"W{i}"]
    error = float(np.max(np.abs(got - expected)) / np.max(np.abs(expected)))
    return {"max_relative_error": error}


def measure_end_to_end(name: str, workdir: Path, max_rss_gib: float) -> list[dict]:
    """The stages of the end-to-end run, each in a child; its files removed after."""
    count = END_TO_END[name]
    folder = workdir / f"e2e_{count}"
    folder.mkdir(exist_ok=True)
    model_path = folder / "model.onnx"
    size_gib = _written_model(model_path, count, external=True)
    rows = []
    for stage in E2E_STAGES:
        if stage == "cli-artifacts":
            command = [sys.executable, "-m", "onnxgrad", "artifacts", str(model_path)]
            command += ["-o", str(folder / "sgd"), "--optimizer", "sgd"]
        else:
            command = [sys.executable, __file__, "--child-e2e", stage, "--workdir", str(folder)]
        result = run_child(command, max_rss_gib)
        result.setdefault("derivative_s", result["wall_s"])
        label = f"{count} MatMuls ({size_gib:g} GiB, external)"
        rows.append({"model": label, "mode": stage, **result})
        rows[-1]["peak_over_model"] = result["peak_rss_gib"] / size_gib
        if "error" in result:
            break
    shutil.rmtree(folder)
    return rows


def child_chain(repeat: int) -> dict:
    import onnxruntime

    from onnxgrad import DerivativeOptions, onnx_derivative

    forward = chain_model()
    start = time.perf_counter()
    grad = onnx_derivative(forward, options=DerivativeOptions.FillGrad)
    derivative_s = time.perf_counter() - start
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    start = time.perf_counter()
    session = onnxruntime.InferenceSession(
        grad.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    session_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    feeds = {}
    for info in session.get_inputs():
        shape = [d if isinstance(d, int) else 16 for d in info.shape]
        feeds[info.name] = rng.standard_normal(shape).astype(np.float32)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return {
        "forward_nodes": len(forward.graph.node),
        "gradient_nodes": len(grad.graph.node),
        "derivative_s": derivative_s,
        "session_s": session_s,
        "run_ms": 1000 * statistics.median(times),
    }


def write_deep_model(path: Path, kind: str, nodes: int) -> None:
    """``chain``: Add, Mul, Tanh with a weight of 8 floats per Add and Mul; ``mlp``: layers
    of MatMul (16x16), Add (bias), Tanh; about ``nodes`` nodes either way."""
    from onnx import TensorProto, helper, numpy_helper, save_model

    if kind == "chain":
        save_model(chain_model(nodes), path)
        return
    width, graph_nodes, inits, prev = 16, [], [], "X"
    for i in range(nodes // 3):
        inits.append(numpy_helper.from_array(np.full((width, width), 0.1, np.float32), f"W{i}"))
        inits.append(numpy_helper.from_array(np.zeros(width, np.float32), f"b{i}"))
        graph_nodes += [
            helper.make_node("MatMul", [prev, f"W{i}"], [f"m{i}"], name=f"mm{i}"),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"], name=f"add{i}"),
            helper.make_node("Tanh", [f"a{i}"], [f"t{i}"], name=f"tanh{i}"),
        ]
        prev = f"t{i}"
    graph = helper.make_graph(
        graph_nodes,
        "mlp",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, ["N", width])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    save_model(model, path)


def child_deep(model_path: str, whole: bool) -> dict:
    """``onnx.load``, then each normalisation pass and the derivative timed one by one
    (``whole``: ``onnx_derivative`` in one call); each step's seconds and the process peak
    after it."""
    import resource

    import onnx

    from onnxgrad import onnx_derivative
    from onnxgrad._onnx_utils import load_model
    from onnxgrad.derivative.api import derive_in_place
    from onnxgrad.normalize.pipeline import PASSES

    def peak_gib() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB

    model = onnx.load(model_path)
    steps = [("loaded", 0.0, peak_gib())]
    if whole:
        start = time.perf_counter()
        onnx_derivative(model)
        steps.append(("onnx_derivative", time.perf_counter() - start, peak_gib()))
        return {"nodes": len(model.graph.node), "steps": steps}
    timed = [("copy", load_model)] + [(step.name, step.run) for step in PASSES]
    timed.append(("derivative", derive_in_place))
    current = model
    for name, run in timed:
        start = time.perf_counter()
        current = run(current)
        steps.append((name, time.perf_counter() - start, peak_gib()))
    return {"nodes": len(model.graph.node), "steps": steps}


def measure_deep(
    kinds: list[str], sizes: list[int], modes: list[str], workdir: Path, max_rss_gib: float
):
    """One row per step of :func:`child_deep` for each model kind, size and mode (``steps``:
    pass by pass, ``whole``: ``onnx_derivative``), yielded as each child ends."""
    for kind in kinds:
        for size in sizes:
            path = workdir / f"deep_{kind}_{size}.onnx"
            if not path.exists():
                writer = multiprocessing.get_context("spawn").Process(
                    target=write_deep_model, args=(path, kind, size)
                )
                writer.start()
                writer.join()
            for mode in modes:
                command = [sys.executable, __file__, "--child-deep", str(path)]
                result = run_child(command + (["--whole"] if mode == "whole" else []), max_rss_gib)
                yield from _deep_rows(f"{kind}-{size}", result)


def _deep_rows(model: str, result: dict) -> list[dict]:
    if "steps" not in result:
        return [{"model": model, "step": "FAILED", "error": result.get("error", "?")}]
    nodes, steps = result["nodes"], result["steps"]
    loaded = steps[0][2]
    return [
        {
            "model": model,
            "step": name,
            "seconds": seconds,
            "ms_per_node": 1000 * seconds / nodes,
            "peak_rss_gib": peak,
            "kb_per_node_over_loaded": (peak - loaded) * GIB / 1024 / nodes,
        }
        for name, seconds, peak in steps
    ]


def run_child(command: list[str], max_rss_gib: float) -> dict:
    """Run ``command``; its wall time, peak RSS (GiB), exit status, last stdout line and
    stderr tail. A child whose RSS passes ``max_rss_gib`` is killed."""
    start = time.perf_counter()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_child_env(), text=True
    )
    killed = threading.Event()
    threading.Thread(
        target=_watch_rss, args=(process.pid, max_rss_gib, killed), daemon=True
    ).start()
    outputs = {}
    readers = [
        threading.Thread(target=lambda s=s: outputs.__setitem__(s, getattr(process, s).read()))
        for s in ("stdout", "stderr")
    ]
    for reader in readers:
        reader.start()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    for reader in readers:
        reader.join()
    result = {
        "wall_s": time.perf_counter() - start,
        "peak_rss_gib": usage.ru_maxrss * 1024 / GIB,
        "status": process.returncode,
    }
    if killed.is_set():
        result["error"] = f"stopped: resident memory passed {max_rss_gib:g} GiB"
    elif process.returncode != 0:
        tail = [line for line in outputs["stderr"].splitlines() if line.strip()]
        result["error"] = " | ".join(tail[-2:])[:300]
    lines = outputs["stdout"].strip().splitlines()
    if lines and lines[-1].startswith("{"):
        result.update(json.loads(lines[-1]))
    return result


def _watch_rss(pid: int, limit_gib: float, killed: threading.Event) -> None:
    status = Path(f"/proc/{pid}/status")
    while True:
        try:
            text = status.read_text()
        except OSError:
            return
        rss = next((ln for ln in text.splitlines() if ln.startswith("VmRSS:")), None)
        if rss and int(rss.split()[1]) * 1024 > limit_gib * GIB:
            killed.set()
            os.kill(pid, 9)
            return
        time.sleep(0.05)


# ----------------------------------------------------------------------------- main


def _written_model(model_path: Path, count: int, external: bool) -> float:
    """Write the chain of ``count`` MatMuls at ``model_path`` unless it is there; its GiB.
    Written in a child: a child's ru_maxrss starts from its parent's peak at fork, so a
    parent that built the model would report its own 2-3x the model for every measure."""
    if not model_path.exists():
        writer = multiprocessing.get_context("spawn").Process(
            target=write_matmul_chain, args=(model_path, count, external)
        )
        writer.start()
        writer.join()
    return count * SIDE * SIDE * 4 / GIB


def measure_big(name: str, workdir: Path, max_rss_gib: float) -> list[dict]:
    count = BIG_MODELS[name]
    external = count * SIDE * SIDE * 4 >= 2 * GIB
    model_path = workdir / f"matmul_{count}.onnx"
    size_gib = _written_model(model_path, count, external)
    rows = []
    for mode in ("api", "step", "artifacts", "cli"):
        if mode != "cli":
            entry = "derivative" if mode == "api" else mode
            command = [sys.executable, __file__, "--child-api", str(model_path), "--entry", entry]
        else:
            output = workdir / f"grad_{count}.onnx"
            command = [sys.executable, "-m", "onnxgrad", "derivative", str(model_path)]
            command += ["-o", str(output)]
        result = run_child(command, max_rss_gib)
        if mode == "cli" or "derivative_s" not in result:
            result["derivative_s"] = result["wall_s"]
        rows.append({"model": f"{count} MatMuls ({size_gib:g} GiB)", "mode": mode, **result})
        rows[-1]["peak_over_model"] = result["peak_rss_gib"] / size_gib
    for stale in workdir.glob("grad_*"):
        stale.unlink()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="1gib,2gib,chain,deep")
    parser.add_argument("--workdir", help="where the big models are written (kept)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of the chain's gradient")
    parser.add_argument("--max-rss-gib", type=float, default=16.0)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child-api", help=argparse.SUPPRESS)
    parser.add_argument("--entry", default="derivative", help=argparse.SUPPRESS)
    parser.add_argument("--child-chain", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-e2e", help=argparse.SUPPRESS)
    parser.add_argument(
        "--deep-sizes", default="10000,50000,200000", help="node counts of the deep graphs"
    )
    parser.add_argument("--deep-kinds", default="chain,mlp", help="deep graphs: chain, mlp")
    parser.add_argument("--deep-modes", default="steps,whole", help="deep graphs: steps, whole")
    parser.add_argument("--child-deep", help=argparse.SUPPRESS)
    parser.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_e2e:
        print(json.dumps(child_e2e(args.child_e2e, args.workdir)))
        return
    if args.child_deep:
        print(json.dumps(child_deep(args.child_deep, args.whole)))
        return
    if args.child_api:
        print(json.dumps(child_api(args.child_api, args.entry)))
        return
    if args.child_chain:
        print(json.dumps(child_chain(args.repeat)))
        return
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        rows = run(args, Path(args.workdir))
    else:
        with tempfile.TemporaryDirectory(prefix="onnxgrad-bench-scale-") as workdir:
            rows = run(args, Path(workdir))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


def run(args: argparse.Namespace, workdir: Path) -> list[dict]:
    """Measure what ``--only`` names, printing one line per measure."""
    wanted = args.only.split(",")
    rows = []
    measures = [(name, measure_big) for name in BIG_MODELS]
    measures += [(name, measure_end_to_end) for name in END_TO_END]
    for name, measure in measures:
        if name in wanted:
            for row in measure(name, workdir, args.max_rss_gib):
                rows.append(row)
                extra = {
                    k: round(row[k], 3) if k.endswith("_gib") else row[k]
                    for k in ("written_gib", "read_gib", "losses", "max_relative_error")
                    if k in row
                }
                print(
                    f"{row['model']:24s} {row['mode']:13s} time {row['derivative_s']:7.2f} s"
                    f"  peak RSS {row['peak_rss_gib']:6.2f} GiB"
                    f" ({row['peak_over_model']:.2f}x the model)"
                    + (f"  {extra}" if extra else "")
                    + (f"  FAILED: {row['error']}" if "error" in row else ""),
                    flush=True,
                )
    if "deep" in wanted:
        sizes = [int(size) for size in args.deep_sizes.split(",")]
        kinds = args.deep_kinds.split(",")
        modes = args.deep_modes.split(",")
        for row in measure_deep(kinds, sizes, modes, workdir, args.max_rss_gib):
            rows.append(row)
            if "error" in row:
                print(f"{row['model']:13s} FAILED: {row['error']}", flush=True)
                continue
            print(
                f"{row['model']:13s} {row['step']:18s} {row['seconds']:8.2f} s "
                f"{row['ms_per_node']:6.3f} ms/node  peak RSS {row['peak_rss_gib']:5.2f} GiB "
                f"({row['kb_per_node_over_loaded']:5.1f} KB/node over the loaded model)",
                flush=True,
            )
    if "chain" in wanted:
        command = [sys.executable, __file__, "--child-chain", "--repeat", str(args.repeat)]
        row = {"model": "chain-5000", **run_child(command, args.max_rss_gib)}
        rows.append(row)
        if "error" in row:
            print(f"chain-5000 FAILED: {row['error']}")
        else:
            print(
                f"chain-5000: forward {row['forward_nodes']} nodes, gradient "
                f"{row['gradient_nodes']} nodes ({row['gradient_nodes'] / row['forward_nodes']:.2f}"
                f"x), derivative {row['derivative_s']:.2f} s, session creation "
                f"{row['session_s']:.2f} s, run {row['run_ms']:.2f} ms (median of {args.repeat})"
            )
    return rows


if __name__ == "__main__":
    main()
