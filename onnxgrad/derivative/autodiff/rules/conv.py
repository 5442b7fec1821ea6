r"""Conv and ConvTranspose (1-D to 3-D, strides, pads, ``auto_pad``, dilations, groups,
``output_padding``/``output_shape``), gradients made of Conv, ConvTranspose and data movement.

For ``y = conv(x, w) + b`` with strides :math:`s`, dilations :math:`d` and begin pads
:math:`p` (padded input :math:`\tilde x`)

.. math::
    y[n, m, o] = \sum_{c, j} w[m, c, j]\, \tilde x[n, g(m) C_g + c, o s + j d] + b[m]

* ``x_bar`` is the transposed convolution of ``g`` by ``w``, cropped to ``x``: a
  ``ConvTranspose`` whose pads and ``output_padding`` land exactly on ``x``'s shape (an input
  size that the strides do not divide leaves trailing positions no window reads: zeros);
* ``w_bar[m, c, j] = sum_{n, o} g[n, m, o] x~[n, g(m) C_g + c, o s + j d]``: with static
  sizes, an im2col contracted with ``g`` by GEMMs: on small outputs with many channels the
  patches come from one Conv of every channel by one-hot kernels (one GEMM after it), else
  from one slice of the padded ``x`` per kernel offset ``j`` (strided positions read from a
  polyphase view), per group; otherwise a
  convolution of ``x`` (batch and channels swapped, groups moved into the channels) by ``g``
  with strides :math:`d` and dilations :math:`s`;
* ``b_bar`` sums ``g`` over every axis but the channels.

ConvTranspose is the adjoint of that Conv: ``x_bar`` is the Conv of ``g`` by ``w`` and
``w_bar`` is the weight gradient above with the roles of input and output swapped.

Grouped transposed convolutions other than depthwise with one channel per group (which the
onnx reference evaluator computes wrongly) are emitted as a grouped Conv of ``g``, dilated by
the strides, with the flipped kernel regrouped to ``(C, M / G, k)``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from onnxgrad.derivative.autodiff.builder import GradBuilder, NodeView
from onnxgrad.derivative.autodiff.registry import register
from onnxgrad.derivative.autodiff.rules._lowering import Lowering
from onnxgrad.derivative.autodiff.rules._nn_helpers import (
    INT64_MAX,
    Vec,
    all_but_channel,
    as_tensor,
    crop_to,
    dims,
    extents,
    ints_attr,
    is_static,
    pad_spatial,
    same_pads,
    shape_slice,
    spatial_axes,
    spatial_rank,
    swap_batch_and_channels,
    unsupported,
    vadd,
    vdiv,
    vmax,
    vmul,
    vsub,
    window_pads,
)

INT64_MIN = -INT64_MAX - 1


@dataclass(frozen=True)
class Window:
    """Geometry of a convolution along its ``k`` spatial axes."""

    k: int
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    group: int
    kernel: Vec
    begin: Vec
    end: Vec

    @property
    def rank(self) -> int:
        return self.k + 2

    def extents(self, b: GradBuilder) -> Vec:
        return extents(b, self.kernel, self.dilations)

    def conv_attrs(self) -> dict:
        return {
            "strides": list(self.strides),
            "dilations": list(self.dilations),
            "group": self.group if self.group > 1 else None,
        }


def _geometry(b: GradBuilder, node: NodeView, x: str, w: str) -> tuple:
    k = spatial_rank(b, node, x, w)
    kernel = tuple(node.attr("kernel_shape", ())) or dims(b, w)
    return (
        k,
        ints_attr(node, "strides", 1, k),
        ints_attr(node, "dilations", 1, k),
        node.attr("group", 1),
        kernel,
    )


@register("Conv", since=11)
def conv_grad(b, node, grads, needs):
    (g,) = grads
    x, w = node.inputs[0], node.inputs[1]
    k, strides, dilations, group, kernel = _geometry(b, node, x, w)
    ext = extents(b, kernel, dilations)
    x_sizes, y_sizes = dims(b, x), dims(b, node.outputs[0])
    begin, end = window_pads(b, node, k, x_sizes, ext, strides)
    win = Window(k, strides, dilations, group, kernel, begin, end)
    gx = conv_input_grad(b, g, w, win, x_sizes, y_sizes) if needs[0] else None
    gw = _conv_weight_grad(b, x, g, win, x_sizes, y_sizes) if needs[1] else None
    gb = _bias_grad(b, g, win) if len(needs) > 2 and needs[2] else None
    return [gx, gw, gb]


@register("ConvTranspose", since=11)
def conv_transpose_grad(b, node, grads, needs):
    (g,) = grads
    x, w = node.inputs[0], node.inputs[1]
    k, strides, dilations, group, kernel = _geometry(b, node, x, w)
    ext = extents(b, kernel, dilations)
    x_sizes, y_sizes = dims(b, x), dims(b, node.outputs[0])
    output_padding = ints_attr(node, "output_padding", 0, k)
    begin, end = _transpose_pads(b, node, k, x_sizes, ext, strides, output_padding)
    win = Window(k, strides, dilations, group, kernel, begin, end)
    gb = _bias_grad(b, g, win) if len(needs) > 2 and needs[2] else None
    if node.attr("output_shape") and not (isinstance(end, tuple) and min(end) >= 0):
        g, y_sizes = _drop_appended(b, g, x_sizes, strides, vadd(b, output_padding, ext), k)
        # a dynamic split divides by truncation: total = -1 gives begin -1, not 0
        win = Window(k, strides, dilations, group, kernel, vmax(b, begin, 0), vmax(b, end, 0))
    gx = _conv_transpose_input_grad(b, g, w, win, x_sizes, output_padding) if needs[0] else None
    gw = _conv_weight_grad(b, g, x, win, y_sizes, x_sizes) if needs[1] else None
    return [gx, gw, gb]


def _drop_appended(b: GradBuilder, g: str, x_sizes: Vec, strides, tail: Vec, k: int):
    """An ``output_shape`` one beyond the full output ``s (in - 1) + op + ext`` appends
    outputs (the bias only) that depend on no input or weight: the gradient is cropped to
    the full output first (a no-op Slice where the sizes are dynamic and it does not)."""
    full = vadd(b, vmul(b, vsub(b, x_sizes, 1), tuple(strides)), tail)
    cropped = b.op("Slice", g, b.ints([0] * k), as_tensor(b, full), b.ints(spatial_axes(k)))
    return cropped, full if is_static(full) else dims(b, cropped)


def _bias_grad(b: GradBuilder, g: str, win: Window) -> str:
    return b.reduce_sum(g, all_but_channel(win.rank), keepdims=False)


def _transpose_pads(b, node, k, x_sizes, ext, strides, output_padding) -> tuple[Vec, Vec]:
    """ConvTranspose pads; with ``output_shape`` or SAME, ``total = s (in - 1) + op + ext - out``
    is split as the ONNX specification says."""
    auto_pad = node.attr("auto_pad", "NOTSET")
    output_shape = node.attr("output_shape")
    if output_shape or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        s = tuple(strides)
        target = tuple(output_shape[-k:]) if output_shape else vmul(b, x_sizes, s)
        natural = vadd(b, vmul(b, vsub(b, x_sizes, 1), s), vadd(b, output_padding, ext))
        total = vsub(b, natural, target)
        # up to s - 1 beyond the full output, onnxruntime and the onnx reference evaluator
        # append outputs (the bias only) at the end; further beyond they refuse; with
        # SAME_UPPER, or SAME_LOWER more than one beyond, they disagree
        beyond = isinstance(total, tuple) and min(total) < 0
        what = "output_shape" if output_shape else f"the {auto_pad} output"
        agreed = {"SAME_UPPER": 0, "SAME_LOWER": 1}.get(auto_pad)
        if beyond and agreed is not None and min(total) < -agreed:
            raise unsupported(
                node,
                f"{what} {list(target)} more than {agreed} beyond the full output "
                f"{list(natural)} with auto_pad={auto_pad!r} (onnxruntime and the onnx "
                f"reference evaluator disagree)",
            )
        if beyond and any(-t > st - 1 for t, st in zip(total, s)):
            raise unsupported(
                node,
                f"{what} {list(target)} exceeds the full output {list(natural)} by more than "
                f"strides - 1 = {[st - 1 for st in s]} (onnxruntime and the onnx reference "
                f"evaluator refuse it)",
            )
        return same_pads(b, "SAME_UPPER" if auto_pad == "SAME_UPPER" else "SAME_LOWER", total)
    if auto_pad == "VALID":
        return (0,) * k, (0,) * k
    if auto_pad not in ("NOTSET", ""):
        raise unsupported(node, f"auto_pad={auto_pad!r}")
    pads = ints_attr(node, "pads", 0, 2 * k)
    return pads[:k], pads[k:]


# -- gradient of the convolution input: a transposed convolution --------------------------------
def conv_input_grad(b: GradBuilder, g: str, w: str, win: Window, x_sizes: Vec, y_sizes: Vec) -> str:
    """The transposed convolution of ``g`` (spatial sizes ``y_sizes``) by ``w``, exactly of
    spatial sizes ``x_sizes``: the gradient of a Conv's input."""
    if not _transpose_is_portable(b, w, win.group):
        return _correlate_transposed(b, g, w, win, x_sizes, y_sizes)
    ext = win.extents(b)
    full = vadd(b, vmul(b, vsub(b, y_sizes, 1), win.strides), ext)
    if is_static(full, x_sizes, win.begin):
        excess = vsub(b, vsub(b, full, win.begin), x_sizes)
        end = tuple(max(e, 0) for e in excess)
        output_padding = [max(-e, 0) for e in excess]
        return b.op(
            "ConvTranspose", g, w, pads=[*win.begin, *end],
            output_padding=output_padding if any(output_padding) else None, **win.conv_attrs(),
        )  # fmt: skip
    z = b.op("ConvTranspose", g, w, **win.conv_attrs())
    return crop_to(b, z, win.begin, x_sizes, None, win.k)


