"""The forms onnxruntime's tools make of a tiny BERT classifier and a tiny Llama-like LM
differentiate: the gradient with respect to the input embeddings agrees with central finite
differences of the deployed file run by onnxruntime (float32 forms, 4-bit weights), with the
float32 model's gradient (float16), or with it up to the quantization error (int8 and QDQ
activations, differentiated with the straight-through estimator)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnxgrad import onnx_derivative
from onnxgrad.normalize import normalized_model
from tests.derivative.fd import numerical_vjp
from tests.normalize import deployed
from tests.normalize.integer_products import u8s8_kernel_path, with_exact_integer_products
from tests.normalize.kernels import run

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

FD_FORMS = ("float32", "opt1", "opt2", "int4")


def _input_gradient(model: onnx.ModelProto, feeds, seed) -> np.ndarray:
    gradient = onnx_derivative(model, inputs=["inputs_embeds"], weights=[])
    declared = {i.name for i in gradient.graph.input}
    values = {k: v for k, v in {**feeds, "logits_grad": seed}.items() if k in declared}
    names = [o.name for o in gradient.graph.output]
    return dict(zip(names, run(gradient, values), strict=True))["inputs_embeds_grad"]


def _finite_differences(model: onnx.ModelProto, feeds, seed) -> np.ndarray:
    import onnxruntime as ort

    others = {k: v for k, v in feeds.items() if k != "inputs_embeds"}
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])

    def function(values):
        x = np.asarray(values["inputs_embeds"], dtype=np.float32)
        return [session.run(None, {**others, "inputs_embeds": x})[0].astype(np.float64)]

    point = {"inputs_embeds": feeds["inputs_embeds"]}
    return numerical_vjp(function, point, ["inputs_embeds"], [seed], eps=1e-3)["inputs_embeds"]


def _relative(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("kind", ["bert", "llama"])
@pytest.mark.parametrize(
    "form",
    [
        *deployed.FORMS[:3],
        "float16",
        *deployed.FORMS[4:],
    ],
)
def test_input_gradient_of_deployed_form(forms, kind, form):
    model = onnx.load(forms(kind, form))
    feeds = deployed.feeds(kind)
    outputs = run(model, feeds)[0]
    lowered = run(normalized_model(model), feeds)[0]
    if form == "int8":  # the exact integer sums: the kernels of CPUs without VNNI saturate
        exact = run(with_exact_integer_products(model), feeds)[0]
        if u8s8_kernel_path() == "exact":
            np.testing.assert_array_equal(outputs, exact)
        outputs = exact
    np.testing.assert_allclose(lowered, outputs, rtol=2e-3, atol=2e-3)
    seed = np.random.default_rng(1).standard_normal(outputs.shape).astype(np.float32)
    got = _input_gradient(model, feeds, seed)
    if form in FD_FORMS:
        assert _relative(got, _finite_differences(model, feeds, seed)) < 2e-3
        return
    reference = _input_gradient(onnx.load(forms(kind, "float32")), feeds, seed)
    bound = 1e-2 if form == "float16" else 5e-2
    assert _relative(got, reference) < bound


@pytest.mark.parametrize("kind", ["bert", "llama"])
@pytest.mark.parametrize("form", deployed.FORMS)
def test_normalising_a_deployed_form_twice_changes_nothing(forms, kind, form):
    """``add_lora`` then ``generate_artifacts`` normalise in turn: the second pass must find
    every lowered operator lowered (an extra straight-through term would double a derivative,
    an extra stop-gradient grow the graph)."""
    once = normalized_model(onnx.load(forms(kind, form)))
    assert normalized_model(once).SerializeToString() == once.SerializeToString()


@pytest.mark.parametrize("kind", ["bert", "llama"])
@pytest.mark.parametrize("form", deployed.FORMS)
def test_lora_fine_tuning_of_deployed_form(forms, kind, form, tmp_path):
    """add_lora, generate_artifacts, then plain onnxruntime steps: the loss falls, and the
    merged checkpoint runs (int8: its adapters kept over the untouched int8 weights; int8,
    QDQ and 4-bit: also merged with re-quantization in the base's own format). The
    artifacts' inference model and the merged ones hold the deployed file's operators. Static
    quantization clamps each output to its calibrated range (the tiny BERT's logits to
    +-0.024), so the QDQ form's target moves by a fraction of the output's magnitude, not by
    an absolute amount it could not reach."""
    import onnxruntime as ort

    from onnxgrad import add_lora
    from onnxgrad.training import (
        Checkpoint,
        generate_artifacts,
        load_train_step,
        merge_checkpoint,
        save_checkpoint,
    )

    model = onnx.load(forms(kind, form))
    art = generate_artifacts(add_lora(model, rank=4), optimizer="adam", artifact_directory=tmp_path)
    inference = onnx.load(art.path("inference_model.onnx"))
    deployed.assert_deployed_form(model, inference, beside=True)
    step = load_train_step(tmp_path)
    feeds = deployed.feeds(kind)
    outputs = run(model, feeds)[0]
    shift = np.random.default_rng(2).standard_normal((1,)).astype(np.float32)
    target = outputs + (shift * np.abs(outputs).max() if form == "qdq" else shift)
    session = ort.InferenceSession(
        str(art.path("training_model.onnx")), providers=["CPUExecutionProvider"]
    )
    values = {**art.checkpoint.weights, **art.checkpoint.optimizer_state}
    declared = {i.name for i in session.get_inputs()}
    losses = []
    for _ in range(15):
        batch = {**feeds, "label": target, "learning_rate": np.array(0.01, np.float32), **values}
        loss, *new = session.run(
            [step.loss, *step.new_weights, *step.new_state],
            {k: v for k, v in batch.items() if k in declared},
        )
        losses.append(float(loss))
        values = dict(zip([*step.weights, *step.state], new))
    assert losses[-1] < 0.9 * losses[0]
    trained = Checkpoint({w: values[w] for w in step.weights}, {s: values[s] for s in step.state})
    save_checkpoint(trained, tmp_path / "trained.json")
    merged = merge_checkpoint(tmp_path, tmp_path / "trained.json")
    deployed.assert_deployed_form(model, merged, beside=form in ("int8", "qdq", "int4"))
    assert np.isfinite(run(merged, feeds)[0]).all()
    if form == "int8":  # the adapters stay separate, over the untouched int8 weights
        _assert_integer_weights_kept(model, merged)
    if form in ("int8", "qdq", "int4"):  # the adapters folded, the base quantized again
        requantized = merge_checkpoint(tmp_path, tmp_path / "trained.json", "requantize")
        assert not any(i.name.endswith("_lora_A") for i in requantized.graph.initializer)
        deployed.assert_deployed_form(model, requantized, beside=False)
        got, want = run(requantized, feeds)[0], run(merged, feeds)[0]
        moved = np.abs(outputs - target).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=0.25 * moved)
        assert np.sum((got - target) ** 2) < 0.9 * np.sum((outputs - target) ** 2)


def _assert_integer_weights_kept(model: onnx.ModelProto, merged: onnx.ModelProto) -> None:
    from onnxgrad.graph.lora import lora_adapters

    integers = {
        i.name: i.SerializeToString()
        for i in model.graph.initializer
        if i.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8) and len(i.dims) == 2
    }
    kept = {i.name: i.SerializeToString() for i in merged.graph.initializer if i.name in integers}
    assert kept == integers
    products = {n.input[1] for n in model.graph.node if n.op_type == "MatMulInteger"}
    assert {a["weight"] for a in lora_adapters(merged)} == products
