"""Integer matrix products as the ONNX specification defines them, and the error onnxruntime's
u8s8 kernels may add to them on x86-64 CPUs without VNNI.

The specification of ``MatMulInteger``, ``QLinearMatMul``, ``QLinearConv`` and onnxruntime's
``DynamicQuantizeMatMul`` and ``DynamicQuantizeLSTM`` is the exact sum
``C[m, n] = sum_k (A[m, k] - a0) (B[k, n] - b0)``.

onnxruntime's kernels (MLAS) multiply the raw codes and correct for the zero points with exact
row and column sums. With unsigned ``A`` and signed ``B`` (u8s8), on a CPU with AVX2 or
AVX-512BW but no VNNI, they multiply with ``vpmaddubsw``, which adds the two products of
adjacent rows ``2j`` and ``2j + 1`` of ``B`` into a *saturating* int16 before widening:
``raw[m, n] = sum_j sat16(A[m, 2j] B[2j, n] + A[m, 2j + 1] B[2j + 1, n])``. A pair of products
can reach ``2 * 255 * 128 = 65280``, beyond int16's 32767. With VNNI (``vpdpbusd``) or AMX,
and for u8u8 products (16-bit operands, ``vpmaddwd``), the sum is exact. The model was checked
equal to onnxruntime 1.19.2's and 1.32's kernels under ``qemu-x86_64 -cpu Haswell``;
``test_integer_products`` checks it against the kernels of the CPU the tests run on.
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

INT16_MIN, INT16_MAX = -(2**15), 2**15 - 1


def exact_matmul(a, b, a_zero=0, b_zero=0) -> np.ndarray:
    """``sum_k (a[..., k] - a_zero) (b[k, n] - b_zero)`` in int64 (zero points broadcast:
    ``b_zero`` per column or scalar)."""
    a64 = np.asarray(a, np.int64) - np.asarray(a_zero, np.int64)
    b64 = np.asarray(b, np.int64) - np.asarray(b_zero, np.int64)
    return a64 @ b64


def _pair_sums(a, b) -> np.ndarray:
    """``a[..., 2j] b[2j, n] + a[..., 2j + 1] b[2j + 1, n]`` of the raw codes, shape
    ``(..., ceil(K / 2), N)`` (an odd ``K`` padded with a zero row, as the kernels pad)."""
    a64, b64 = np.asarray(a, np.int64), np.asarray(b, np.int64)
    k = a64.shape[-1]
    if k % 2:
        a64 = np.concatenate([a64, np.zeros((*a64.shape[:-1], 1), np.int64)], axis=-1)
        b64 = np.concatenate([b64, np.zeros((1, *b64.shape[1:]), np.int64)], axis=0)
    products = a64[..., :, None] * b64  # (..., K, N)
    return products[..., 0::2, :] + products[..., 1::2, :]


def int16_saturated_matmul(a, b, a_zero=0, b_zero=0) -> np.ndarray:
    """The u8s8 product as ``vpmaddubsw`` computes it (AVX2, AVX-512BW without VNNI): the raw
    pair sums saturated to int16, then the zero points' exact corrections."""
    raw = np.clip(_pair_sums(a, b), INT16_MIN, INT16_MAX).sum(axis=-2)
    a64, b64 = np.asarray(a, np.int64), np.asarray(b, np.int64)
    a0, b0 = np.asarray(a_zero, np.int64), np.asarray(b_zero, np.int64)
    k = a64.shape[-1]
    return raw - a0 * b64.sum(axis=0) - a64.sum(axis=-1, keepdims=True) * b0 + k * a0 * b0


def saturation_slack(a, b) -> np.ndarray:
    """The largest ``|kernel - exact|`` a u8s8 kernel can give for each output:
    ``sum_j |p_j - sat16(p_j)|`` over the pair sums ``p_j``; zero where no pair saturates,
    and zero for unsigned ``b`` (u8u8 products are exact)."""
    if np.asarray(b).dtype == np.uint8:
        shape = (*np.shape(a)[:-1], np.shape(b)[-1])
        return np.zeros(shape, np.int64)
    pairs = _pair_sums(a, b)
    return np.abs(pairs - np.clip(pairs, INT16_MIN, INT16_MAX)).sum(axis=-2)


def dynamic_quantize(x) -> tuple[np.ndarray, np.float32, int]:
    """``DynamicQuantizeLinear`` as the ONNX specification defines it: uint8 codes, scale
    ``(max(0, x) - min(0, x)) / 255`` and zero point, rounding half to even."""
    low, high = min(0.0, float(np.min(x))), max(0.0, float(np.max(x)))
    scale = np.float32((high - low) / 255)
    zero = int(np.clip(np.rint(-low / scale), 0, 255))
    codes = np.clip(np.rint(np.asarray(x, np.float32) / scale) + zero, 0, 255)
    return codes.astype(np.uint8), scale, zero


