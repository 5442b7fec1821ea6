"""basic-pitch 0.4.0's ``nmp.onnx`` (tf2onnx, opset 15) cut after its front end: a constant-Q
transform (a lowpass ``Conv`` of stride 2 between octaves, reflect ``Pad``, strided ``Conv``
with the real and imaginary kernels, ``Sqrt`` of the summed squares, a length
normalisation), then ``log(|X|^2 + eps)`` rescaled to ``[0, 1]`` by the spectrogram's
``ReduceMin`` and ``ReduceMax``.

Issue 30 suspected a rule on this path: the full model's gradient with respect to the
constant-Q kernels is 0.3 % away from float64 differences even in float64. Cut here, the
gradient with respect to the front end's weights, evaluated in float64, equals central
differences of the cut file in float64 along a random direction to about 1e-8; the
disagreement of the whole model comes from its three ``Relu`` (activations that change
sign within the difference step: docs/real-models.md, note (4)), not from a rule.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import onnx_derivative
from onnxgrad.graph import select_model_inputs_outputs
from onnxgrad.normalize import normalized_model
from tests.derivative.fd import to_double
from tests.realmodels.reference import FIXED_OPS, Reference
from tests.realmodels.wheels import RegistryUnreachable, wheel_models

pytestmark = pytest.mark.slow

#: the rescaled log-magnitude spectrogram, input of the CNN.
FRONT_END = "model_1/normalized_log_1/div_no_nan;model_1/normalized_log_1/div_no_nan3"
#: the real and imaginary constant-Q kernels, the octave lowpass filter, the lengths.
WEIGHTS = (
    "const_fold_opt__664",
    "const_fold_opt__655",
    "const_fold_opt__734",
    "model_1/cq_t2010v2_1/Sqrt;model_1/cq_t2010v2_1/Sqrt",
)
SAMPLES = 43844  # fixed by the file's reshapes
STEP = 1e-7
RTOL64 = 1e-6
RTOL32 = 2e-3


@pytest.fixture(scope="module")
def front_end():
    try:
        paths = wheel_models("basic-pitch", "0.4.0")
    except RegistryUnreachable as error:
        pytest.skip(f"the package registry is unreachable: {error}")
    path = next(str(p) for p in paths if p.name == "nmp.onnx")
    cut = select_model_inputs_outputs(normalized_model(path), [FRONT_END])
    gradient = onnx_derivative(cut, weights=list(WEIGHTS), inputs=[])
    rng = np.random.default_rng(0)
    audio = (0.3 * rng.standard_normal((1, SAMPLES, 1))).astype(np.float32)
    reference = Reference(cut)
    (spectrogram,) = reference.run({cut.graph.input[0].name: audio}, {})
    seed = rng.standard_normal(spectrogram.shape)
    return cut, gradient, audio, seed, reference


def _feeds(cut, gradient, audio, seed, dtype) -> dict:
    weights = {i.name: numpy_helper.to_array(i) for i in cut.graph.initializer}
    feeds = {
        cut.graph.input[0].name: audio,
        **{w: weights[w] for w in WEIGHTS},
        f"{FRONT_END}_grad": seed,
    }
    names = {i.name for i in gradient.graph.input}
    return {k: np.asarray(v).astype(dtype) for k, v in feeds.items() if k in names}


def _difference(reference, cut, audio, seed, weight, direction) -> float:
    """``(s(w + h v) - s(w - h v)) / 2h`` for ``s(w) = <seed, spectrogram(w)>``."""
    base = reference.weight(weight)
    values = []
    for sign in (1.0, -1.0):
        moved = {weight: base + sign * STEP * direction}
        (spectrogram,) = reference.run({cut.graph.input[0].name: audio}, moved)
        values.append(float(np.sum(spectrogram * seed)))
    return (values[0] - values[1]) / (2 * STEP)


@pytest.fixture(scope="module")
def gradients(front_end) -> tuple[dict, dict]:
    """The weights' gradients: float64 (onnx's reference evaluator), float32 (onnxruntime)."""
    cut, gradient, audio, seed, _ = front_end
    names = [o.name for o in gradient.graph.output]
    evaluator = ReferenceEvaluator(to_double(gradient), new_ops=FIXED_OPS)
    exact = evaluator.run(None, _feeds(cut, gradient, audio, seed, np.float64))
    session = ort.InferenceSession(gradient.SerializeToString(), providers=["CPUExecutionProvider"])
    single = session.run(names, _feeds(cut, gradient, audio, seed, np.float32))
    return dict(zip(names, exact)), dict(zip(names, single))


@pytest.mark.parametrize("weight", WEIGHTS)
def test_front_end_weight_gradient_agrees_with_differences(front_end, gradients, weight):
    cut, _, audio, seed, reference = front_end
    base = reference.weight(weight)
    rng = np.random.default_rng(1)
    direction = rng.standard_normal(base.shape) * np.sqrt(np.mean(np.square(base)))
    measured = _difference(reference, cut, audio, seed, weight, direction)
    exact, single = (float(np.sum(g[f"{weight}_grad"] * direction)) for g in gradients)
    assert abs(exact - measured) <= RTOL64 * abs(measured), (weight, exact, measured)
    assert abs(single - measured) <= RTOL32 * abs(measured), (weight, single, measured)
