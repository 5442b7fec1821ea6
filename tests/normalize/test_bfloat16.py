"""bfloat16 models: onnxruntime's CPU provider lacks their arithmetic kernels, normalisation
computes them in float32 rounding each result to bfloat16; the reference is numpy doing
exactly that (ml_dtypes' bfloat16), and the float32 model's gradient."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto

from onnxgrad.normalize import normalized_model
from onnxgrad.normalize.bfloat16 import bfloat16_in_float32
from onnxgrad.training import SquareLearningLoss, generate_artifacts, load_train_step
from onnxgrad.training.step.composition import loss_gradient, make_loss_model
from tests.models import cast_mlp_model

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = ml_dtypes.bfloat16
RNG = np.random.default_rng(0)
WEIGHTS = {
    "w1": (RNG.standard_normal((6, 5)) * 0.5).astype(BF16),
    "b1": (RNG.standard_normal(5) * 0.5).astype(BF16),
    "w2": (RNG.standard_normal((5, 2)) * 0.5).astype(BF16),
}
X = RNG.standard_normal((8, 6)).astype(np.float32)
LABEL = RNG.standard_normal((8, 2)).astype(np.float32)


def _mlp(elem: int, float_io: bool = True):
    """``y = tanh(x w1 + b1) w2`` computed in ``elem``, float32 inputs and outputs
    (``float_io``) or ``elem`` ones."""
    io = TensorProto.FLOAT if float_io else elem
    weights = {
        k: v.astype(np.float32) if elem == TensorProto.FLOAT else v for k, v in WEIGHTS.items()
    }
    return cast_mlp_model(weights, elem, io)


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_onnxruntime_lacks_bfloat16_arithmetic_and_the_rewrite_runs():
    model = _mlp(TensorProto.BFLOAT16)
    with pytest.raises(Exception, match="Could not find an implementation"):
        _session(model)
    got = _session(normalized_model(model)).run(None, {"x": X})[0]

    def r(a):
        return a.astype(BF16).astype(np.float32)

    w = {k: v.astype(np.float32) for k, v in WEIGHTS.items()}
    h = r(r(r(X) @ w["w1"]) + w["b1"])
    expected = r(r(np.tanh(h)) @ w["w2"])
    np.testing.assert_array_equal(got, expected)


def test_the_rewrite_keeps_a_model_without_bfloat16_and_is_idempotent():
    float32 = _mlp(TensorProto.FLOAT)
    assert bfloat16_in_float32(float32) is float32
    once = normalized_model(_mlp(TensorProto.BFLOAT16))
    assert normalized_model(once).SerializeToString() == once.SerializeToString()


def test_master_weight_gradient_agrees_with_the_float32_model():
    names = list(WEIGHTS)
    feeds = {"x": X, "label": LABEL, **{k: v.astype(np.float32) for k, v in WEIGHTS.items()}}

    def gradient(model):
        lm = make_loss_model(model, SquareLearningLoss(), weights=names, label_name="label")
        return _session(loss_gradient(lm)).run(None, feeds)

    got = gradient(_mlp(TensorProto.BFLOAT16))
    expected = gradient(_mlp(TensorProto.FLOAT))
    for name, g, e in zip([*names, "loss"], got, expected):
        assert g.dtype == np.float32, name
        assert np.abs(g - e).max() / np.abs(e).max() < 1e-2, name  # 3.4e-3 measured


def test_a_loss_on_a_bfloat16_output_computes_in_float32():
    """The loss model of a model with bfloat16 inputs and outputs: only casts read or write
    bfloat16 (onnxruntime's Python API cannot feed bfloat16 arrays to run it)."""
    import onnx

    lm = make_loss_model(_mlp(TensorProto.BFLOAT16, float_io=False), SquareLearningLoss())
    assert lm.model.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    inferred = onnx.shape_inference.infer_shapes(loss_gradient(lm)).graph
    types = {i.name: i.type.tensor_type.elem_type for i in (*inferred.input, *inferred.value_info)}
    for node in inferred.node:
        if node.op_type not in ("Cast", "Constant"):
            read = [n for n in (*node.input, *node.output) if types.get(n) == TensorProto.BFLOAT16]
            assert not read, (node.op_type, read)


def test_bfloat16_model_trains_through_artifacts_without_loss_scaling(tmp_path):
    art = generate_artifacts(
        _mlp(TensorProto.BFLOAT16), optimizer="adam", learning_rate=0.02, folder=tmp_path
    )
    step = load_train_step(tmp_path)
    assert "loss_scale" not in step.state
    assert all(v.dtype == np.float32 for v in art.checkpoint.weights.values())
    session = ort.InferenceSession(
        str(art.path("training_model.onnx")), providers=["CPUExecutionProvider"]
    )
    values = {**art.checkpoint.weights, **art.checkpoint.optimizer_state}
    losses = []
    for _ in range(30):
        feeds = {"x": X, "label": LABEL, "learning_rate": np.array(0.02, np.float32)}
        loss, *new = session.run(None, {**feeds, **values})
        values = dict(zip([*step.weights, *step.state], new))
        losses.append(float(loss))
    assert losses[-1] < 0.3 * losses[0]
