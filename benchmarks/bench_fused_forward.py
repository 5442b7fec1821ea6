"""Does a fused forward pay? onnxruntime's fused transformer kernels (the ``optimize_model``
opt_level 2 form) against the standard-ONNX lowering that onnxgrad trains through.

For a tiny BERT classifier and a tiny Llama-like LM (``tests/normalize/deployed.py``; random
weights) at two sizes, one onnxruntime thread, default graph optimisations (onnxruntime may
fuse the lowered graph again):

- forward time of the fused file and of its lowering (``normalized_model``);
- per fused operator kind, the forward time with only that kind lowered, as a difference
  from the fused file;
- the LoRA train step (``add_lora``, ``generate_artifacts``, Adam), whose forward is the
  lowering: how much of a step keeping the fused forward could save at most.

    python benchmarks/bench_fused_forward.py [--runs 30] [--sizes tiny,big]

Sessions are timed in turn (round robin, median of ``--runs``) in CPU time of the process,
so a load on the shared machine touches them alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: name -> (hidden size, sequence length, batch)
SIZES = {"tiny": (32, 5, 2), "big": (256, 128, 2)}


def _lowerings() -> dict:
    from onnxgrad.normalize.contrib import CONTRIB_LOWERINGS
    from onnxgrad.normalize.quantized import QUANTIZED_LOWERINGS

    return {**CONTRIB_LOWERINGS, **QUANTIZED_LOWERINGS}


LOWERINGS = _lowerings()


def _session(model: onnx.ModelProto | str):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    source = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(source, options, ["CPUExecutionProvider"])


def _medians(calls: dict[str, object], runs: int) -> dict[str, float]:
    """``{name: median seconds}`` of the zero-argument ``calls``, timed in turn, in CPU time
    of this process (one thread: what other jobs on the machine take is not counted)."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(runs):
        for name, call in calls.items():
            start = time.process_time()
            call()
            times[name].append(time.process_time() - start)
    return {name: float(np.median(values)) for name, values in times.items()}


def _forward(model: onnx.ModelProto, feeds: dict):
    session = _session(model)
    declared = {i.name for i in session.get_inputs()}
    chosen = {k: v for k, v in feeds.items() if k in declared}
    return lambda: session.run(None, chosen)


def _fused_kinds(model: onnx.ModelProto) -> list[tuple[str, str]]:
    found = {(n.domain, n.op_type) for n in model.graph.node}
    return sorted(found & set(LOWERINGS))


