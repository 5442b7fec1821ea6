"""onnxruntime's fused attention operators, lowered, against onnxruntime's own kernels on
random inputs (float32, and float16 where the CPU kernel has it)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.normalize.kernels import assert_lowering_matches, one_node_model, since_runtime

#: what onnxruntime 1.19's CPU kernels compute differently from 1.20 and later
OLD_MHA_MASK = since_runtime(
    "1.20", "its MultiHeadAttention reads a 2-D key padding mask otherwise"
)
OLD_GQA_PAST = since_runtime(
    "1.20", "its GroupQueryAttention reads a past with new tokens otherwise"
)

B, S, N, HEAD = 2, 4, 2, 8
HID = N * HEAD
RNG = np.random.default_rng(1)


def _r(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def _tol(dtype):
    return {"rtol": 3e-3, "atol": 3e-3} if dtype == np.float16 else {"rtol": 1e-4, "atol": 1e-5}


def _mask(kind, total):
    if kind == "raw":
        mask = np.ones((B, total), dtype=np.int32)
        mask[1, -2:] = 0
        return mask
    if kind == "3d":
        return (RNG.random((B, S, total)) > 0.3).astype(np.int32)
    if kind == "end":
        return np.array([total, total - 2], dtype=np.int32)
    if kind == "end_start":
        return np.array([total, total - 1, 0, 1], dtype=np.int32)
    return None


@pytest.mark.parametrize(
    ("mask", "unidirectional", "past", "bias", "sizes"),
    [
        (None, 0, 0, False, None),
        ("raw", 0, 0, False, None),
        ("3d", 0, 0, False, None),
        ("end", 0, 0, False, None),
        ("end_start", 0, 0, False, None),
        (None, 1, 0, False, None),
        ("raw", 1, 0, True, None),
        (None, 1, 3, False, None),
        ("raw", 0, 0, False, [16, 16, 8]),
    ],
)
def test_attention(mask, unidirectional, past, bias, sizes):
    hidden_in = 12
    widths = sizes or [HID] * 3
    total = S + past
    inputs = [
        ("x", _r(B, S, hidden_in)),
        ("w", _r(hidden_in, sum(widths))),
        ("b", _r(sum(widths))),
        ("mask", _mask(mask, total)) if mask else None,
        ("past", _r(2, B, N, past, HEAD)) if past else None,
        ("bias", _r(B, N, S, total)) if bias else None,
    ]
    attrs = {"num_heads": N, "unidirectional": unidirectional}
    if sizes:
        attrs["qkv_hidden_sizes"] = sizes
    model, feeds = one_node_model("Attention", inputs, n_outputs=2 if past else 1, **attrs)
    assert_lowering_matches(model, feeds, rtol=1e-4, atol=1e-4)


def test_attention_scale_and_filter_value():
    inputs = [
        ("x", _r(B, S, 6)),
        ("w", _r(6, 3 * HID)),
        ("b", _r(3 * HID)),
        ("mask", _mask("raw", S)),
    ]
    attrs = {"num_heads": N, "scale": 0.3, "mask_filter_value": -50.0}
    model, feeds = one_node_model("Attention", inputs, **attrs)
    assert_lowering_matches(model, feeds, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize(
    ("kv_layout", "bias", "mask", "past", "attention_bias", "causal"),
    [
        ("bsd", False, None, 0, False, 0),
        ("bsd", True, None, 0, False, 0),
        pytest.param("bsd", True, "raw", 0, False, 0, marks=OLD_MHA_MASK),
        ("bsd", False, None, 3, True, 0),
        pytest.param("bsd", False, "raw", 3, False, 1, marks=OLD_MHA_MASK),
        ("bnsh", False, None, 0, False, 0),
    ],
)
def test_multi_head_attention(kv_layout, bias, mask, past, attention_bias, causal, dtype):
    kv_len = 3
    total = kv_len + past
    if kv_layout == "bnsh":
        key, value = _r(B, N, kv_len, HEAD, dtype=dtype), _r(B, N, kv_len, HEAD, dtype=dtype)
    else:
        key, value = _r(B, kv_len, HID, dtype=dtype), _r(B, kv_len, HID, dtype=dtype)
    inputs = [
        ("q", _r(B, S, HID, dtype=dtype)),
        ("k", key),
        ("v", value),
        ("bias", _r(3 * HID, dtype=dtype)) if bias else None,
        ("mask", _mask(mask, total)) if mask else None,
        ("ab", _r(B, N, S, total, dtype=dtype)) if attention_bias else None,
        ("pk", _r(B, N, past, HEAD, dtype=dtype)) if past else None,
        ("pv", _r(B, N, past, HEAD, dtype=dtype)) if past else None,
    ]
    model, feeds = one_node_model(
        "MultiHeadAttention", inputs, n_outputs=3 if past else 1, num_heads=N, unidirectional=causal
    )
    assert_lowering_matches(model, feeds, **_tol(dtype))


def _caches(dtype, half=HEAD // 2, positions=32):
    angles = np.arange(positions)[:, None] / (10000 ** (np.arange(half) / half))[None, :]
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize(
    ("past", "kv_heads", "packed", "rotary", "softcap"),
    [
        (0, 2, False, 0, 0.0),
        (0, 1, False, 0, 0.0),
        pytest.param(3, 1, False, 0, 0.0, marks=OLD_GQA_PAST),
        pytest.param(3, 2, True, 0, 0.0, marks=OLD_GQA_PAST),
        (0, 1, False, 1, 0.0),
        pytest.param(3, 1, False, 1, 0.0, marks=OLD_GQA_PAST),
        (2, 2, False, 0, 5.0),
    ],
)
def test_group_query_attention(past, kv_heads, packed, rotary, softcap, dtype):
    """onnxruntime takes a past with several new tokens for one sequence at a time, and
    rotary heads of a multiple of 16 features."""
    heads, head = 2 * N, 16 if rotary else HEAD
    batch = 1 if past else B
    total = past + S
    q = _r(batch, S, heads * head, dtype=dtype)
    k, v = (_r(batch, S, kv_heads * head, dtype=dtype) for _ in range(2))
    qkv = (
        [("q", np.concatenate([q, k, v], axis=-1)), None, None]
        if packed
        else [("q", q), ("k", k), ("v", v)]
    )
    cos, sin = _caches(dtype, head // 2)
    inputs = [
        *qkv,
        ("pk", _r(batch, kv_heads, past, head, dtype=dtype)),
        ("pv", _r(batch, kv_heads, past, head, dtype=dtype)),
        ("seqlens", np.full(batch, total - 1, dtype=np.int32)),
        ("total", np.array(total, dtype=np.int32)),
        *([("cos", cos), ("sin", sin)] if rotary else []),
    ]
    attrs = {"num_heads": heads, "kv_num_heads": kv_heads, "do_rotary": rotary}
    if softcap:
        attrs["softcap"] = softcap
    model, feeds = one_node_model("GroupQueryAttention", inputs, n_outputs=3, **attrs)
    assert_lowering_matches(model, feeds, **_tol(dtype))


def test_group_query_attention_first_prompt_padded_on_the_right():
    heads, kv_heads = 2, 1
    q, k, v = _r(B, S, heads * HEAD), _r(B, S, kv_heads * HEAD), _r(B, S, kv_heads * HEAD)
    inputs = [
        ("q", q),
        ("k", k),
        ("v", v),
        ("pk", _r(B, kv_heads, 0, HEAD)),
        ("pv", _r(B, kv_heads, 0, HEAD)),
        ("seqlens", np.array([S - 1, S - 3], dtype=np.int32)),
        ("total", np.array(S, dtype=np.int32)),
    ]
    model, feeds = one_node_model(
        "GroupQueryAttention", inputs, n_outputs=3, num_heads=heads, kv_num_heads=kv_heads
    )
    expected_rows = [(0, slice(None)), (1, slice(0, S - 2))]
    from tests.normalize.kernels import kernel_outputs, lowered_outputs

    want, got = kernel_outputs(model, feeds), lowered_outputs(model, feeds)
    for b, rows in expected_rows:
        np.testing.assert_allclose(got[0][b, rows], want[0][b, rows], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("past", [0, pytest.param(2, marks=OLD_GQA_PAST)])
def test_group_query_attention_packed_of_undeclared_width(past):
    """onnxruntime-genai's builder packs query, key and value into one input whose width
    no shape inference gives (its producer is a fused operator): split at run time."""
    heads, kv_heads = 2 * N, N
    batch = 1 if past else B
    inputs = [
        ("q", _r(batch, S, (heads + 2 * kv_heads) * HEAD)),
        None,
        None,
        ("pk", _r(batch, kv_heads, past, HEAD)),
        ("pv", _r(batch, kv_heads, past, HEAD)),
        ("seqlens", np.full(batch, past + S - 1, dtype=np.int32)),
        ("total", np.array(past + S, dtype=np.int32)),
    ]
    model, feeds = one_node_model(
        "GroupQueryAttention",
        inputs,
        n_outputs=3,
        num_heads=heads,
        kv_num_heads=kv_heads,
        scale=0.3,
    )
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "packed"
    assert_lowering_matches(model, feeds, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mask", ["end", "end_start"])
def test_attention_one_d_mask_of_dynamic_batch(mask):
    """A 1-D mask index of ends ``(B,)`` or ends and starts ``(2B,)`` whose sizes only the
    run knows: told apart at run time."""
    inputs = [("x", _r(B, S, 6)), ("w", _r(6, 3 * HID)), ("b", _r(3 * HID)), ("m", _mask(mask, S))]
    model, feeds = one_node_model("Attention", inputs, num_heads=N)
    for value in model.graph.input:
        value.type.tensor_type.shape.dim[0].dim_param = "batch"
    assert_lowering_matches(model, feeds, rtol=1e-4, atol=1e-4)
