"""onnxruntime's fused transformer operators, lowered, against onnxruntime's own kernels on
random inputs (float32, and float16 where the CPU kernel has it)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import erf

from tests.normalize.kernels import (
    assert_lowering_matches,
    lowered_outputs,
    one_node_model,
    since_runtime,
)

B, S, H, N = 2, 5, 16, 4
RNG = np.random.default_rng(0)


def _r(*shape, dtype=np.float32, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(dtype)


def _tol(dtype):
    return {"rtol": 2e-3, "atol": 2e-3} if dtype == np.float16 else {"rtol": 1e-4, "atol": 1e-5}


ELEMENTWISE = [
    ("Gelu", lambda d: [("x", _r(B, S, H, dtype=d))], {}),
    ("BiasGelu", lambda d: [("x", _r(B, S, H, dtype=d)), ("b", _r(H, dtype=d))], {}),
    ("FastGelu", lambda d: [("x", _r(B, S, H, dtype=d))], {}),
    ("FastGelu", lambda d: [("x", _r(B, S, H, dtype=d)), ("b", _r(H, dtype=d))], {}),
    ("QuickGelu", lambda d: [("x", _r(B, S, H, dtype=d))], {}),
    ("QuickGelu", lambda d: [("x", _r(B, S, H, dtype=d))], {"alpha": 1.1}),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize(("op", "inputs", "attrs"), ELEMENTWISE)
def test_elementwise(op, inputs, attrs, dtype):
    model, feeds = one_node_model(op, inputs(dtype), **attrs)
    assert_lowering_matches(model, feeds, **_tol(dtype))


def _gelu(x):
    return 0.5 * x * (1 + erf(x / np.sqrt(2)))


def test_bias_add_and_bias_split_gelu_cuda_only_kernels():
    """onnxruntime has these kernels on CUDA only: checked against their definition."""
    x, bias, skip = _r(B, S, H), _r(H), _r(B, S, H)
    model, feeds = one_node_model("BiasAdd", [("x", x), ("b", bias), ("s", skip)])
    np.testing.assert_allclose(lowered_outputs(model, feeds)[0], x + bias + skip, rtol=1e-6)
    model, feeds = one_node_model("BiasSplitGelu", [("x", x), ("b", bias)])
    y = x + bias
    want = y[..., : H // 2] * _gelu(y[..., H // 2 :].astype(np.float64))
    np.testing.assert_allclose(lowered_outputs(model, feeds)[0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize(
    ("shapes", "attrs"),
    [
        (((3, 4), (4, 5)), {}),
        (((4, 3), (4, 5)), {"transA": 1, "alpha": 0.5}),
        (((3, 4), (5, 4)), {"transB": 1}),
        (((2, 3, 4), (2, 5, 4)), {"transB": 1, "alpha": 2.0}),
        (((3, 2, 4), (2, 4, 5)), {"transBatchA": 1}),
        (((4, 2, 3), (2, 4, 5)), {"transBatchA": 1, "transA": 1}),
        (((2, 3, 4), (5, 2, 4)), {"transBatchB": 1, "transB": 1}),
        (((2, 3, 4), (4, 2, 5)), {"transBatchB": 1}),
    ],
)
def test_fused_matmul(shapes, attrs, dtype):
    a, b = shapes
    model, feeds = one_node_model(
        "FusedMatMul", [("a", _r(*a, dtype=dtype)), ("b", _r(*b, dtype=dtype))], **attrs
    )
    assert_lowering_matches(model, feeds, **_tol(dtype))


OLD_SKIP_BIAS = since_runtime(
    "1.20", "its SkipSimplifiedLayerNormalization reads the bias otherwise"
)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize(
    ("simplified", "with_bias"),
    [(False, False), (False, True), (True, False), pytest.param(True, True, marks=OLD_SKIP_BIAS)],
)
def test_skip_layer_norm(simplified, with_bias, dtype):
    op = "SkipSimplifiedLayerNormalization" if simplified else "SkipLayerNormalization"
    inputs = [
        ("x", _r(B, S, H, dtype=dtype)),
        ("skip", _r(B, S, H, dtype=dtype)),
        ("g", _r(H, dtype=dtype)),
    ]
    if not simplified:
        inputs.append(("beta", _r(H, dtype=dtype)))
    inputs.append(("bias", _r(H, dtype=dtype)) if with_bias else None)
    model, feeds = one_node_model(
        op, inputs, n_outputs=4, out_types=(dtype, np.float32, np.float32, dtype), epsilon=1e-5
    )
    assert_lowering_matches(model, feeds, **_tol(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_simplified_layer_norm_in_the_default_domain(dtype):
    """onnxruntime registers it in the default domain only; onnx's checker has no such op."""
    inputs = [("x", _r(B, S, H, dtype=dtype)), ("g", _r(H, dtype=dtype))]
    model, feeds = one_node_model("SimplifiedLayerNormalization", inputs, domain="", epsilon=1e-6)
    assert_lowering_matches(model, feeds, **_tol(dtype))


