"""Reverse, forward and batched modes, side by side with onnx-ad where it is installed.

For each model (an MLP, torchvision's resnet18 written by hand, a 4-layer Llama fed
embeddings), differentiated with respect to its float input: the time to build the reverse
(``onnx_derivative``), forward (``onnx_jvp``), batched forward (``onnx_jvp(seeds=k)``) and
batched reverse (``onnx_derivative(seeds=k)``) graphs, their node counts, and the median
time of one run with onnxruntime on CPU, one thread. onnx-ad 0.3.0's ``reverse``/``forward``
(seed axis trailing, ``layout="onnx"``) are built and run in the same process, alternately,
and their results compared with ours.

    python benchmarks/bench_modes.py [--repeat 20] [--seeds 8] [--builds 5] [--only resnet18]
        [--json out.json]

Build time: the fastest of ``--builds`` rounds, each round building every graph of a model
once, both libraries in turn; wall-clock time, and the CPU time of the process (what a
machine shared with other jobs takes from it shows in the first, not in the second).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _zoo import resnet18

from onnxgrad import onnx_derivative, onnx_jvp

try:
    import onnx_ad
except ImportError:  # the peer is optional
    onnx_ad = None


def llama_embeddings(layers: int = 4):
    """LlamaForCausalLM (hidden 64, 4 heads, 2 key-value heads, eager attention) fed
    ``inputs_embeds``, so that its input is float."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False, attn_implementation="eager",
    )  # fmt: skip
    inner = LlamaForCausalLM(config)

    class Embedded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, embeddings):
            return self.inner(inputs_embeds=embeddings).logits

    return Embedded()


def mlp():
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 10), torch.nn.Softmax(-1)
    )


def export(module, example, dynamo: bool):
    """``module`` exported with static shapes (onnx-ad's reverse Conv needs them)."""
    import io
    import warnings

    import onnx
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            return torch.onnx.export(module.eval(), (example,), dynamo=True).model_proto
        buffer = io.BytesIO()
        torch.onnx.export(
            module.eval(), (example,), buffer, dynamo=False, opset_version=18,
            input_names=["x"], output_names=["y"],
        )  # fmt: skip
        return onnx.load_from_string(buffer.getvalue())


def models():
    """``[(name, model, input array)]``, exported by torch.onnx (TorchScript)."""
    import torch

    torch.manual_seed(0)
    specs = [
        ("mlp", mlp, torch.randn(4, 64)),
        ("resnet18", resnet18, torch.randn(1, 3, 64, 64)),
        ("llama-4-layers", llama_embeddings, torch.randn(1, 16, 64)),
    ]
    result = []
    for name, factory, example in specs:
        model = export(factory(), example, dynamo=name.startswith("llama"))
        result.append((name, model, example.numpy()))
    return result


def _named(model):
    """``model`` with a name for every unnamed node: onnxruntime names the nodes its fusions
    make after the nodes they replace and refuses two equal names (onnx-ad's Llama graphs
    fail to load otherwise); the computation is unchanged."""
    for index, node in enumerate(model.graph.node):
        node.name = node.name or f"unnamed_{index}"
    return model


def _session(model):
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return onnxruntime.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _timed_build(function):
    """``(graph, wall seconds, CPU seconds of this process)``: the CPU time leaves out the
    time other processes of a loaded machine take from this one."""
    start, start_cpu = time.perf_counter(), time.process_time()
    model = function()
    return model, time.perf_counter() - start, time.process_time() - start_cpu


def builders(model, seeds: int) -> dict:
    """``{(mode, library): () -> graph}`` for the modes both libraries build."""
    name = model.graph.input[0].name
    ours = {
        ("reverse", "onnxgrad"): lambda: onnx_derivative(model, weights=[], inputs=[name]),
        ("forward", "onnxgrad"): lambda: onnx_jvp(model, inputs=[name]),
        ("batched", "onnxgrad"): lambda: onnx_jvp(model, inputs=[name], seeds=seeds),
        ("batched reverse", "onnxgrad"): lambda: onnx_derivative(
            model, weights=[], inputs=[name], seeds=seeds
        ),
    }
    if onnx_ad is None:
        return ours
    return ours | {
        ("reverse", "onnx-ad"): lambda: onnx_ad.reverse(model, inputs=[name], layout="onnx"),
        ("forward", "onnx-ad"): lambda: onnx_ad.forward(model, inputs=[name], layout="onnx"),
        ("batched", "onnx-ad"): lambda: onnx_ad.forward(model, inputs=[name], layout="onnx"),
        ("batched reverse", "onnx-ad"): lambda: onnx_ad.reverse(
            model, inputs=[name], layout="onnx"
        ),
    }


