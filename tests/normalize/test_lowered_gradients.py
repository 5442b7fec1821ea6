"""Gradients through the lowered operators against central finite differences of
onnxruntime's own kernels (float32, so a step of 1e-3 and a tolerance of a few 1e-3)."""

from __future__ import annotations

import numpy as np
import pytest

from onnxgrad import onnx_derivative
from tests.derivative.fd import numerical_vjp
from tests.normalize.kernels import kernel_outputs, one_node_model, run, since_runtime

RNG = np.random.default_rng(3)
B, S, N, HEAD = 2, 3, 2, 4
HID = N * HEAD


def _r(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _packed_4bit(n, k, block):
    blocks = k // block
    return RNG.integers(0, 256, (n, blocks, block // 2), dtype=np.uint8), (
        RNG.random(n * blocks) * 0.1 + 0.01
    ).astype(np.float32)


def _cases():
    mask = np.ones((B, S), dtype=np.int32)
    mask[1, -1] = 0
    packed, scales = _packed_4bit(5, 32, 16)
    cos = np.cos(np.arange(8)[:, None] * np.array([1.0, 0.1]))[:, :2].astype(np.float32)
    sin = np.sin(np.arange(8)[:, None] * np.array([1.0, 0.1]))[:, :2].astype(np.float32)
    return {
        "FastGelu": (("FastGelu", [("x", _r(B, S, HID)), ("b", _r(HID))], {}), ["x", "b"]),
        "SkipLayerNormalization": (
            (
                "SkipLayerNormalization",
                [("x", _r(B, S, HID)), ("s", _r(B, S, HID)), ("g", _r(HID)), ("be", _r(HID))],
                {},
            ),
            ["x", "s", "g", "be"],
        ),
        "SkipSimplifiedLayerNormalization": (
            (
                "SkipSimplifiedLayerNormalization",
                [("x", _r(B, S, HID)), ("s", _r(B, S, HID)), ("g", _r(HID))],
                {},
            ),
            ["x", "g"],
        ),
        "Attention": (
            (
                "Attention",
                [("x", _r(B, S, 6)), ("w", _r(6, 3 * HID)), ("bias", _r(3 * HID)), ("m", mask)],
                {"num_heads": N, "unidirectional": 1},
            ),
            ["x", "w", "bias"],
        ),
        "MultiHeadAttention": (
            (
                "MultiHeadAttention",
                [("q", _r(B, S, HID)), ("k", _r(B, 2, HID)), ("v", _r(B, 2, HID))],
                {"num_heads": N},
            ),
            ["q", "k", "v"],
        ),
        "EmbedLayerNormalization": (
            (
                "EmbedLayerNormalization",
                [
                    ("ids", RNG.integers(0, 7, (B, S)).astype(np.int32)),
                    None,
                    ("word", _r(7, HID)),
                    ("pos", _r(S, HID)),
                    None,
                    ("g", _r(HID)),
                    ("be", _r(HID)),
                ],
                {"n_outputs": 2, "out_types": (np.float32, np.int32)},
            ),
            ["word", "pos", "g"],
        ),
        "GroupQueryAttention": (
            (
                "GroupQueryAttention",
                [
                    ("q", _r(B, S, 2 * N * 8)),  # the kernel wants heads of 8k features
                    ("k", _r(B, S, N * 8)),
                    ("v", _r(B, S, N * 8)),
                    ("pk", _r(B, N, 0, 8)),
                    ("pv", _r(B, N, 0, 8)),
                    ("seqlens", np.array([S - 1, S - 2], dtype=np.int32)),
                    ("total", np.array(S, dtype=np.int32)),
                ],
                {"num_heads": 2 * N, "kv_num_heads": N, "n_outputs": 3},
            ),
            ["q", "k", "v"],
        ),
        "RotaryEmbedding": (
            (
                "RotaryEmbedding",
                [
                    ("x", _r(B, S, HID)),
                    ("p", RNG.integers(0, 8, (B, S)).astype(np.int64)),
                    ("cos", cos),
                    ("sin", sin),
                ],
                {"num_heads": N},
            ),
            ["x"],
        ),
        "MatMulNBits": (
            (
                "MatMulNBits",
                [("a", _r(B, 32)), ("w", packed), ("s", scales)],
                {"K": 32, "N": 5, "bits": 4, "block_size": 16, "initializers": ("w", "s")},
            ),
            ["a"],
        ),
    }


CASES = _cases()
#: cases whose kernel an older onnxruntime computes otherwise
MARKS = {"GroupQueryAttention": since_runtime("1.20", "its GroupQueryAttention gives NaN, no past")}


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=MARKS.get(name, ())) for name in sorted(CASES)]
)
def test_input_gradient_matches_finite_differences_of_the_kernel(name):
    (op, inputs, attrs), wrt = CASES[name]
    model, feeds = one_node_model(op, inputs, **attrs)
    kernel_outputs(model, feeds)
    dtypes = {k: v.dtype for k, v in feeds.items()}

    def function(values):
        first = run(model, {k: np.asarray(v).astype(dtypes[k]) for k, v in values.items()})[0]
        return [first.astype(np.float64)]

    outputs = run(model, feeds)
    seed = _r(*outputs[0].shape)
    expected = numerical_vjp(function, feeds, wrt, [seed], eps=1e-3)
    gradient = onnx_derivative(model, inputs=wrt, weights=[])
    names = [o.name for o in gradient.graph.output]
    seeds = {f"y{i}_grad": np.zeros_like(y) for i, y in enumerate(outputs)}
    declared = {i.name for i in gradient.graph.input}
    feeds = {k: v for k, v in {**feeds, **seeds, "y0_grad": seed}.items() if k in declared}
    got = dict(zip(names, run(gradient, feeds), strict=True))
    for x in wrt:
        np.testing.assert_allclose(got[f"{x}_grad"], expected[x], rtol=5e-3, atol=5e-3, err_msg=x)
