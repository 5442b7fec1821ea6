"""The numpy model of onnxruntime's u8s8 integer products (``integer_products``) against
onnxruntime's kernels on this CPU: exact with VNNI, int16-saturated pair sums without."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from tests.normalize.integer_products import (
    conv_patches,
    dynamic_quantized_matmul,
    exact_matmul,
    int16_saturated_matmul,
    requantize,
    saturation_slack,
    u8s8_kernel_path,
    weights_by_patch,
    with_exact_integer_products,
)
from tests.normalize.kernels import one_node_model, run

RNG = np.random.default_rng(37)


def _saturating_codes(m, k, n):
    """Random uint8 x int8 codes with a third of the rows of ``a`` at 255: many pairs of
    products beyond int16, some within."""
    a = RNG.integers(0, 256, (m, k), dtype=np.uint8)
    a[:, ::3] = 255
    return a, RNG.integers(-128, 128, (k, n), dtype=np.int8)


def _expect_this_cpus_sums(got, exact, saturated, slack):
    """``got`` is the exact sum on a CPU with VNNI, the int16-saturated one without; the
    inputs saturate, so the two differ and the check tells them apart."""
    assert (saturated != exact).any() and (slack > 0).any()
    path = u8s8_kernel_path()
    if path == "exact":
        np.testing.assert_array_equal(got, exact)
    elif path == "int16 pairs":
        np.testing.assert_array_equal(got, saturated)
    else:  # another architecture's kernels: within the bound
        assert (np.abs(got - exact) <= slack).all()


@pytest.mark.parametrize("weight_stored", [True, False], ids=["initializer", "input"])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 13, 40), (3, 8, 5), (2, 129, 33)])
def test_matmul_integer_is_the_model_of_this_cpu(m, k, n, weight_stored):
    """One row (onnxruntime's matrix-vector kernel), odd K, K past a 128-deep panel; the
    weight prepacked (an initializer) or not; zero points on both sides."""
    a, b = _saturating_codes(m, k, n)
    b_zero = RNG.integers(-5, 5, n, dtype=np.int8)
    model, feeds = one_node_model(
        "MatMulInteger",
        [("a", a), ("b", b), ("az", np.array(7, np.uint8)), ("bz", b_zero)],
        domain="",
        out_types=(np.int32,),
        initializers=("b", "az", "bz") if weight_stored else ("az", "bz"),
    )
    got = run(model, feeds)[0].astype(np.int64)
    exact, saturated = exact_matmul(a, b, 7, b_zero), int16_saturated_matmul(a, b, 7, b_zero)
    _expect_this_cpus_sums(got, exact, saturated, saturation_slack(a, b))


def test_matmul_integer_of_two_uint8_is_exact_on_every_cpu():
    """uint8 x uint8 products (16-bit operands, ``vpmaddwd``) are summed exactly, also where
    the same codes as int8 would saturate."""
    a, b = _saturating_codes(3, 9, 6)
    b = (b.astype(np.int16) + 128).astype(np.uint8)
    model, feeds = one_node_model(
        "MatMulInteger",
        [("a", a), ("b", b), ("az", np.array(3, np.uint8)), ("bz", np.array(128, np.uint8))],
        domain="",
        out_types=(np.int32,),
        initializers=("b", "az", "bz"),
    )
    assert (saturation_slack(a, (b.astype(np.int16) - 128).astype(np.int8)) > 0).any()
    np.testing.assert_array_equal(run(model, feeds)[0], exact_matmul(a, b, 3, 128))


@pytest.mark.parametrize("op", ["MatMulInteger", "DynamicQuantizeMatMul"])
def test_int8_weights_stored_as_uint8_sum_exactly(op):
    """``with_exact_integer_products``: the same products over uint8 codes, exact on every CPU
    (the zero point given per column, or absent)."""
    a, b = _saturating_codes(4, 10, 6)
    if op == "MatMulInteger":
        zero = RNG.integers(-5, 5, 6, dtype=np.int8)
        inputs = [("a", a), ("b", b), ("az", np.array(9, np.uint8)), ("bz", zero)]
        model, feeds = one_node_model(
            op, inputs, domain="", out_types=(np.int32,), initializers=("b", "az", "bz")
        )
        expected = exact_matmul(a, b, 9, zero)
    else:
        x = RNG.standard_normal(a.shape).astype(np.float32)
        scale = (RNG.random(6) * 0.1 + 0.01).astype(np.float32)
        model, feeds = one_node_model(
            op, [("x", x), ("b", b), ("s", scale)], initializers=("b", "s")
        )
        expected, slack = dynamic_quantized_matmul(x, b, scale)
        assert (slack > 0).any()
    exact = with_exact_integer_products(model)
    types = {i.name: i.data_type for i in exact.graph.initializer}
    assert [types[exact.graph.node[0].input[i]] for i in (1, 3)] == [TensorProto.UINT8] * 2
    np.testing.assert_allclose(run(exact, feeds)[0], expected, rtol=1e-6, atol=1e-6)
    if u8s8_kernel_path() == "exact":
        np.testing.assert_array_equal(run(exact, feeds)[0], run(model, feeds)[0])


def test_qlinear_conv_sums_rows_columns_channels():
    """onnxruntime's u8s8 convolution pairs the products of a receptive field in (rows,
    columns, channels) order, the zero point standing for the padding: its codes are the
    requantized model's of this CPU (within a tie's rounding)."""
    x = RNG.integers(0, 256, (1, 3, 6, 6), dtype=np.uint8)
    w = RNG.integers(-128, 128, (4, 3, 3, 3), dtype=np.int8)
    inputs = [
        ("x", x),
        ("xs", np.array(1.0, np.float32)),
        ("xz", np.array(128, np.uint8)),
        ("w", w),
        ("ws", np.array(1.0, np.float32)),
        ("wz", np.array(0, np.int8)),
        ("ys", np.array(300.0, np.float32)),
        ("yz", np.array(128, np.uint8)),
    ]
    model, feeds = one_node_model(
        "QLinearConv",
        inputs,
        domain="",
        out_types=(np.uint8,),
        initializers=("xs", "xz", "w", "ws", "wz", "ys", "yz"),
        pads=[1, 1, 1, 1],
    )
    got = run(model, feeds)[0].transpose(0, 2, 3, 1).astype(np.int64)
    patches, weights = conv_patches(x, (3, 3), 1, fill=128), weights_by_patch(w)
    exact, saturated = (
        requantize(f(patches, weights, 128), 1 / 300, 128)
        for f in (exact_matmul, int16_saturated_matmul)
    )
    assert (np.abs(saturated - exact) > 1).sum() > 10
    expected = saturated if u8s8_kernel_path() == "int16 pairs" else exact
    assert (np.abs(got - expected) <= 1).all()


def test_saturation_slack_bounds_the_model():
    a, b = _saturating_codes(6, 11, 7)
    slack = saturation_slack(a, b)
    difference = np.abs(int16_saturated_matmul(a, b, 3, -2) - exact_matmul(a, b, 3, -2))
    assert (difference <= slack).all() and (difference > 0).any()
    # one pair of 255 x -128: -65280, 32512 below int16's range; the other pairs within it
    a, b = np.full((1, 4), 255, np.uint8), np.array([[-128], [-128], [1], [-1]], np.int8)
    assert saturation_slack(a, b).tolist() == [[32512]]
    assert int16_saturated_matmul(a, b).tolist() == [[-32768]]
    assert not saturation_slack(a, b.astype(np.uint8)).any()  # u8u8 sums are exact
    assert not saturation_slack(a[:, :2] // 2, b[:2]).any()  # 2 x 127 x -128 fits


def test_model_of_an_odd_depth_pads_with_zero():
    a, b = _saturating_codes(2, 5, 3)
    padded = int16_saturated_matmul(np.pad(a, ((0, 0), (0, 1))), np.pad(b, ((0, 1), (0, 0))))
    np.testing.assert_array_equal(int16_saturated_matmul(a, b), padded)
