"""Gradient graphs of real exported models: native (backend="onnx") against onnxruntime-training.

For resnet18, squeezenet1_1, a tiny BERT and a tiny Llama (see ``_zoo.py``), each exported by
the TorchScript and the dynamo exporters, and the MLP 784-512-512-10: node counts (forward,
native gradient, ORT gradient), time to build each gradient graph, to create its onnxruntime
session, and the median CPU time of one evaluation (one thread, both sessions side by side,
the calls alternated), native / ORT run time, and whether both gradients agree.
Then the 5,000-node chain: node count and session-creation time of its native gradient (with
and without onnxruntime's memory-reuse planner, whose cost grows faster than the node count).

    python benchmarks/bench_models.py [--repeat 20] [--only resnet18] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime
from onnx import ModelProto

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _zoo import benchmark_models
from bench_gradient import chain_model, mlp_model

from onnxgrad import DerivativeOptions, onnx_derivative
from onnxgrad._runtime import has_training_builder


def session(
    model: ModelProto, mem_reuse: bool = True
) -> tuple[onnxruntime.InferenceSession, float]:
    """A one-thread CPU session and the seconds it took to create."""
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.enable_mem_reuse = mem_reuse
    start = time.perf_counter()
    sess = onnxruntime.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return sess, time.perf_counter() - start


def gradient_feeds(grad: ModelProto, forward: ModelProto, feeds: dict, out_shape) -> dict:
    """The forward feeds, the weights' values and a fixed random output gradient."""
    from onnx import numpy_helper

    values = {i.name: numpy_helper.to_array(i) for i in forward.graph.initializer}
    rng = np.random.default_rng(1)
    result = {}
    for info in grad.graph.input:
        if info.name in feeds:
            result[info.name] = feeds[info.name]
        elif info.name in values:
            result[info.name] = values[info.name]
        else:
            result[info.name] = rng.standard_normal(out_shape).astype(np.float32)
    return result


def build(model: ModelProto, backend: str) -> tuple[ModelProto | Exception, float]:
    start = time.perf_counter()
    try:
        grad = onnx_derivative(model, inputs=[], options=DerivativeOptions.Zero, backend=backend)
    except Exception as exc:
        return exc, time.perf_counter() - start
    return grad, time.perf_counter() - start


def _timed(sess, feeds) -> float:
    """CPU seconds of one run: with one thread, what the run costs whatever else the
    machine does (wall-clock times on a shared machine wander several-fold)."""
    start = time.process_time()
    sess.run(None, feeds)
    return time.process_time() - start


def compare(name: str, forward: ModelProto, feeds: dict, repeat: int, ort_ok: bool) -> dict:
    """One row: both gradients built, run side by side (alternated calls), compared."""
    fsess, _ = session(forward)
    out_shape = fsess.run(None, feeds)[0].shape
    row = {"model": name, "forward_nodes": len(forward.graph.node)}
    grads, sessions = {}, {}
    for backend in ("onnx", "ort") if ort_ok else ("onnx",):
        grad, build_s = build(forward, backend)
        if isinstance(grad, Exception):
            row[f"{backend}_error"] = f"{type(grad).__name__}: {str(grad).splitlines()[0][:120]}"
            continue
        row[f"{backend}_nodes"] = len(grad.graph.node)
        row[f"{backend}_build_s"] = build_s
        try:
            sess, create_s = session(grad)
        except Exception as exc:
            row[f"{backend}_error"] = f"session: {str(exc).splitlines()[0][:120]}"
            continue
        row[f"{backend}_session_s"] = create_s
        grads[backend] = gradient_feeds(grad, forward, feeds, out_shape)
        sessions[backend] = sess
    times = {b: [] for b in sessions}
    outputs = {}
    for b, sess in sessions.items():
        names = [o.name for o in sess.get_outputs()]
        outputs[b] = dict(zip(names, sess.run(None, grads[b])))
        for _ in range(2):
            sess.run(None, grads[b])
    for _ in range(repeat):
        for b, sess in sessions.items():
            times[b].append(_timed(sess, grads[b]))
    for b, ts in times.items():
        row[f"{b}_run_ms"] = 1000 * statistics.median(ts)
        q1, q3 = np.percentile(ts, [25, 75])
        row[f"{b}_run_iqr"] = (q3 - q1) / statistics.median(ts)
    if len(outputs) == 2:
        row["ratio"] = row["onnx_run_ms"] / row["ort_run_ms"]
        row["max_rel_diff"], row["worst_output"] = _max_rel_diff(outputs["onnx"], outputs["ort"])
    return row


