"""Rule table entries: STFT (real and complex signals, onesided or not, with a window or a
frame length, overlapping and disjoint frames, a frame step that leaves samples over), the
gradients of the signal and the window; and the second order through the rule's graph (the
JVP by transposition)."""

import numpy as np

from tests.derivative.autodiff.gradcheck import OpCase, second_order

rng = np.random.default_rng(17)


def stft(id, length, channels, step, frame, window=True, onesided=1, batch=2, **changes):
    inputs = {
        "signal": rng.standard_normal((batch, length, channels)),
        "frame_step": np.array(step, np.int64),
        "window": rng.uniform(0.2, 1.0, frame) if window else None,
        "frame_length": None if window else np.array(frame, np.int64),
    }
    if inputs["frame_length"] is None:
        del inputs["frame_length"]
    return OpCase(
        "STFT", inputs, {"onesided": onesided}, opset=17, dynamic_shapes=False,
        id=f"STFT-{id}", **changes,
    )  # fmt: skip


REAL_OVERLAP = stft("real-window-overlap", 20, 1, 3, 8)

# fmt: off
CASES = [
    REAL_OVERLAP,
    stft("real-odd-frame-leftover", 19, 1, 4, 7, batch=1),
    stft("real-frame-length-twosided", 16, 1, 5, 6, window=False, onesided=0),
    stft("real-disjoint-frames", 18, 1, 6, 6, onesided=0),
    stft("complex-window-twosided", 14, 2, 2, 5, onesided=0),
    stft("complex-frame-length", 12, 2, 3, 4, window=False, onesided=0),
    second_order(REAL_OVERLAP, rtol=1e-4, atol=1e-5),
    second_order(stft("complex-overlap", 10, 2, 2, 4, onesided=0, batch=1),
                 rtol=1e-4, atol=1e-5),
]
# fmt: on


def dft(id, shape, opset=17, length=None, axis=None, fed=False, **attrs):
    """DFT of a random input: the axis as an attribute before opset 20, an input after (a
    graph input fed at run time with ``fed``)."""
    inputs = {"input": rng.standard_normal(shape)}
    if length is not None or (opset >= 20 and axis is not None):
        inputs["dft_length"] = None if length is None else np.array(length, np.int64)
    if opset >= 20 and axis is not None:
        inputs["axis"] = np.array(axis, np.int64)
    elif axis is not None:
        attrs["axis"] = axis
    return OpCase(
        "DFT", inputs, attrs, opset=opset, dynamic_shapes=False, id=f"DFT-{id}",
        fed=("axis",) if fed else (),
    )  # fmt: skip


REAL_DFT = dft("real-onesided", (2, 6, 1), onesided=1)

CASES += [
    REAL_DFT,
    dft("complex", (2, 5, 2)),
    dft("complex-inverse-axis2", (1, 3, 4, 2), axis=2, inverse=1),
    dft("real-padded", (2, 4, 1), length=6),
    dft("complex-cut-axis-input", (2, 3, 5, 2), opset=20, length=3, axis=-2),
    dft("real-axis1-opset20", (1, 4, 3, 1), opset=20, axis=1, onesided=1),
    second_order(REAL_DFT, rtol=1e-4, atol=1e-5),
]

# the transposed transform (a DFT of the output gradient): an axis fed at run time, and the
# real inverse of half a spectrum (irfft, Hermitian weights), even and odd lengths
IRFFT = dft("irfft", (2, 4, 3, 2), opset=17, axis=1, inverse=1, onesided=1)
RUN_TIME_RFFT = dft("rfft-run-time-axis", (2, 5, 3, 1), opset=20, axis=1, fed=True, onesided=1)
CASES += [
    IRFFT,
    dft("irfft-odd-length", (1, 3, 4, 2), opset=20, axis=-3, length=5, inverse=1, onesided=1),
    dft("irfft-cut", (2, 5, 2), opset=17, axis=1, length=4, inverse=1, onesided=1),
    dft("irfft-padded", (2, 3, 3, 2), opset=18, axis=2, length=7, inverse=1, onesided=1),
    dft("complex-cut-run-time-axis", (2, 5, 3, 2), opset=20, axis=1, length=3, fed=True),
    dft("real-padded-run-time-axis", (2, 3, 1), opset=20, axis=-2, length=5, fed=True),
    dft("complex-run-time-axis", (2, 3, 4, 2), opset=20, axis=2, fed=True),
    dft("real-run-time-negative-axis", (2, 4, 3, 1), opset=20, axis=-3, fed=True),
    dft("inverse-run-time-axis", (1, 4, 3, 2), opset=20, axis=1, fed=True, inverse=1),
    RUN_TIME_RFFT,
    dft("rfft-run-time-axis-even", (2, 6, 1), opset=20, axis=-2, fed=True, onesided=1),
    dft("irfft-run-time-axis", (1, 3, 4, 2), opset=20, axis=1, fed=True, inverse=1, onesided=1),
    second_order(IRFFT, rtol=1e-4, atol=1e-5),
    second_order(RUN_TIME_RFFT, rtol=1e-4, atol=1e-5),
]
