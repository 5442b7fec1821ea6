"""What each piece of an adapter branch costs beside one int8 product, one thread.

``quantize_dynamic``'s product ``y = x W`` (``DynamicQuantizeLinear``, ``MatMulInteger``,
``Cast``, ``Mul``: onnxruntime's ``MatMulIntegerToFloat``) over ``x`` of ``M x K`` rows, with
a rank-``r`` branch ``y + (x A) B`` built up one piece at a time, every piece an output so
that none is removed:

- ``x A float``: the first product as a float ``MatMul`` reading ``x`` again;
- ``x A int8``: the same from the codes of ``x`` (``integer_branch=True``,
  :mod:`onnxgrad.graph.integer_branch`: ``A`` on 7 bits per column);
- ``+ (x A) B``: the second product, a float ``M x r`` by ``r x N`` ``MatMul``;
- ``+ Add``: the sum ``y + (x A) B``, the whole branch (integer first product).

Each model runs in its own session at onnxruntime's default level, one intra-op thread; the
rounds interleave the models and the median CPU time of the calling thread is reported with
what each piece adds to the product alone. ``python benchmarks/bench_int8_branch.py
[--rounds R]``.

Measured (this 2-core shared machine, AVX-512 VNNI, onnxruntime 1.32, M = 1024 rows, r = 8,
100 rounds; ms each model adds to the product alone):

| K x N | product | x A float | x A int8 | + (x A) B | + Add (whole branch) | FLOP share |
| --- | --- | --- | --- | --- | --- | --- |
| 128 x 128 | 0.121 | +0.038 | +0.016 | +0.044 | +0.056 (46%) | 12.5% |
| 512 x 512 | 1.570 | +0.161 | +0.050 | +0.212 | +0.261 (17%) | 3.1% |

(onnxruntime 1.19.2: +0.055, 41%, and +0.389, 24%). The integer first product costs a
third to a half of the float one; what stays is the second product and the ``Add``, each a
pass over the ``M x N`` float output that the int8 kernel (about 4.5 times the float
kernel's rate here) does not fuse: the branch costs four to six times its FLOP share of the
int8 product. Neither a ``Gemm`` accumulating into ``y`` (``C = y``, ``beta = 1``) nor an
integer second product (``x A`` quantized again, ``B`` on 7 bits) was faster (measured
alike, not kept).
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_round_trip import _times  # interleaved rounds, one thread, CPU time
from onnx import TensorProto, helper, numpy_helper

ROWS, RANK = 1024, 8


def _models(k: int, n: int, rng) -> dict:
    """The product alone and with each piece of the branch added (see the docstring)."""
    weight = rng.integers(-127, 128, (k, n)).astype(np.int8)
    a = (rng.standard_normal((k, RANK)) / np.sqrt(k)).astype(np.float32)
    a_step = np.abs(a).max(axis=0) / 63
    inits = [
        numpy_helper.from_array(weight, "w"),
        numpy_helper.from_array(np.float32(0.01), "w_scale"),
        numpy_helper.from_array(a, "a"),
        numpy_helper.from_array(np.rint(a / a_step).astype(np.int8), "a_codes"),
        numpy_helper.from_array(a_step.astype(np.float32), "a_scale"),
        numpy_helper.from_array((rng.standard_normal((RANK, n)) * 0.05).astype(np.float32), "b"),
    ]

    def integer(weight_name, scale, out):
        return [
            helper.make_node("MatMulInteger", ["x_q", weight_name, "x_zero"], [f"{out}_i"]),
            helper.make_node("Cast", [f"{out}_i"], [f"{out}_c"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["x_scale", scale], [f"{out}_s"]),
            helper.make_node("Mul", [f"{out}_c", f"{out}_s"], [out]),
        ]

    product = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["x_q", "x_scale", "x_zero"]),
        *integer("w", "w_scale", "y"),
    ]
    first_int = integer("a_codes", "a_scale", "xa")
    second = [helper.make_node("MatMul", ["xa", "b"], ["delta"])]
    total = [helper.make_node("Add", ["y", "delta"], ["sum"])]
    pieces = {
        "product": (product, ["y"]),
        "x A float": ([*product, helper.make_node("MatMul", ["x", "a"], ["xa"])], ["y", "xa"]),
        "x A int8": (product + first_int, ["y", "xa"]),
        "+ (x A) B": (product + first_int + second, ["y", "delta"]),
        "+ Add": (product + first_int + second + total, ["sum"]),
    }
    x_info = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, k])]
    models = {}
    for name, (nodes, outputs) in pieces.items():
        outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
        graph = helper.make_graph(nodes, "branch", x_info, outs, inits)
        opsets = [helper.make_opsetid("", 17)]
        models[name] = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    return models


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print("| K x N | product ms | x A float | x A int8 | + (x A) B | + Add | FLOP share |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for k, n in ((128, 128), (512, 512)):
        x = rng.standard_normal((ROWS, k)).astype(np.float32)
        times = _times(_models(k, n, rng), {"x": x}, args.rounds)
        base = times.pop("product")
        added = " | ".join(f"+{t - base:.3f}" for t in times.values())
        share = RANK * (k + n) / (k * n)
        print(f"| {k} x {n} | {base:.3f} | {added} | {share:.1%} |")


if __name__ == "__main__":
    main()