def dynamic_quantized_matmul(x, weight, scale, zero=0) -> tuple[np.ndarray, np.ndarray]:
    """``x`` quantized by ``DynamicQuantizeLinear`` times an integer ``weight``, as
    ``MatMulInteger`` and ``DynamicQuantizeMatMul`` specify it, scaled once:
    ``(q_x - z_x) s_x (weight - zero) scale`` in float64; and the error onnxruntime's u8s8
    kernel may add to it on a CPU without VNNI, in the same units."""
    codes, x_scale, x_zero = dynamic_quantize(x)
    unit = np.float64(x_scale) * np.asarray(scale, np.float64)
    product = exact_matmul(codes, weight, x_zero, zero) * unit
    return product, saturation_slack(codes, weight) * unit


def requantize(accumulator, multiplier, zero) -> np.ndarray:
    """The uint8 codes ``sat(round(accumulator * multiplier) + zero)`` of a ``QLinear*``
    output, rounding half to even."""
    codes = np.rint(np.asarray(accumulator, np.float64) * multiplier) + zero
    return np.clip(codes, 0, 255)


def conv_patches(x, kernel: tuple[int, int], pads: int, fill) -> np.ndarray:
    """The receptive fields of a 2-D convolution (stride 1, one group) of ``x`` (NCHW), padded
    with ``fill`` (a quantized input's zero point), flattened in the order onnxruntime's
    u8s8 convolution sums them (rows, columns, channels): shape ``(N, OH, OW, KH * KW * C)``,
    to multiply by ``weights_by_patch(w)``."""
    wide = ((0, 0), (0, 0), (pads, pads), (pads, pads))
    padded = np.pad(np.asarray(x, np.int64), wide, constant_values=int(fill))
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernel, axis=(2, 3))
    return windows.transpose(0, 2, 3, 4, 5, 1).reshape(*windows.shape[:1], *windows.shape[2:4], -1)


def weights_by_patch(w) -> np.ndarray:
    """An OIHW weight as the ``(KH * KW * C, O)`` matrix that multiplies ``conv_patches``."""
    return np.asarray(w).transpose(2, 3, 1, 0).reshape(-1, np.shape(w)[0])


#: the products whose weight (input 1) and its zero point (input 3) may be int8
_INTEGER_PRODUCTS = {"MatMulInteger": 3, "DynamicQuantizeMatMul": 3}


def with_exact_integer_products(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose int8 weights of ``MatMulInteger`` and
    ``DynamicQuantizeMatMul`` are stored as uint8, codes and zero point shifted by 128: the
    same products, which onnxruntime sums exactly on every CPU (uint8 x uint8 kernels have
    16-bit operands), a reference for the lowering where the model's own u8s8 kernels
    saturate."""
    copy = onnx.ModelProto.FromString(model.SerializeToString())
    graph = copy.graph
    stored = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for node in graph.node:
        zero_at = _INTEGER_PRODUCTS.get(node.op_type)
        weight = stored.get(node.input[1]) if zero_at is not None else None
        if weight is None or weight.dtype != np.int8:
            continue
        inputs = [*node.input, *[""] * (zero_at + 1 - len(node.input))]
        zero = stored[inputs[zero_at]] if inputs[zero_at] else np.zeros((), np.int8)
        for index, value in ((1, weight), (zero_at, zero)):
            name = f"{node.name or node.output[0]}_uint8_{index}"
            shifted = (value.astype(np.int16) + 128).astype(np.uint8)
            graph.initializer.append(numpy_helper.from_array(shifted, name))
            inputs[index] = name
        del node.input[:]
        node.input.extend(inputs)
    return copy


def cpu_flags() -> set[str]:
    """The CPU's integer dot-product features as the process sees them (``cpuid`` through
    numpy's dispatcher, which an emulator's CPU model also sets), in /proc/cpuinfo's names;
    /proc/cpuinfo adds what numpy does not name (avx_vnni, amx_int8)."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:  # numpy 1.x
        from numpy.core._multiarray_umath import __cpu_features__ as features
    names = {"AVX2": "avx2", "AVX512F": "avx512f", "AVX512BW": "avx512bw"}
    names["AVX512VNNI"] = "avx512_vnni"
    flags = {flag for key, flag in names.items() if features.get(key)}
    cpuinfo = Path("/proc/cpuinfo")
    if "avx2" in flags and cpuinfo.exists():
        listed = next((ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags")), "")
        flags |= {"avx_vnni", "amx_int8"} & set(listed.split())
    return flags


def u8s8_kernel_path() -> str:
    """How onnxruntime's u8s8 kernels sum products on this CPU: ``"int16 pairs"`` on an x86-64
    CPU with AVX2 (or AVX-512BW) but neither VNNI nor AMX, ``"exact"`` on one with either,
    ``"unknown"`` elsewhere (other architectures have kernels of their own)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "unknown"
    flags = cpu_flags()
    if flags & {"avx512_vnni", "avx_vnni", "amx_int8"}:
        return "exact"
    return "int16 pairs" if "avx2" in flags else "unknown"
