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