def seed_array(mode: str, x, y, seeds: int, rng) -> np.ndarray:
    """Random seeds, seed axis leading: tangents shaped like ``x`` or output gradients like
    ``y``, one (no seed axis) or ``seeds`` of them."""
    shape = (y if mode.endswith("reverse") else x).shape
    if mode.startswith("batched"):
        shape = (seeds, *shape)
    return rng.standard_normal(shape).astype(np.float32)


def laid_out(seed: np.ndarray, library: str, mode: str) -> np.ndarray:
    """``seed`` as ``library`` takes it: onnx-ad's ``layout="onnx"`` has a trailing axis."""
    if library == "onnxgrad":
        return seed
    return np.moveaxis(seed, 0, -1) if mode.startswith("batched") else seed[..., None]


def derivative_result(session, feeds: dict, library: str, mode: str) -> np.ndarray:
    """The derivative output of one run (the last), seed axis leading as ``seed_array``."""
    value = session.run(None, feeds)[-1]
    if library == "onnx-ad":
        value = np.moveaxis(value, -1, 0)
        return value if mode.startswith("batched") else value[0]
    return value


def build_all(model, seeds: int, rounds: int) -> dict:
    """``{(mode, library): (graph, seconds, CPU seconds)}``: every graph built ``rounds``
    times, one of each in turn per round (the machine's load shared alike), the fastest
    build kept (wall and CPU time each)."""
    built = {}
    for _ in range(rounds):
        for key, build in builders(model, seeds).items():
            graph, seconds, cpu = _timed_build(build)
            _, best, best_cpu = built.get(key, (None, seconds, cpu))
            built[key] = (graph, min(seconds, best), min(cpu, best_cpu))
    return built


def compare(name: str, model, x: np.ndarray, seeds: int, repeat: int, rounds: int) -> list[dict]:
    """Rows of one model: every mode of both libraries, built, run alternately, checked."""
    x_name = model.graph.input[0].name
    y = _session(model).run(None, {x_name: x})[0]
    rng = np.random.default_rng(0)
    built = build_all(model, seeds, rounds)
    rows = []
    for mode in ("reverse", "forward", "batched", "batched reverse"):
        libraries = [lib for lib in ("onnxgrad", "onnx-ad") if (mode, lib) in built]
        entries = {lib: built[(mode, lib)] for lib in libraries}
        sessions = {lib: _session(_named(graph)) for lib, (graph, *_) in entries.items()}
        seed = seed_array(mode, x, y, seeds, rng)
        feeds = {}
        for lib, session in sessions.items():
            (seed_name,) = [i.name for i in session.get_inputs() if i.name != x_name]
            feeds[lib] = {x_name: x, seed_name: laid_out(seed, lib, mode)}
        times = {lib: [] for lib in sessions}
        for _ in range(repeat):
            for lib, session in sessions.items():
                start = time.perf_counter()
                session.run(None, feeds[lib])
                times[lib].append(time.perf_counter() - start)
        results = {lib: derivative_result(s, feeds[lib], lib, mode) for lib, s in sessions.items()}
        for lib, (graph, seconds, cpu) in entries.items():
            difference = np.abs(results[lib] - results["onnxgrad"]).max()
            scale = np.abs(results["onnxgrad"]).max() or 1.0
            rows.append(
                {"model": name, "mode": mode, "library": lib, "build_s": seconds,
                 "build_cpu_s": cpu,
                 "nodes": len(graph.graph.node), "run_ms": 1e3 * statistics.median(times[lib]),
                 "rel_diff": float(difference / scale)}
            )  # fmt: skip
    return rows


def print_table(rows: list[dict], seeds: int) -> None:
    print(
        "| model | mode | library | build (s) | build CPU (s) | nodes | run (ms) | max rel. diff. |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        mode = f"{r['mode']} ({seeds} seeds)" if r["mode"].startswith("batched") else r["mode"]
        print(
            f"| {r['model']} | {mode} | {r['library']} | {r['build_s']:.3f} | "
            f"{r['build_cpu_s']:.3f} | {r['nodes']} | "
            f"{r['run_ms']:.2f} | {r['rel_diff']:.1e} |"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--builds", type=int, default=5, help="builds per graph (the fastest)")
    parser.add_argument("--only", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = []
    for name, model, x in models():
        if args.only and name != args.only:
            continue
        rows += compare(name, model, x, args.seeds, args.repeat, args.builds)
    print_table(rows, args.seeds)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
