"""onnx-asr's log-mel feature extractors as its wheel ships them (OnnxScript exports, opset
17): Whisper's (reflect padding, ``STFT``, a clamp to the maximum minus 8), NeMo's (masked
pre-emphasis, per-feature normalisation) and Kaldi's (dithering off, a pre-emphasis written
as an edge ``Pad`` by ``(1, -1)``, the Povey window).

The gradient with respect to the waveform builds through ``STFT``, and, evaluated in float64
(float32 rounding moves Whisper's clamp at a few features), equals central differences of
the original file in float64 along a random direction; its float32 graph runs on
onnxruntime. These files have no default weight: the mel filterbank is a fixed transform.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxgrad import get_train_initializer, onnx_derivative
from tests.derivative.fd import to_double
from tests.realmodels.reference import Reference
from tests.realmodels.wheels import RegistryUnreachable, wheel_models

pytestmark = pytest.mark.slow

FILES = ("whisper80.onnx", "nemo80.onnx", "kaldi.onnx")
SAMPLES = 3000
STEP = 1e-6
RTOL = 1e-5


@pytest.fixture(scope="module")
def extractors() -> dict:
    try:
        paths = wheel_models("onnx-asr", "0.12.0")
    except RegistryUnreachable as error:
        pytest.skip(f"the package registry is unreachable: {error}")
    return {path.name: str(path) for path in paths if path.name in FILES}


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])


@pytest.mark.parametrize("name", FILES)
def test_waveform_gradient_against_finite_differences(name, extractors):
    path = extractors[name]
    assert get_train_initializer(path) == {}
    original = onnx.load(path)
    rng = np.random.default_rng(0)
    feeds = {
        "waveforms": (0.1 * rng.standard_normal((2, SAMPLES))).astype(np.float32),
        "waveforms_lens": np.array([SAMPLES, SAMPLES - 700], np.int64),
    }
    (features, _) = _session(original).run(None, feeds)
    seed = rng.standard_normal(features.shape)
    gradient = onnx_derivative(path)
    grad_feeds = {**feeds, "features_grad": seed}
    doubled = {
        k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in grad_feeds.items()
    }
    (wanted,) = _session(to_double(gradient)).run(["waveforms_grad"], doubled)
    float32 = {
        k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in grad_feeds.items()
    }
    (single,) = _session(gradient).run(["waveforms_grad"], float32)
    assert single.dtype == np.float32 and np.all(np.isfinite(single))
    assert np.abs(single - wanted).max() <= 5e-2 * np.abs(wanted).max()

    direction = rng.standard_normal(feeds["waveforms"].shape)
    reference = Reference(original)
    sums = []
    for sign in (1.0, -1.0):
        moved = {**feeds, "waveforms": feeds["waveforms"] + sign * STEP * direction}
        sums.append(float(np.sum(reference.run(moved, {})[0] * seed)))
    measured = (sums[0] - sums[1]) / (2 * STEP)
    predicted = float(np.sum(wanted * direction))
    assert abs(predicted - measured) <= RTOL * abs(measured), (predicted, measured)
