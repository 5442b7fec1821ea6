"""Forward mode on models shipped in public wheels (see tests/realmodels): a paddle2onnx OCR
classifier (Conv, whose tangent transposes a ConvTranspose of unknown rank) and silero's
voice-activity detectors (STFT padding, ``If`` and ``LSTM``): ``onnx_jvp`` with respect to
every float input equals the central difference of the original model in float64 along a
random tangent."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnxgrad import onnx_jvp
from tests.realmodels.conftest import shipped_models  # noqa: F401  (the fixture)
from tests.realmodels.reference import Reference
from tests.realmodels.test_shipped_models import INPUTS, STEP, _direction, _feeds, _session

pytestmark = pytest.mark.slow

MODELS = [
    "ch_ppocr_mobile_v2.0_cls_infer.onnx",
    "silero_vad_16k_op15.onnx",
    "silero_vad_16k_sequence.onnx",
]


@pytest.mark.parametrize("name", MODELS)
def test_jvp_agrees_with_finite_differences(name, shipped_models):  # noqa: F811
    path = str(shipped_models[name])
    model = onnx.load(path)
    rng = np.random.default_rng(0)
    feeds = _feeds(model, INPUTS[name], rng)
    floats = [n for n, v in feeds.items() if v.dtype == np.float32]
    tangents = {n: _direction(rng, feeds[n]).astype(np.float32) for n in floats}
    jvp = onnx_jvp(path, inputs=floats)
    names = [o.name for o in jvp.graph.output]
    got = dict(zip(names, _session(jvp).run(None, {**feeds, **_tangent_feeds(tangents)})))
    reference = Reference(model)

    def moved(sign):
        shifted = {n: feeds[n].astype(np.float64) + sign * STEP * t for n, t in tangents.items()}
        return reference.run({**feeds, **shifted}, {})

    outputs = [o.name for o in model.graph.output]
    compared = 0
    for output, up, down in zip(outputs, moved(1.0), moved(-1.0)):
        if f"{output}_tangent" not in got:
            continue
        expected = (np.asarray(up, np.float64) - np.asarray(down, np.float64)) / (2 * STEP)
        scale = np.abs(expected).max() + 1e-8
        assert np.abs(got[f"{output}_tangent"] - expected).max() <= 2e-3 * scale, output
        compared += 1
    assert compared >= 1


def _tangent_feeds(tangents: dict) -> dict:
    return {f"{name}_tangent": value for name, value in tangents.items()}
