"""Second-order entries for the rules of the operators added with the function fallback's
companions (TopK, Compress, ReverseSequence, TensorScatter, ScatterElements max, CumProd,
Det, LpNormalization, LRN, BatchNormalization training, LpPool, MaxUnpool, Col2Im,
GridSample, DequantizeLinear, the SoftmaxCrossEntropyLoss weights): their gradient graphs
are differentiated again and checked against finite differences of the first derivative."""

from tests.derivative.autodiff import (
    cases_indexing,
    cases_linalg,
    cases_losses,
    cases_normalization,
    cases_pool,
    cases_quantization,
    cases_reduce,
    cases_sampling,
    cases_shape,
)
from tests.derivative.autodiff.gradcheck import second_order

IDS = {
    "TopK-largest-axis1", "Compress-short-condition", "ReverseSequence-batch-major",
    "TensorScatter-linear", "ScatterElements-max-distinct", "CumProd-inclusive-zero",
    "Det-3x3", "LpNormalization-axis0-opset22", "LRN-size3",
    "BatchNormalization-training-2d-y-only-opset14",
    "LpPool-2d-p3-strides-pads", "MaxUnpool-2d", "Col2Im-2d", "GridSample-linear-zeros",
    "DequantizeLinear-blocked-reference", "SoftmaxCrossEntropyLoss-mean-weights-wrt",
}  # fmt: skip

MODULES = [
    cases_indexing, cases_linalg, cases_losses, cases_normalization, cases_pool,
    cases_quantization, cases_reduce, cases_sampling, cases_shape,
]  # fmt: skip
CASES = [second_order(c) for m in MODULES for c in m.CASES if c.id in IDS]
assert len(CASES) == len(IDS), "a second-order id names no case"