def test_simplified_layer_norm_over_two_axes():
    inputs = [("x", _r(B, S, H)), ("g", _r(S, H))]
    model, feeds = one_node_model("SimplifiedLayerNormalization", inputs, domain="", axis=1)
    assert_lowering_matches(model, feeds)


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("with_segments", [False, True])
@pytest.mark.parametrize("with_positions", [False, True])
def test_embed_layer_norm(with_mask, with_segments, with_positions):
    vocab, positions = 11, 8
    ids = RNG.integers(0, vocab, (B, S)).astype(np.int32)
    segments = RNG.integers(0, 2, (B, S)).astype(np.int32)
    mask = (RNG.random((B, S)) > 0.3).astype(np.int32)
    position_ids = RNG.integers(0, positions, (B, S)).astype(np.int32)
    inputs = [
        ("ids", ids),
        ("seg", segments) if with_segments else None,
        ("word", _r(vocab, H)),
        ("pos", _r(positions, H)),
        ("segemb", _r(2, H)) if with_segments else None,
        ("g", _r(H)),
        ("beta", _r(H)),
        ("mask", mask) if with_mask else None,
        ("posids", position_ids) if with_positions else None,
    ]
    model, feeds = one_node_model(
        "EmbedLayerNormalization",
        inputs,
        n_outputs=3,
        out_types=(np.float32, np.int32, np.float32),
        epsilon=1e-5,
    )
    assert_lowering_matches(model, feeds, rtol=1e-4, atol=1e-5)


def _rotary_caches(max_pos, half, dtype):
    angles = np.arange(max_pos)[:, None] / (10000 ** (np.arange(half) / half))[None, :]
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("layout", ["bsd", "bnsh", "offset", "partial"])
def test_rotary_embedding(layout, interleaved, dtype):
    heads, head = 2, 8
    rotary = 4 if layout == "partial" else head
    cos, sin = _rotary_caches(16, rotary // 2, dtype)
    x = (
        _r(B, heads, S, head, dtype=dtype)
        if layout == "bnsh"
        else _r(B, S, heads * head, dtype=dtype)
    )
    positions = (
        np.array([3], dtype=np.int64)
        if layout == "offset"
        else RNG.integers(0, 16, (B, S)).astype(np.int64)
    )
    attrs = {"interleaved": interleaved, "num_heads": heads}
    if layout == "partial":
        attrs["rotary_embedding_dim"] = rotary
    model, feeds = one_node_model(
        "RotaryEmbedding", [("x", x), ("pos", positions), ("cos", cos), ("sin", sin)], **attrs
    )
    assert_lowering_matches(model, feeds, **_tol(dtype))


def _embed_then_attention_model(vocab: int, opset: int):
    """onnxruntime's optimized BERT front: ``EmbedLayerNormalization``'s mask index (its
    rank lost to onnx's inference after a ``ReduceSum`` of axes given as an input) feeding
    an ``Attention``, batch and sequence dynamic."""
    from onnx import TensorProto, helper, numpy_helper

    weights = {
        "word": _r(vocab, H),
        "pos": _r(S + 3, H),
        "g": _r(H),
        "beta": _r(H),
        "w": _r(H, 3 * H, scale=0.3),
        "b": _r(3 * H),
    }
    embed = helper.make_node(
        "EmbedLayerNormalization",
        ["ids", "", "word", "pos", "", "g", "beta", "mask"],
        ["hidden", "mask_index"],
        domain="com.microsoft",
        epsilon=1e-5,
    )
    attention = helper.make_node(
        "Attention", ["hidden", "w", "b", "mask_index"], ["y"], domain="com.microsoft", num_heads=N
    )
    dynamic = ["batch", "sequence"]
    graph = helper.make_graph(
        [embed, attention],
        "embed_attention",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT32, dynamic),
            helper.make_tensor_value_info("mask", TensorProto.INT32, dynamic),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*dynamic, H])],
        [numpy_helper.from_array(v, name=k) for k, v in weights.items()],
    )
    imports = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=imports, ir_version=8)


@pytest.mark.parametrize("opset", [11, 17])
@pytest.mark.parametrize("batch", [1, 3])
def test_embed_layer_norm_mask_index_into_attention_of_dynamic_batch(opset, batch):
    vocab = 13
    model = _embed_then_attention_model(vocab, opset)
    mask = np.ones((batch, S), dtype=np.int32)
    mask[-1, S - 2 :] = 0
    feeds = {"ids": RNG.integers(0, vocab, (batch, S)).astype(np.int32), "mask": mask}
    assert_lowering_matches(model, feeds, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("op", "inputs", "attribute"),
    [
        ("FastGelu", lambda: [("x", _r(B, S, H))], {"approximate": 1}),
        (
            "SkipLayerNormalization",
            lambda: [("x", _r(B, S, H)), ("s", _r(B, S, H)), ("g", _r(H))],
            {"epsilon": 1e-5, "stash_type": 0},
        ),
        (
            "RotaryEmbedding",
            lambda: [
                ("x", _r(B, S, H)),
                ("p", np.zeros((B, S), np.int64)),
                ("c", _r(8, 2)),
                ("s", _r(8, 2)),
            ],
            {"scale": 2.0},
        ),
        (
            "GroupQueryAttention",
            lambda: [("q", _r(B, S, H))],
            {"num_heads": 2, "kv_num_heads": 1, "qk_output": 1},
        ),
    ],
)
def test_an_attribute_the_lowering_does_not_read_is_refused_by_name(op, inputs, attribute):
    """An attribute outside what the lowering reads (a newer onnxruntime's, or a value
    that changes the computation) is an error naming node and attribute, not a different
    computation."""
    from onnxgrad.normalize import normalized_model

    model, _ = one_node_model(op, inputs(), **attribute)
    model.graph.node[0].name = "fused_0"
    name = next(k for k in attribute if k not in ("num_heads", "kv_num_heads", "epsilon"))
    with pytest.raises(ValueError, match=f"'fused_0'.*attribute {name}="):
        normalized_model(model)
