r"""onnxruntime's ``RotaryEmbedding`` (``com.microsoft``) lowered to standard ONNX.

The halves (or, ``interleaved``, the even and odd features) ``(x_1, x_2)`` of the first
``d`` features of each head become ``(x_1 c - x_2 s,\ x_2 c + x_1 s)``, ``c, s`` the rows of
``cos_cache``/``sin_cache`` at each token's position (``position_ids`` of shape ``(B, S)``, or
one start offset); the other features pass through. ``d`` is twice the caches' width.
"""

from __future__ import annotations

from onnxgrad.normalize.lowering import Lowerer


def lower_rotary_embedding(lw: Lowerer) -> None:
    x, positions, cos_cache, sin_cache = (lw.input(i) for i in range(4))
    if lw.attr("is_packed_batching", 0):
        raise lw.error("packed batching is not supported")
    rank = lw.rank(x)
    cos, sin = _rotary_tables(lw, x, positions, cos_cache, sin_cache, rank)
    rotary_dim = _rotary_dim(lw, cos_cache)
    heads = x
    if rank == 3:
        heads = lw.op("Reshape", x, lw.ints([0, 0, -1, _head_size(lw, x)]))
        cos, sin = lw.unsqueeze(cos, [2]), lw.unsqueeze(sin, [2])
    else:
        cos, sin = lw.unsqueeze(cos, [1]), lw.unsqueeze(sin, [1])
    rotated = rotate(lw, heads, cos, sin, rotary_dim, lw.attr("interleaved", 0))
    if rank == 3:
        lw.op("Reshape", rotated, lw.op("Shape", x), out=lw.output(0))
    else:
        lw.op("Identity", rotated, out=lw.output(0))


def _head_size(lw: Lowerer, x: str) -> int:
    heads = lw.attr("num_heads", 0)
    dims = lw.dims(x)
    if heads and dims and dims[-1]:
        return dims[-1] // heads
    rotary = lw.attr("rotary_embedding_dim", 0)
    if not heads and rotary == 0:
        cache = lw.dims(lw.input(2))
        if cache and cache[-1]:
            return 2 * cache[-1]
    raise lw.error("the head size of a 3-D input needs num_heads and a static hidden size")


def _rotary_dim(lw: Lowerer, cos_cache: str) -> int:
    dims = lw.dims(cos_cache)
    if not dims or not dims[-1]:
        raise lw.error("the rotary dimension needs a cos_cache of static width")
    return 2 * dims[-1]


def _rotary_tables(lw, x, positions, cos_cache, sin_cache, rank):
    """The cache rows at each token's position, shaped ``(B, S, d/2)``."""
    dims = lw.dims(positions)
    if dims is not None and len(dims) == 1:
        seq_axis = 1 if rank == 3 else 2
        length = lw.op("Gather", lw.op("Shape", x), lw.ints([seq_axis]), axis=0)
        start = lw.op("Squeeze", positions, lw.ints([0]))
        steps = lw.op(
            "Range", start, lw.op("Add", start, lw.op("Squeeze", length, lw.ints([0]))), lw.ints(1)
        )
        positions = lw.unsqueeze(steps, [0])
    return lw.op("Gather", cos_cache, positions), lw.op("Gather", sin_cache, positions)


def rotate(lw: Lowerer, x: str, cos: str, sin: str, rotary_dim: int, interleaved: int) -> str:
    head = lw.op("Shape", x)
    width = lw.op("Gather", head, lw.ints([-1]), axis=0)
    part = lw.slice_last(x, 0, rotary_dim)
    if interleaved:
        x1 = lw.slice_last(part, 0, rotary_dim, 2)
        x2 = lw.slice_last(part, 1, rotary_dim, 2)
    else:
        x1 = lw.slice_last(part, 0, rotary_dim // 2)
        x2 = lw.slice_last(part, rotary_dim // 2, rotary_dim)
    y1 = lw.op("Sub", lw.op("Mul", x1, cos), lw.op("Mul", x2, sin))
    y2 = lw.op("Add", lw.op("Mul", x2, cos), lw.op("Mul", x1, sin))
    if interleaved:
        pairs = lw.op("Concat", lw.unsqueeze(y1, [-1]), lw.unsqueeze(y2, [-1]), axis=-1)
        shape = lw.op("Shape", part)
        rotated = lw.op("Reshape", pairs, shape)
    else:
        rotated = lw.op("Concat", y1, y2, axis=-1)
    rest = lw.op("Slice", x, lw.ints([rotary_dim]), width, lw.ints([-1]))
    return lw.op("Concat", rotated, rest, axis=-1)
