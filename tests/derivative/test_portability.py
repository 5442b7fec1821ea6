"""Native gradient graphs run on the newest inference-only onnxruntime (a separate venv: the
training and inference wheels cannot share one) and on the onnx reference evaluator, with
the same values as onnxruntime-training's session."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx.reference import ReferenceEvaluator

from onnxgrad import DerivativeOptions, add_loss_output, onnx_derivative
from tests.models import seed004_model, tanh_mlp_loss_model

INFERENCE_PYTHON = os.environ.get("ONNXGRAD_INFERENCE_PYTHON")

RUNNER = """
import importlib.util, sys
import numpy as np
import onnxruntime as ort
assert importlib.util.find_spec("onnxruntime.training") is None, "not an inference-only wheel"
model, feeds_path, out_path = sys.argv[1:]
feeds = dict(np.load(feeds_path))
session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
outputs = session.run(None, feeds)
np.savez(out_path, **{o.name: v for o, v in zip(session.get_outputs(), outputs)})
print(ort.__version__)
"""


def seed004_gradient():
    x = np.array([[0, 0], [1, 0], [0, 1], [1, 1], [2, 2]], dtype=np.float32)
    loss_model = add_loss_output(seed004_model())
    grad = onnx_derivative(
        loss_model, options=DerivativeOptions.FillGrad | DerivativeOptions.KeepOutputs
    )
    label = np.array([[-1.0], [-2.5], [1.6666701], [0.16667008], [1.6666799]], np.float32)
    feeds = {
        "x": x,
        "label": label,
        "init": np.array([[2, 3]], np.float32),
        "init_1": np.array([[0.5, 0.33333]], np.float32),
        "init_b10": np.array([1], np.float32),
    }
    return grad, {i.name: feeds[i.name] for i in grad.graph.input}


def tanh_mlp_gradient():
    model, weights = tanh_mlp_loss_model(dtype=np.float32)
    grad = onnx_derivative(model, inputs=["X"], options=DerivativeOptions.Loss)
    rng = np.random.default_rng(0)
    feeds = {
        "X": rng.standard_normal((7, 3)).astype(np.float32),
        "label": rng.standard_normal((7, 1)).astype(np.float32),
        **weights,
    }
    return grad, feeds


def tanh_mlp_hessian_vector_product():
    grad, feeds = tanh_mlp_gradient()
    hvp = onnx_derivative(grad, weights=[], inputs=["W1", "b1", "W2", "b2"])
    rng = np.random.default_rng(1)
    shapes = {f"{name}_grad_grad": value.shape for name, value in feeds.items()}
    shapes["loss_grad"] = ()
    for info in hvp.graph.input:
        if info.name not in feeds:
            feeds[info.name] = rng.standard_normal(shapes[info.name]).astype(np.float32)
    return hvp, feeds


CASES = {
    "seed004": seed004_gradient,
    "tanh-mlp": tanh_mlp_gradient,
    "tanh-mlp-hvp": tanh_mlp_hessian_vector_product,
}


def _run_in_process(model, feeds):
    session = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_evaluator_agrees_with_onnxruntime(name):
    model, feeds = CASES[name]()
    expected = _run_in_process(model, feeds)
    got = ReferenceEvaluator(model).run(None, feeds)
    for output, value in zip(model.graph.output, got):
        np.testing.assert_allclose(value, expected[output.name], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(
    not INFERENCE_PYTHON,
    reason="ONNXGRAD_INFERENCE_PYTHON (an inference-only venv) is set by `python3 dev.py test`",
)
@pytest.mark.parametrize("name", sorted(CASES))
def test_inference_only_onnxruntime_runs_native_gradients(name, tmp_path):
    model, feeds = CASES[name]()
    model_path, feeds_path, out_path = (tmp_path / f for f in ("g.onnx", "in.npz", "out.npz"))
    onnx.save(model, model_path)
    np.savez(feeds_path, **feeds)
    completed = subprocess.run(
        [INFERENCE_PYTHON, "-c", RUNNER, str(model_path), str(feeds_path), str(out_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    version = tuple(int(p) for p in completed.stdout.split()[-1].split(".")[:2])
    assert version > (1, 19), f"expected a newer inference wheel, got {completed.stdout}"
    got = dict(np.load(out_path))
    expected = _run_in_process(model, feeds)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-5)


@pytest.mark.ort_training
def test_sys_executable_is_the_training_wheel():
    assert onnxruntime.__version__ == "1.19.2", sys.executable
