"""One adapted ``Conv`` served by ``runtime_adapter_model``: its kernel updated per run
(``W + s reshape(A B)``, no blocked layout for onnxruntime) against a branch beside it
(:mod:`onnxgrad.graph.conv_branch`), both against the deployed ``Conv`` alone.

Each case is a ``Conv`` followed by a ``Relu`` (onnxruntime fuses them in its NCHWc pass),
adapted at rank 8 with random ``A`` and ``B``; the three models run side by side in one
process, interleaved, one thread each, at onnxruntime's default optimization level, the
median CPU time of ``--rounds`` runs reported with the ratios to the deployed model. The last
columns give the branch's multiply-adds per output position, ``r (g (I/g) k + O)``, over the
``Conv``'s own, ``(I/g) k O``, and what :func:`onnxgrad.graph.lora_choice.conv_branch_pays`
chooses. ``python benchmarks/bench_conv_branch.py [--rounds R]``.

Measured (onnxruntime 1.19.2 and 1.32, 51 rounds; table: docs/deployed-models.md, "A ``Conv``
kernel"): the branch is faster only beside dense 256->256 3x3 at 14x14 (1.32x against 1.39x)
and 512->512 3x3 at 7x7 (1.20x against 1.42x); slower beside the test architectures' small
convolutions (Segformer's depthwise ones 25x against 11x), strided, pointwise, grouped and
depthwise ones."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

RANK = 8
#: (name, batch, in channels, out channels, kernel, group, image side, stride, pads)
CASES = [
    ("ViT patch 3->32 4x4/4", 64, 3, 32, 4, 1, 8, 4, 0),
    ("Segformer patch 3->16 3x3/2", 64, 3, 16, 3, 1, 8, 2, 1),
    ("Segformer patch 16->32 3x3/2", 64, 16, 32, 3, 1, 4, 2, 1),
    ("Segformer reduction 16->16 2x2/2", 64, 16, 16, 2, 1, 4, 2, 0),
    ("Segformer depthwise 32 3x3", 64, 32, 32, 3, 32, 4, 1, 1),
    ("Segformer depthwise 64 3x3", 64, 64, 64, 3, 64, 2, 1, 1),
    ("dense 64->64 3x3 at 32", 8, 64, 64, 3, 1, 32, 1, 1),
    ("dense 256->256 3x3 at 14", 8, 256, 256, 3, 1, 14, 1, 1),
    ("patch 3->256 16x16/16 at 224", 8, 3, 256, 16, 1, 224, 16, 0),
    ("dense 128->128 3x3 at 28", 8, 128, 128, 3, 1, 28, 1, 1),
    ("dense 512->512 3x3 at 7", 8, 512, 512, 3, 1, 7, 1, 1),
    ("dense 256->256 3x3/2 at 28", 8, 256, 256, 3, 1, 28, 2, 1),
    ("pointwise 64->64 at 56", 8, 64, 64, 1, 1, 56, 1, 0),
    ("pointwise 256->256 at 14", 8, 256, 256, 1, 1, 14, 1, 0),
    ("pointwise 1024->256 at 14", 8, 1024, 256, 1, 1, 14, 1, 0),
    ("grouped 64->64 g4 3x3 at 32", 8, 64, 64, 3, 4, 32, 1, 1),
    ("depthwise 128 3x3 at 32", 8, 128, 128, 3, 128, 32, 1, 1),
    ("depthwise 512 3x3 at 14", 8, 512, 512, 3, 512, 14, 1, 1),
]


def conv_model(cin: int, cout: int, k: int, group: int, stride: int, pad: int):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((cout, cin // group, k, k)).astype(np.float32)
    bias = rng.standard_normal(cout).astype(np.float32)
    conv = helper.make_node(
        "Conv", ["x", "W", "bias"], ["y"], name="conv", group=group,
        strides=[stride, stride], pads=[pad] * 4, kernel_shape=[k, k],
    )  # fmt: skip
    relu = helper.make_node("Relu", ["y"], ["z"], name="relu")
    graph = helper.make_graph(
        [conv, relu], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", cin, "H", "W"])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", cout, None, None])],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "bias")],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def served(model, conv_branches: bool, adapted=None):
    """The runtime adapter model of ``model`` and ``adapted`` (default: ``model`` adapted
    at ``RANK``, random ``A`` and ``B``): every adapted kernel read by ``Conv`` nodes alone
    updated, or a branch beside each such ``Conv``, whatever the cost model says."""
    from onnxgrad import add_lora
    from onnxgrad.graph import lora_runtime
    from tests.normalize.deployed import trained_adapters

    if adapted is None:
        adapted = trained_adapters(add_lora(model, rank=RANK))
    chooser = lora_runtime.conv_branch_pays
    lora_runtime.conv_branch_pays = lambda *shape: conv_branches
    try:
        return lora_runtime.runtime_adapter_model(model, adapted)
    finally:
        lora_runtime.conv_branch_pays = chooser


def main() -> int:
    from bench_round_trip import _times

    from onnxgrad.graph.lora_choice import conv_branch_pays

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=51)
    args = parser.parse_args()
    print("case | deployed ms | update | branch | branch/conv MACs | chosen")
    for name, batch, cin, cout, k, group, side, stride, pad in CASES:
        model = conv_model(cin, cout, k, group, stride, pad)
        models = {"deployed": model, "update": served(model, False), "branch": served(model, True)}
        x = np.random.default_rng(1).standard_normal((batch, cin, side, side)).astype(np.float32)
        times = _times(models, {"x": x}, args.rounds)
        per_group = cin // group
        macs = RANK * (cin * k * k + cout) / (per_group * k * k * cout)
        pays = conv_branch_pays(group, per_group, k * k, cout, RANK, stride > 1)
        chosen = "branch" if pays else "update"
        base = times["deployed"]
        print(
            f"{name} | {base:.3f} | {times['update'] / base:.2f}x | "
            f"{times['branch'] / base:.2f}x | {macs:.2f} | {chosen}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
