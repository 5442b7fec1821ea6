"""Array helpers that keep a tensor's shape exactly.

``numpy.ascontiguousarray`` returns an array of at least one dimension: a 0-d (scalar)
weight would silently become ``[1]`` on its way to an ``OrtValue``, a checkpoint or an
in-place update. :func:`c_contiguous` is the shape-preserving form used instead.
"""

from __future__ import annotations

import numpy as np


def c_contiguous(value, dtype=None) -> np.ndarray:
    """``value`` as a C-contiguous array of the same shape (0-d stays 0-d), copied only when
    its layout or ``dtype`` requires it."""
    return np.asarray(value, dtype=dtype, order="C")


__all__ = ["c_contiguous"]