def _transpose_is_portable(b: GradBuilder, w: str, group: int) -> bool:
    """Whether a grouped ConvTranspose by ``w`` maps one channel to one channel per group."""
    if group == 1:
        return True
    shape = b.shape(w)
    return shape is not None and tuple(shape[:2]) == (group, 1)


def _correlate_transposed(
    b: GradBuilder, g: str, w: str, win: Window, x_sizes: Vec, y_sizes: Vec
) -> str:
    """The transposed convolution as a Conv: ``g`` with ``s - 1`` zeros after each element,
    padded by ``ext - 1`` on both sides, correlated with the flipped, regrouped kernel."""
    u, u_sizes = _dilate(b, g, win, y_sizes)
    kernel = _flip_and_regroup(b, w, win)
    halo = vsub(b, win.extents(b), 1)
    if is_static(u_sizes, halo, win.begin, x_sizes):
        begin = vsub(b, halo, win.begin)
        end = vsub(b, vadd(b, x_sizes, win.begin), u_sizes)
        if min(begin + end) >= 0:
            return b.op("Conv", u, kernel, pads=[*begin, *end], **_unit_stride(win))
    if is_static(halo):
        z = b.op("Conv", u, kernel, pads=[*halo, *halo], **_unit_stride(win))
    else:
        z = b.op("Conv", pad_spatial(b, u, halo, halo, win.k), kernel, **_unit_stride(win))
    z_sizes = vadd(b, u_sizes, halo) if is_static(u_sizes, halo) else None
    return crop_to(b, z, win.begin, x_sizes, z_sizes, win.k)