def _typed(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the element type of each fused operator's outputs declared (that of
    its first input; onnx's inference does not know these operators), so that one kind
    lowers alone with the others kept."""
    typed = onnx.shape_inference.infer_shapes(model)
    known = {v.name: v.type.tensor_type.elem_type for v in typed.graph.value_info}
    known.update({v.name: v.type.tensor_type.elem_type for v in typed.graph.input})
    for node in typed.graph.node:
        if (node.domain, node.op_type) in LOWERINGS and node.input[0] in known:
            for out in node.output:
                if out and out not in known:
                    known[out] = known[node.input[0]]
                    typed.graph.value_info.append(
                        onnx.helper.make_tensor_value_info(out, known[out], None)
                    )
    return onnx.shape_inference.infer_shapes(typed)


def _train_step(fused: onnx.ModelProto, feeds: dict, folder: Path):
    from onnxgrad import add_lora
    from onnxgrad.training import generate_artifacts, load_train_step

    art = generate_artifacts(add_lora(fused, rank=4), optimizer="adam", artifact_directory=folder)
    step = load_train_step(folder)
    session = _session(str(art.path("training_model.onnx")))
    declared = {i.name for i in session.get_inputs()}
    label = _forward(fused, feeds)()[0]
    batch = {
        **feeds,
        "label": label,
        "learning_rate": np.array(1e-3, np.float32),
        **art.checkpoint.weights,
        **art.checkpoint.optimizer_state,
    }
    chosen = {k: v for k, v in batch.items() if k in declared}
    names = [step.loss, *step.new_weights, *step.new_state]
    return lambda: session.run(names, chosen)


def deployed_form(kind: str, size: str, folder: Path) -> tuple[onnx.ModelProto, dict]:
    """The ``optimize_model`` opt_level 2 file of the tiny BERT or Llama and its feeds."""
    from tests.normalize import deployed

    deployed.HIDDEN, deployed.SEQ, deployed.BATCH = SIZES[size]
    source = folder / f"{kind}_{size}.onnx"
    getattr(deployed, f"export_{kind}")(source)
    fused = onnx.load(deployed.make_form(source, "opt2", f"{kind}_{size}", folder))
    return fused, deployed.feeds(kind)


def builder_form(precision: str, size: str, folder: Path) -> tuple[onnx.ModelProto, dict]:
    """onnxruntime-genai's builder output (fp32 or int4) of a random Llama-like checkpoint
    and the feeds of a first prompt (empty key-value caches)."""
    from tests.normalize.genai_builder import KV_HEADS, VOCAB, build, save_tiny_llama

    hidden, seq, batch = SIZES[size]
    hidden = max(hidden, 64)  # heads of 16 features, more heads than the 2 key-value ones
    heads = hidden // 16
    source = folder / f"hf_{size}"
    if not source.exists():
        save_tiny_llama(source, hidden=hidden, heads=heads)
    out = build(source, folder / f"genai_{precision}_{size}", precision)
    rng = np.random.default_rng(0)
    feeds = {
        "input_ids": rng.integers(0, VOCAB, (batch, seq)).astype(np.int64),
        "attention_mask": np.ones((batch, seq), np.int64),
    }
    for i in range(2):
        for part in ("key", "value"):
            feeds[f"past_key_values.{i}.{part}"] = np.zeros((batch, KV_HEADS, 0, 16), np.float32)
    return onnx.load(out / "model.onnx"), feeds


def measure(fused: onnx.ModelProto, feeds: dict, runs: int, folder: Path) -> dict:
    from onnxgrad.normalize import normalized_model
    from onnxgrad.normalize.lowering import lower_nodes

    calls = {"fused": _forward(fused, feeds), "lowered": _forward(normalized_model(fused), feeds)}
    kinds = _fused_kinds(fused)
    typed = _typed(fused)
    for key in kinds:
        calls[key[1]] = _forward(lower_nodes(typed, {key: LOWERINGS[key]}), feeds)
    calls["train step"] = _train_step(fused, feeds, folder)
    medians = _medians(calls, runs)
    return {"kinds": [k[1] for k in kinds], **medians}


def _report(model: str, size: str, row: dict) -> str:
    ms = {k: 1e3 * v for k, v in row.items() if isinstance(v, float)}
    fused, lowered, step = ms["fused"], ms["lowered"], ms["train step"]
    parts = ", ".join(f"{k} {ms[k] - fused:+.3f}" for k in row["kinds"])
    hidden, seq, batch = SIZES[size]
    if model.startswith("genai"):
        hidden = max(hidden, 64)
    return (
        f"| {model} | {hidden} x {seq} x {batch} | {fused:.3f} | {lowered:.3f} | "
        f"{lowered / fused:.2f} | {parts} | {step:.2f} | "
        f"{100 * (lowered - fused) / step:.1f} % |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--sizes", default="tiny,big")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    import onnxruntime

    print(f"onnxruntime {onnxruntime.__version__}, one thread, times in ms (median)")
    print(
        "| model | hidden x seq x batch | fused forward | lowered forward | ratio | "
        "per kind lowered alone (difference) | LoRA train step | (lowered - fused) / step |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    cases = [(f"{k} opt_level 2", deployed_form, k) for k in ("bert", "llama")]
    if importlib.util.find_spec("onnxruntime_genai"):
        cases += [(f"genai builder {p}", builder_form, p) for p in ("fp32", "int4")]
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            for i, (name, make, which) in enumerate(cases):
                folder = Path(tmp) / f"{size}_{i}"
                folder.mkdir()
                fused, feeds = make(which, size, folder)
                row = measure(fused, feeds, args.runs, folder / "artifacts")
                print(_report(name, size, row), flush=True)


if __name__ == "__main__":
    main()
