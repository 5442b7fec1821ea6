"""onnx reference operators that keep float64 where the reference rounds to float32, for
oracles that finite differences in float64 can trust (the rule table and the coverage
harness, ``benchmarks/coverage_ops.py``, share them).

``GridSample`` rounds its pixel coordinates to float32 (sampling positions off by ~1e-7,
difference quotients of ``DeformConv``'s offsets off by 1e-2); ``DeformConv`` samples with it.
"""

from __future__ import annotations

import numpy as np
from onnx.reference.ops import op_deform_conv, op_grid_sample


class GridSample(op_grid_sample.GridSample):
    """The reference GridSample, its pixel coordinates kept in float64."""

    op_domain = ""

    def _gs_denormalize_coordinates(self, n, dims, align_corners: bool):
        values = [self._gs_denormalize(n=v, length=d, align_corners=align_corners)
                  for v, d in zip(n, dims)]  # fmt: skip
        return np.array(values, dtype=np.float64)


class DeformConv(op_deform_conv.DeformConv):
    """The reference DeformConv, sampling with the float64 :class:`GridSample`."""

    op_domain = ""

    def _run(self, *args, **kwargs):
        original = op_deform_conv.op_grid_sample.GridSample
        op_deform_conv.op_grid_sample.GridSample = GridSample
        try:
            return super()._run(*args, **kwargs)
        finally:
            op_deform_conv.op_grid_sample.GridSample = original