def _unit_stride(win: Window) -> dict:
    return {"dilations": list(win.dilations), "group": win.group if win.group > 1 else None}


def _dilate(b: GradBuilder, g: str, win: Window, y_sizes: Vec) -> tuple[str, Vec]:
    """``g`` with ``s - 1`` zeros inserted after every element along each spatial axis."""
    if all(s == 1 for s in win.strides):
        return g, y_sizes
    k = win.k
    spread = b.unsqueeze(g, [3 + 2 * i for i in range(k)])
    trailing = [v for s in win.strides for v in (0, s - 1)]
    spread = b.op("Pad", spread, b.ints([0] * (2 + 2 * k) + [0, 0, *trailing]))
    sizes = vmul(b, y_sizes, win.strides)
    return b.op("Reshape", spread, _shape_with_spatial(b, [0, 0], sizes)), sizes


def _flip_and_regroup(b: GradBuilder, w: str, win: Window) -> str:
    """``w`` of shape ``(M, C_g, k)`` -> flipped kernel of shape ``(C, M_g, k)``."""
    k, group = win.k, win.group
    axes = spatial_axes(k)
    flipped = b.op(
        "Slice", w, b.ints([-1] * k), b.ints([INT64_MIN] * k), b.ints(axes), b.ints([-1] * k)
    )
    shape = b.shape(w)
    static = shape is not None and all(isinstance(d, int) for d in shape)
    if static:
        blocks = b.ints([group, shape[0] // group, *shape[1:]])
    else:
        blocks = b.op("Concat", b.ints([group, -1]), shape_slice(b, w, 1), axis=0)
    swapped = b.op("Transpose", b.op("Reshape", flipped, blocks), perm=[0, 2, 1, *range(3, k + 3)])
    if static:
        merged = b.ints([shape[1] * group, shape[0] // group, *shape[2:]])
    else:
        merged = b.op("Concat", b.ints([-1]), shape_slice(b, swapped, 2), axis=0)
    return b.op("Reshape", swapped, merged)


# -- gradient of ConvTranspose's input: the forward convolution -------------------------------
def _conv_transpose_input_grad(
    b: GradBuilder, g: str, w: str, win: Window, x_sizes: Vec, output_padding
) -> str:
    if is_static(win.begin, win.end):
        z = b.op("Conv", g, w, pads=[*win.begin, *win.end], **win.conv_attrs())
    else:
        z = b.op("Conv", pad_spatial(b, g, win.begin, win.end, win.k), w, **win.conv_attrs())
    if all(p < s for p, s in zip(output_padding, win.strides)):
        return z
    starts = (0,) * win.k
    return b.op(
        "Slice", z, as_tensor(b, starts), as_tensor(b, x_sizes), b.ints(spatial_axes(win.k))
    )


# -- gradient of the kernel -------------------------------------------------------------------
def _conv_weight_grad(
    b: GradBuilder, image: str, grad: str, win: Window, image_sizes: Vec, grad_sizes: Vec
) -> str:
    """``w_bar[m, c, j] = sum_{n, o} grad[n, m, o] image~[n, g(m) C_g + c, o s + j d]``."""
    layout = _gemm_layout(b, image, grad, win, image_sizes, grad_sizes)
    if layout == "patches":
        return _weight_grad_by_patches(b, image, grad, win, image_sizes, grad_sizes)
    if layout is None:
        return _weight_grad_by_conv(b, image, grad, win, image_sizes, grad_sizes)
    return _weight_grad_by_gemm(b, image, grad, win, image_sizes, grad_sizes, layout)


def _channels(b: GradBuilder, name: str) -> int | None:
    shape = b.shape(name)
    return shape[1] if shape is not None and isinstance(shape[1], int) else None


#: the largest output area (positions per image) for which the patches layout is chosen
PATCHES_MAX_AREA = 64


def _gemm_layout(b: GradBuilder, image, grad, win: Window, image_sizes, grad_sizes) -> str | None:
    """How to contract the kernel gradient (chosen from onnxruntime 1.19 CPU timings, one
    thread): with many channels and at most :data:`PATCHES_MAX_AREA` output positions (the
    deep layers of a CNN), ``'patches'``, an im2col by one Conv and one GEMM (resnet18's
    shapes, batch 4: 512 channels on 2x2 1.9 ms against 8.4 ms per offset, 256 on 4x4 1.2
    against 1.8, 3x3 stride 2 to 8x8 0.6 against 1.0, 1x1 stride 2 0.12 against 0.34; on
    16x16 the GEMMs per offset stay faster, 1.3 against 1.7 ms; a pointwise kernel without
    stride or pad needs no im2col); else one GEMM per kernel
    offset when the offsets are one or the channels per group many, one GEMM over the
    stacked columns for few channels and small kernels, else (or with sizes known only at
    run time) ``None``: a Conv, which suits few channels with large kernels."""
    if not is_static(win.kernel, image_sizes, grad_sizes, win.begin, win.end):
        return None
    if _channels(b, image) is None or _channels(b, grad) is None:
        return None
    offsets = int(np.prod(win.kernel))
    many = _channels(b, image) // win.group >= 16
    pointwise = offsets == 1 and all(s == 1 for s in win.strides) and not any(win.begin + win.end)
    small = int(np.prod(grad_sizes)) <= PATCHES_MAX_AREA
    if win.group == 1 and many and small and not pointwise:
        return "patches"
    if offsets == 1 or _channels(b, image) // win.group >= 16:
        return "per_offset"
    return "stacked" if offsets <= 16 else None


def _weight_grad_by_gemm(
    b: GradBuilder, image, grad, win: Window, image_sizes, grad_sizes, layout: str
) -> str:
    """im2col by slices: column ``j`` holds ``image~[n, c, j d + o s]`` as a ``(C, N O)``
    matrix; ``w_bar[:, :, j] = grad (M, N O) @ column_j^T`` group by group, by a product per
    column or one over all of them stacked."""
    group, kernel = win.group, list(win.kernel)
    channels, outputs = _channels(b, image), _channels(b, grad)
    rows = b.op("Reshape", swap_batch_and_channels(b, grad, win.rank), b.ints([0, -1]))
    columns = _im2col(b, image, win, image_sizes, grad_sizes, channels)
    if group == 1:
        if layout == "per_offset":
            parts = [b.unsqueeze(b.op("Gemm", rows, c, transB=1), [2]) for c in columns]
            z = parts[0] if len(parts) == 1 else b.op("Concat", *parts, axis=2)
        else:
            stacked = b.op("Concat", *[b.unsqueeze(c, [1]) for c in columns], axis=1)
            flat = b.op("Reshape", stacked, b.ints([channels * len(columns), -1]))
            z = b.op("Gemm", rows, flat, transB=1)
        return b.op("Reshape", z, b.ints([0, -1, *kernel]))
    per_group = channels // group
    rows_t = b.op(
        "Transpose", b.op("Reshape", rows, b.ints([group, outputs // group, -1])), perm=[0, 2, 1]
    )
    if layout == "per_offset":
        by_group = b.ints([group, per_group, -1])
        parts = [
            b.unsqueeze(b.op("MatMul", b.op("Reshape", c, by_group), rows_t), [3]) for c in columns
        ]
        z = parts[0] if len(parts) == 1 else b.op("Concat", *parts, axis=3)
        z = b.op("Transpose", z, perm=[0, 2, 1, 3])
    else:
        stacked = b.op("Concat", *[b.unsqueeze(c, [1]) for c in columns], axis=1)
        flat = b.op("Reshape", stacked, b.ints([group, per_group * len(columns), -1]))
        z = b.op("MatMul", flat, rows_t)
        z = b.op("Reshape", z, b.ints([group, per_group, len(columns), -1]))
        z = b.op("Transpose", z, perm=[0, 3, 1, 2])
    return b.op("Reshape", z, b.ints([outputs, per_group, *kernel]))


def _im2col(b: GradBuilder, image, win: Window, image_sizes, grad_sizes, channels) -> list[str]:
    """One ``(C, N O)`` matrix per kernel offset. Strided positions are read contiguously
    from a polyphase view: the padded image reshaped to ``(C, N, Q_1, s_1, ...)``,
    transposed to ``(s_1, ..., C, N, Q_1, ...)`` and its phases merged (which also keeps
    onnxruntime's optimizer from moving the transpose after the slices), where offset ``t``
    is phase ``t mod s``, blocks ``t div s`` onwards."""
    k, strides = win.k, win.strides
    reach = vadd(b, vmul(b, vsub(b, grad_sizes, 1), strides), win.extents(b))
    padded_sizes = tuple(-(-r // s) * s for r, s in zip(reach, strides))
    tail = tuple(p - n - first for p, n, first in zip(padded_sizes, image_sizes, win.begin))
    if min(tail) < 0:
        kept = [n + min(t, 0) for n, t in zip(image_sizes, tail)]
        image = b.op("Slice", image, b.ints([0] * k), b.ints(kept), b.ints(spatial_axes(k)))
        tail = tuple(max(t, 0) for t in tail)
    padded = pad_spatial(b, image, win.begin, tail, k)
    blocks = tuple(p // s for p, s in zip(padded_sizes, strides))
    unit = all(s == 1 for s in strides)
    if unit:
        phased, axes = swap_batch_and_channels(b, padded, win.rank), spatial_axes(k)
    else:
        split = [0, 0, *itertools.chain.from_iterable(zip(blocks, strides))]
        perm = [3 + 2 * i for i in range(k)] + [1, 0] + [2 + 2 * i for i in range(k)]
        phased = b.op("Transpose", b.op("Reshape", padded, b.ints(split)), perm=perm)
        merged = [int(np.prod(strides)), channels, -1, *blocks]
        phased = b.op("Reshape", phased, b.ints(merged))
        axes = [0, *range(3, k + 3)]
    columns = []
    for offset in itertools.product(*(range(n) for n in win.kernel)):
        first = [j * d for j, d in zip(offset, win.dilations)]
        block = [t // s for t, s in zip(first, strides)]
        ends = [q + o for q, o in zip(block, grad_sizes)]
        if unit:
            starts, whole = block, not any(block) and tuple(ends) == blocks
        else:
            phase = int(np.ravel_multi_index([t % s for t, s in zip(first, strides)], strides))
            starts, ends, whole = [phase, *block], [phase + 1, *ends], False
        column = phased
        if not whole:
            column = b.op("Slice", phased, b.ints(starts), b.ints(ends), b.ints(axes))
        columns.append(b.op("Reshape", column, b.ints([channels, -1])))
    return columns


def _weight_grad_by_conv(
    b: GradBuilder, image: str, grad: str, win: Window, image_sizes: Vec, grad_sizes: Vec
) -> str:
    """A Conv over ``image`` (batch as channels, groups moved into them) by ``grad`` (batch
    as input channels), strides and dilations swapped."""
    rank, k = win.rank, win.k
    image_t = _channels_first_by_group(b, image, win, image_sizes)
    grad_t = swap_batch_and_channels(b, grad, rank)
    attrs = {
        "strides": list(win.dilations),
        "dilations": list(win.strides),
        "group": win.group if win.group > 1 else None,
    }
    ext = win.extents(b)
    if is_static(image_sizes, grad_sizes, ext, win.begin, win.end):
        used = vadd(b, vmul(b, vsub(b, grad_sizes, 1), win.strides), ext)
        unused = vsub(b, vadd(b, vadd(b, image_sizes, win.begin), win.end), used)
        trimmed = tuple(min(e, r) for e, r in zip(win.end, unused))
        end = vsub(b, win.end, trimmed)
        extra = vdiv(b, vsub(b, unused, trimmed), win.dilations)
        z = b.op("Conv", image_t, grad_t, pads=[*win.begin, *end], **attrs)
        if any(extra):
            z = b.op("Slice", z, b.ints([0] * k), b.ints(list(win.kernel)), b.ints(spatial_axes(k)))
    else:
        if is_static(win.begin, win.end):
            z = b.op("Conv", image_t, grad_t, pads=[*win.begin, *win.end], **attrs)
        else:
            padded = pad_spatial(b, image_t, win.begin, win.end, k)
            z = b.op("Conv", padded, grad_t, **attrs)
        z = b.op("Slice", z, b.ints([0] * k), as_tensor(b, win.kernel), b.ints(spatial_axes(k)))
    return swap_batch_and_channels(b, z, rank)


def _channels_first_by_group(b: GradBuilder, x: str, win: Window, sizes: Vec) -> str:
    """``(N, G C_g, *sp)`` -> ``(C_g, G N, *sp)``: group ``g`` reads channels ``g N + n``."""
    if win.group == 1:
        return swap_batch_and_channels(b, x, win.rank)
    channels = _channels(b, x)  # C_g named, not -1, where known: Reshape cannot infer it at N = 0
    per_group = -1 if channels is None else channels // win.group
    split = _shape_with_spatial(b, [0, win.group, per_group], sizes)
    t = b.op("Transpose", b.op("Reshape", x, split), perm=[2, 1, 0, *range(3, win.k + 3)])
    return b.op("Reshape", t, _shape_with_spatial(b, [0, -1], sizes))


def _shape_with_spatial(b: GradBuilder, head: list[int], sizes: Vec) -> str:
    if is_static(sizes):
        return b.ints([*head, *sizes])
    return b.op("Concat", b.ints(head), sizes, axis=0)


def _weight_grad_by_patches(
    b: GradBuilder, image, grad, win: Window, image_sizes, grad_sizes
) -> str:
    """im2col as one Conv, then one GEMM: ``patches[n, c, j, o] = image~[n, c, o s + j d]``
    is every channel of ``image`` (batch and channels merged) convolved with the one-hot
    kernels of the ``J`` offsets with the forward's strides, dilations and pads; then
    ``w_bar (M, C J) = grad (M, N O) @ patches (C J, N O)^T`` (``group == 1``)."""
    channels, outputs = _channels(b, image), _channels(b, grad)
    offsets = int(np.prod(win.kernel))
    area = int(np.prod(grad_sizes))
    one_hot = b.const(np.eye(offsets).reshape((offsets, 1, *win.kernel)), like=image)
    merged = b.op("Reshape", image, b.ints([-1, 1, *image_sizes]))
    patches = b.op(
        "Conv", merged, one_hot, pads=[*win.begin, *win.end], strides=list(win.strides),
        dilations=list(win.dilations),
    )  # fmt: skip
    by_image = b.op("Reshape", patches, b.ints([-1, channels * offsets, area]))
    columns = _channels_major(b, by_image, channels * offsets)
    rows = _channels_major(b, b.op("Reshape", grad, b.ints([0, outputs, area])), outputs)
    z = b.op("Gemm", rows, columns, transB=1)
    return b.op("Reshape", z, b.ints([outputs, channels, *win.kernel]))


def _channels_major(b: GradBuilder, x: str, rows: int) -> str:
    """``(N, R, O)`` -> ``(R, N O)``."""
    return b.op("Reshape", b.op("Transpose", x, perm=[1, 0, 2]), b.ints([rows, -1]))


# -- DeformConv -------------------------------------------------------------------------------
@register("DeformConv", since=19)
def deform_conv_grad(b, node, grads, needs):
    r"""2-D DeformConv lowered to standard operators (:mod:`._lowering`): kernel tap ``k`` of
    output ``o`` reads ``x`` at ``q = o s - p + k d + \delta_{k,o}`` (``\delta`` the offsets
    of its offset group) by bilinear interpolation, each of the four corners outside the
    image counting 0, times ``mask[k, o]``; then a grouped GEMM with ``w`` plus ``B``:

    .. math:: y[m, o] = \sum_{c,k} w[m,c,k]\, \mathrm{mask}[k,o]
              \sum_{corners\ r} \omega_r(q)\, x[c, r] + B[m]

    with ``\omega`` the products of ``1 - |q - r|`` per axis. Its derivative (``x``, ``w``,
    ``B``, ``mask``, and the offsets through the weights ``\omega``, which are piecewise
    linear in ``q``) is the engine's, through Gather, Mul and MatMul. Static shapes only."""
    x, w, offset = node.inputs[:3]
    bias, mask = node.input(3), node.input(4)
    shapes = [b.static_shape(v) for v in (x, w, offset)]
    if any(s is None for s in shapes) or len(shapes[0]) != 4:
        raise unsupported(node, "a DeformConv other than 2-D with static shapes")
    (n, c, height, width), (m, c_per_group, kh, kw), (_, _, oh, ow) = shapes
    group, groups = node.attr("group", 1), node.attr("offset_group", 1)
    pads, strides = ints_attr(node, "pads", 0, 4), ints_attr(node, "strides", 1, 2)
    dilations = ints_attr(node, "dilations", 1, 2)
    taps, area, channels = kh * kw, oh * ow, c // groups
    grid = np.indices((kh, kw, oh, ow)).reshape(4, taps, area)
    base_y = grid[2] * strides[0] - pads[0] + grid[0] * dilations[0]
    base_x = grid[3] * strides[1] - pads[1] + grid[1] * dilations[1]

    low = Lowering(b, node)
    deltas = low.op("Reshape", offset, low.ints([n, groups, taps, 2, area]))
    ys = low.op("Add", low.op("Gather", deltas, low.ints(0), axis=3), low.const(base_y))
    xs = low.op("Add", low.op("Gather", deltas, low.ints(1), axis=3), low.const(base_x))
    pixels = low.op("Reshape", x, low.ints([-1]))
    planes = np.arange(n * groups * channels).reshape(n, groups, channels, 1) * height * width
    columns = _bilinear_zero_outside(
        low, pixels, ys, xs, (height, width), [n, groups, 1, -1], low.ints(planes)
    )
    if mask is not None:
        columns = low.op("Mul", columns, low.op("Reshape", mask, low.ints([n, groups, 1, -1])))
    columns = low.op("Reshape", columns, low.ints([n, group, c_per_group * taps, area]))
    kernel = low.op("Reshape", w, low.ints([group, m // group, c_per_group * taps]))
    product = low.op("MatMul", kernel, columns)
    if bias is None:
        low.op("Reshape", product, low.ints([n, m, oh, ow]), output=node.outputs[0])
    else:
        shaped = low.op("Reshape", product, low.ints([n, m, oh, ow]))
        low.op("Add", shaped, low.op("Reshape", bias, low.ints([1, m, 1, 1])),
               output=node.outputs[0])  # fmt: skip
    return low.gradients(grads, needs)


def _bilinear_zero_outside(low: Lowering, pixels, ys, xs, size, weight_shape, planes) -> str:
    """``sum_r omega_r(y, x) image[r]`` over the four corners ``r`` around each ``(y, x)``,
    a corner outside the ``size`` image counting 0 (GridSample with zero padding and aligned
    corners). ``pixels`` is the input flattened, ``planes`` the flat offsets of the images
    (one per channel) each point reads; the weights and the corner offsets within an image
    are reshaped to ``weight_shape`` to broadcast against ``planes``. One flat Gather per
    corner (the reference GatherElements handles at most 64 positions per axis)."""
    height, width = size
    y0, x0 = low.op("Floor", ys), low.op("Floor", xs)
    ly, lx = low.op("Sub", ys, y0), low.op("Sub", xs, x0)
    one = low.const(1.0)
    hy, hx = low.op("Sub", one, ly), low.op("Sub", one, lx)
    total = None
    for dy, dx, wy, wx in [(0, 0, hy, hx), (0, 1, hy, lx), (1, 0, ly, hx), (1, 1, ly, lx)]:
        yc = y0 if dy == 0 else low.op("Add", y0, one)
        xc = x0 if dx == 0 else low.op("Add", x0, one)
        inside = low.op("And", _within(low, yc, height - 1), _within(low, xc, width - 1))
        flat = low.op(
            "Add",
            low.op("Mul", low.clamp(yc, 0, height - 1), low.const(float(width))),
            low.clamp(xc, 0, width - 1),
        )
        index = low.op("Add", low.to_index(low.op("Reshape", flat, low.ints(weight_shape))), planes)
        values = low.op("Gather", pixels, index, axis=0)
        weight = low.op("Mul", low.op("Mul", wy, wx), low.to_float(inside))
        term = low.op("Mul", values, low.op("Reshape", weight, low.ints(weight_shape)))
        total = term if total is None else low.op("Add", total, term)
    return total


def _within(low: Lowering, t: str, high: int) -> str:
    """``0 <= t <= high``."""
    below = low.op("Less", t, low.const(0.0))
    above = low.op("Greater", t, low.const(float(high)))
    return low.op("Not", low.op("Or", below, above))