def _max_rel_diff(a: dict, b: dict) -> tuple[float, str]:
    """The largest ``max |a - b| / max |b|`` over the outputs both have, and its output."""
    worst, where = 0.0, ""
    for name, value in a.items():
        if name not in b:
            continue
        scale = max(float(np.abs(b[name]).max()), 1e-6)
        diff = float(np.abs(value - b[name]).max()) / scale
        if diff > worst:
            worst, where = diff, name
    return worst, where


def chain_row() -> dict:
    chain = chain_model()
    grad, build_s = build(chain, "onnx")
    _, create_s = session(grad)
    _, no_reuse_s = session(grad, mem_reuse=False)
    print(
        f"chain-5000: session creation {create_s:.1f} s, {no_reuse_s:.1f} s without "
        "onnxruntime's memory-reuse planner (enable_mem_reuse=False)"
    )
    return {
        "model": "chain-5000",
        "forward_nodes": len(chain.graph.node),
        "onnx_nodes": len(grad.graph.node),
        "onnx_build_s": build_s,
        "onnx_session_s": create_s,
        "onnx_session_no_mem_reuse_s": no_reuse_s,
    }


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'model':28s} {'fwd':>5s} {'native':>6s} {'ort':>5s} {'x fwd':>5s} {'build s':>7s} "
        f"{'sess s':>6s} {'ort sess':>8s} {'native ms':>9s} {'ort ms':>8s} {'ratio':>5s} "
        f"{'rel diff':>8s} {'iqr n/o':>9s}"
    )
    print(head)
    for r in rows:
        nodes = r.get("onnx_nodes")
        print(
            f"{r['model']:28s} {r['forward_nodes']:5d} {_fmt(nodes, '6d')} "
            f"{_fmt(r.get('ort_nodes'), '5d')} "
            f"{_fmt(nodes and nodes / r['forward_nodes'], '5.1f')} "
            f"{_fmt(r.get('onnx_build_s'), '7.2f')} {_fmt(r.get('onnx_session_s'), '6.2f')} "
            f"{_fmt(r.get('ort_session_s'), '8.2f')} {_fmt(r.get('onnx_run_ms'), '9.2f')} "
            f"{_fmt(r.get('ort_run_ms'), '8.2f')} {_fmt(r.get('ratio'), '5.2f')} "
            f"{_fmt(r.get('max_rel_diff'), '8.1e')} "
            f"{_fmt(r.get('onnx_run_iqr'), '4.0%')}/{_fmt(r.get('ort_run_iqr'), '<4.0%')}"
        )
        if r.get("max_rel_diff", 0) > 1e-3:
            print(f"    the gradients differ most on {r['worst_output']}")
        for key in ("onnx_error", "ort_error"):
            if key in r:
                print(f"    {key}: {r[key]}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--only", help="run only the models whose name contains this")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--no-chain", action="store_true")
    args = parser.parse_args(argv)
    ort_ok = has_training_builder()
    rows = []
    rng = np.random.default_rng(0)
    models = [("mlp 784-512-512-10 b64", "", mlp_model(), {"X": rng.standard_normal((64, 784))})]
    try:
        models += benchmark_models()
    except ImportError as exc:
        print(f"skipping the exported models: {exc}")
    for name, exporter, model, feeds in models:
        label = f"{name} {exporter}".strip()
        if args.only and args.only not in label:
            continue
        if feeds is None:
            print(f"{label}: export failed: {str(model).splitlines()[0][:100]}")
            continue
        feeds = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in feeds.items()}
        rows.append(compare(label, model, feeds, args.repeat, ort_ok))
        print_table(rows[-1:])
    if not args.no_chain and not args.only:
        rows.append(chain_row())
    print()
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
