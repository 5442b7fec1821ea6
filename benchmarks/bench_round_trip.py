"""What comes back from LoRA fine-tuning against the deployed file it came from: operators and
inference time, one thread, batch 64 x 16, in each form onnxruntime's tools make of a small
Llama and a small BERT (transformers' config classes, exported by torch.onnx) and of the
float-input architectures of ``tests.architectures`` (``--kinds gpt2,qwen2,vit,t5,whisper``:
GPT-2, a Qwen2 decoder, a ViT over 16 patches, a T5 and a Whisper encoder, two layers each,
built at ``--hidden`` over 16 tokens into the folder's own cache; their forms add the
export's ``Constant`` nodes as initializers).

For each form (float32, onnxruntime's transformer optimizer at levels 1 and 2, float16 by
onnxconverter-common, int8 ``quantize_dynamic``, QDQ ``quantize_static``, 4-bit
``MatMulNBits``) it times, side by side in one process, the deployed file and:

- ``adapted``: ``add_lora``'s output, which is also the artifacts' ``inference_model.onnx``
  (``generate_artifacts`` saves the model as given);
- ``keep``: ``merge_lora`` of the trained adapters (``merge_checkpoint(..., "keep")``):
  folded into float weights, kept beside a quantized base;
- ``requantize``: folded everywhere, quantized bases quantized again in their own format;
- ``runtime``: ``runtime_adapter_model(deployed, adapted)``, the adapters as graph inputs;
- ``runtime-w``: the same with ``apply="weights"``: the fed adapters update the weights once
  per run (float ``W + s A B``, QDQ, int8 and 4-bit codes quantized again) instead of a
  branch per row (``--batch 1 --seq 1``: one decoding step);
- ``runtime-a``: ``apply="auto"``, one ``If`` choosing either per run from the rows (each
  body's form checked as its explicit model's);
- ``keep-int``, ``runtime-int``: the same with ``integer_branch=True`` (int8 form only: the
  branch's first product from the codes of ``x``, :mod:`onnxgrad.graph.integer_branch`).

The adapters are trained stand-ins (``B`` random, so no branch is skipped). Each model runs
in its own ``InferenceSession`` at onnxruntime's default optimization level, one intra-op
thread (so the caller's thread computes: its CPU time is measured, wall time being too noisy
on a shared machine); the rounds interleave the models and the median of each is reported
with its ratio
to the deployed file, the adapters' share of the weight products' FLOPs
(``r (K + N)`` against ``K N`` summed over the adapted products), the target (1.05x, plus
that share where a branch stays beside the base) and whether the form is kept: the deployed
operators, plus only an adapter branch's where it stays beside
(``tests.normalize.deployed.assert_deployed_form``; ``MISS`` and the difference otherwise).
``python benchmarks/bench_round_trip.py [FOLDER] [--rounds R]`` (``--hidden`` sets the
width, default 128, ``--kinds llama`` one model, ``--forms int8`` one form). The exports
need torch and transformers, the 4-bit form onnxruntime >= 1.20: make them once with the
training environment into FOLDER (``--forms float32,opt1,opt2,float16``), then time with the
newer onnxruntime over the same FOLDER; a form its optimizer cannot make without torch is
read from the one the other environment made (the line says which).

Measured (this 2-core shared machine, onnxruntime 1.32, CPU time of the one calling thread,
median of 15 rounds): every merged form (``keep`` over float weights, ``requantize``
everywhere) has exactly the deployed operators and runs in 0.95-1.04x the deployed file's
time. Adapters kept beside a quantized base, at width 128, rank 8 (11% of the weight
products' FLOPs): 4-bit 1.14-1.20x, QDQ 1.20-1.22x, int8 1.28-1.36x (before: 1.19-1.21x,
1.31-1.37x, 1.34-1.43x); the branch no longer blocks onnxruntime's fusions of the base, what
remains is its float FLOPs next to integer kernels. With ``integer_branch=True`` (int8, 15
rounds) ``keep`` runs in 1.25x (Llama, 1.34x float) and 1.22x (BERT, 1.26x), the runtime
model in 1.29x and 1.26x (1.36x, 1.28x): the second product and its ``Add`` remain
(``benchmarks/bench_int8_branch.py``); see docs/deployed-models.md.

GPT-2, Qwen2, ViT, T5 and Whisper encoders at width 128 (9 rounds, every form, 170 models
that come back): every one keeps its deployed form; every merged one runs in 0.96-1.04x,
``add_lora``'s output over float weights in 0.98-1.05x; beside the base the float branch
adds about the same time in every architecture (1.4-1.6 ms beside int8 products, 1.9-2.7 ms
beside QDQ ones, 1.3-2.0 ms in the runtime model over float weights), 1.11-1.47x of the
faster int8 files, 1.16-1.42x (QDQ), 1.00-1.25x (4-bit), 1.13-1.24x (runtime, float): the
table is in docs/deployed-models.md.

``runtime-w`` and ``runtime-a`` (``apply="weights"``, ``"auto"``; ``--only
runtime,runtime-w,runtime-a``, the same five architectures, 7 rounds at 64 x 16, 201 at one
row): at 64 x 16 the weights update meets the target in 22 of 30 cells (1.00-1.18x over
float and int8 weights, 1.15-1.36x over QDQ, 1.5-1.8x over 4-bit blocks), the branch in 10,
``"auto"`` in 22 (within 0.08x of the weights over float and int8, the branch over QDQ and
4-bit); at one row (``--batch 1 --seq 1`` for GPT-2 and Qwen2, ``--batch 1`` for the
encoders) the branch in 9, ``"auto"`` in 1 (0.03-0.44x above the branch: onnxruntime runs
an ``If`` body's nodes more slowly)."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

HIDDEN, SEQ, BATCH, RANK = 128, 16, 64, 8
FORMS = ("float32", "initializers", "opt1", "opt2", "float16", "int8", "qdq", "int4")


def _forms(folder: Path, kinds, forms, hidden: int) -> dict[tuple[str, str], Path]:
    """The deployed files: Llama and BERT from ``tests.normalize.deployed``, the float-input
    architectures (GPT-2, Qwen2, ViT, T5, Whisper) from ``tests.architectures``, each at
    width ``hidden``."""
    from tests.normalize import deployed

    deployed.HIDDEN, deployed.SEQ, deployed.BATCH = hidden, SEQ, BATCH
    deployed.DECODER = {
        **deployed.DECODER,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "max_position_embeddings": max(32, 2 * SEQ),
    }
    made = {}
    for kind in kinds:
        for form in [f for f in _form_names(kind) if f in forms]:
            try:
                made[kind, form] = _form(folder, kind, form, hidden)
            except ImportError as exc:
                print(f"{kind} {form}: not made ({exc})")
    return made


def _form_names(kind: str) -> tuple[str, ...]:
    from tests import architectures
    from tests.normalize import deployed

    if kind in architectures.FLOAT_INPUT:
        return architectures.forms(kind)
    return deployed.FORMS


def _form(folder: Path, kind: str, form: str, hidden: int) -> Path:
    from tests import architectures
    from tests.normalize import deployed

    if kind in architectures.FLOAT_INPUT:
        try:
            return _sized_architectures(folder, hidden).deployed_form(kind, form)
        except ImportError:  # onnxruntime >= 1.2x's optimizer imports torch: another's form
            made = sorted(architectures.cache_dir().glob(f"{kind}_{form}_ort*.onnx"))
            if not made:
                raise
            print(f"{kind} {form}: {made[-1].name}")
            return made[-1]
    source = folder / f"{kind}.onnx"
    if not source.exists():
        getattr(deployed, f"export_{kind}")(source)
    return deployed.make_form(source, form, kind, folder)


def _sized_architectures(folder: Path, hidden: int):
    """``tests.architectures`` building its float-input transformers at width ``hidden`` over
    SEQ tokens (a ViT's 16 patches and its class token, Whisper's 2 SEQ frames halved by
    its second convolution), cached in ``folder`` (the tests' cache keeps their sizes)."""
    import os

    from tests import architectures

    os.environ["ONNXGRAD_TEST_CACHE"] = str(folder / f"hidden{hidden}")
    architectures.WIDE, architectures.WIDE_SEQ = hidden, SEQ
    architectures.IMAGE, architectures.FRAMES = 16, 2 * SEQ
    architectures.OPTIMIZER = {
        kind: (model_type, heads, hidden)
        for kind, (model_type, heads, _) in architectures.OPTIMIZER.items()
    }
    return architectures


def _feeds(kind: str, seq: int | None) -> dict:
    """The inputs of ``kind``, ``BATCH`` rows of ``SEQ`` tokens, or of the first ``seq``
    tokens (a decoder's dynamic sequence: ``--seq 1`` times one decoding step)."""
    from tests import architectures
    from tests.normalize import deployed

    if kind in architectures.FLOAT_INPUT:
        feeds = architectures.feeds(kind, batch=BATCH)
    else:
        deployed.BATCH = BATCH
        feeds = deployed.feeds(kind)
    return {k: v[:, :seq] for k, v in feeds.items()} if seq else feeds


def _returned(model, form: str, only: set[str] | None = None) -> dict:
    """The models that come back, by name (a refusal as its message; ``only``: these)."""
    from onnxgrad import add_lora, merge_lora
    from onnxgrad.graph.lora_runtime import runtime_adapter_model
    from tests.normalize.deployed import trained_adapters

    adapted = trained_adapters(add_lora(model, rank=RANK))
    found = {"adapted": adapted}
    makers = [
        ("keep", lambda: merge_lora(adapted)),
        ("requantize", lambda: merge_lora(adapted, quantized="requantize")),
        ("runtime", lambda: runtime_adapter_model(model, adapted)),
        ("runtime-w", lambda: runtime_adapter_model(model, adapted, apply="weights")),
        ("runtime-a", lambda: runtime_adapter_model(model, adapted, apply="auto")),
    ]
    if form == "int8":
        makers += [
            ("keep-int", lambda: merge_lora(adapted, integer_branch=True)),
            (
                "runtime-int",
                lambda: runtime_adapter_model(model, adapted, integer_branch=True, apply="branch"),
            ),
        ]
    for name, make in makers:
        if only and name not in only:
            continue
        try:
            found[name] = make()
        except ValueError as exc:
            found[name] = str(exc)
    return found


def _adapter_share(model, adapted) -> float:
    """Adapter FLOPs over the deployed weight products' FLOPs, ``r (K + N)`` against ``K N``
    for each adapted product."""
    from onnxgrad.graph.deployed_products import weight_products
    from onnxgrad.graph.lora import lora_adapters

    products = weight_products(model)
    base = sum(p.shape[0] * p.shape[1] for ps in products.values() for p in ps)
    extra = sum(
        RANK * sum(p.shape) for a in lora_adapters(adapted) for p in products.get(a["weight"], [])
    )
    return extra / base if base else 0.0


def _session(model):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _times(models: dict, feeds: dict, rounds: int) -> dict[str, float]:
    sessions = {name: _session(m) for name, m in models.items()}
    for session in sessions.values():
        for _ in range(3):
            session.run(None, feeds)
    samples: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(rounds):
        for name, session in sessions.items():
            start = time.thread_time()
            session.run(None, feeds)
            samples[name].append(time.thread_time() - start)
    return {name: float(np.median(v)) * 1e3 for name, v in samples.items()}


def _extra_operators(model, returned) -> str:
    def count(m):
        return Counter(n.op_type for n in m.graph.node)

    want, have = count(model), count(returned)
    lost, added = want - have, have - want
    parts = [f"-{op}x{n}" for op, n in sorted(lost.items())]
    parts += [f"+{op}x{n}" for op, n in sorted(added.items())]
    return " ".join(parts) or "same"


#: the forms whose weights stay quantized: ``keep`` leaves the adapters beside them
QUANTIZED = ("int8", "qdq", "int4")


def _beside(name: str, form: str) -> bool:
    """Whether the adapters stay beside the base in the model ``name`` returns."""
    return name != "requantize" and (name != "keep" or form in QUANTIZED)


#: the operators ``runtime_adapter_model(..., apply="weights")`` adds: ``W + s A B`` and, over
#: QDQ weights, its quantization again (:mod:`onnxgrad.graph.lora_requantized`)
WEIGHT_UPDATE_OPS = frozenset(
    {"MatMul", "Mul", "Add", "Sub", "Div", "Min", "Max", "ReduceMin", "ReduceMax", "Greater"}
    | {"Where", "Round", "Clip", "Cast", "Constant", "Transpose", "Reshape"}
    | {"QuantizeLinear", "DequantizeLinear", "Mod", "Pad", "ReduceSum", "Neg"}
)


def _sides(returned) -> tuple | None:
    """``(weights side, branch side)`` of an ``apply="auto"`` model, each one flat model (the
    nodes before its ``If`` but the choice's, then one body's but those recomputing an outer
    node), or ``None`` for a model without that ``If``."""
    import re

    import onnx

    from onnxgrad.graph.lora_choice import CHOOSER

    nodes = list(returned.graph.node)
    if not nodes or not nodes[-1].name.startswith(CHOOSER):
        return None
    outer = [n for n in nodes if not n.name.startswith(CHOOSER)]
    written = {o for n in outer for o in n.output}
    views = {}
    for attribute in nodes[-1].attribute:
        own = [
            n
            for n in attribute.g.node
            if not all(re.sub(r"/(weights|branch)(_\d+)?$", "", o) in written for o in n.output)
        ]
        views[attribute.name] = onnx.ModelProto()
        views[attribute.name].CopyFrom(returned)
        del views[attribute.name].graph.node[:]
        views[attribute.name].graph.node.extend([*outer, *own])
    return views["then_branch"], views["else_branch"]


def _kept_form(model, returned, beside: bool, name: str) -> str:
    """``ok`` where ``returned`` holds the deployed operators plus, ``beside`` the base, only
    an adapter branch's (``tests.normalize.deployed.assert_deployed_form``) or, for
    ``runtime-w``, a weight update's, else the miss."""
    from tests.normalize.deployed import BRANCH_OPS, assert_deployed_form, operators

    sides = _sides(returned) if name == "runtime-a" else None
    if sides is not None:
        kept = [_kept_form(model, sides[0], beside, "runtime-w")]
        kept.append(_kept_form(model, sides[1], beside, "runtime"))
        return "ok" if kept == ["ok", "ok"] else " / ".join(kept)
    if name == "runtime-w":
        lost = operators(model) - operators(returned)
        extra = {op for domain, op in operators(returned) - operators(model) if not domain}
        foreign = extra - BRANCH_OPS - WEIGHT_UPDATE_OPS
        return f"MISS lost {dict(lost)}, added {sorted(foreign)}" if lost or foreign else "ok"
    try:
        assert_deployed_form(model, returned, beside=beside, integer=name.endswith("-int"))
    except AssertionError as exc:
        return f"MISS {str(exc)[:120]}"
    return "ok"


def main() -> None:
    global BATCH
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", nargs="?")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--kinds", default="llama,bert")
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--seq", type=int, default=None, help="the first SEQ tokens only")
    parser.add_argument("--only", default="", help="these models that come back (runtime,...)")
    args = parser.parse_args()
    BATCH = args.batch
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import onnx

    folder = Path(args.folder or tempfile.mkdtemp())
    folder.mkdir(parents=True, exist_ok=True)
    print(
        "| model | form | deployed nodes, ms | what comes back | nodes | operators vs deployed "
        "| form kept | ms | ratio | adapter FLOP share | target | met |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (kind, form), path in _forms(
        folder, args.kinds.split(","), args.forms.split(","), args.hidden
    ).items():
        model = onnx.load(path)
        returned = _returned(model, form, set(filter(None, args.only.split(","))))
        runnable = {k: v for k, v in returned.items() if not isinstance(v, str)}
        times = _times({"deployed": model, **runnable}, _feeds(kind, args.seq), args.rounds)
        share = _adapter_share(model, returned["adapted"])
        head = f"| {kind} | {form} | {len(model.graph.node)}, {times['deployed']:.2f} "
        for name, result in returned.items():
            if isinstance(result, str):
                print(f"{head}| {name} | refused: {result[:80]} | | | | | | | |")
                continue
            ratio = times[name] / times["deployed"]
            beside = _beside(name, form)
            kept = _kept_form(model, result, beside, name)
            target = 1.05 + (share if beside else 0.0)
            met = "yes" if kept == "ok" and ratio <= target else "no"
            print(
                f"{head}| {name} | {len(result.graph.node)} | {_extra_operators(model, result)} "
                f"| {kept} | {times[name]:.2f} | {ratio:.3f} | {share:.3f} | {target:.2f} "
                f"| {met} |"
            )


if __name__ == "__main__":
    main()
