"""The files onnxruntime-genai's model builder makes of a tiny random Llama-like model
(offline; fp32, int4, and fp32 reading input embeddings; ``GroupQueryAttention`` with
past/present key-value caches and rotary embedding, ``SkipSimplifiedLayerNormalization``,
``MatMulNBits``) differentiate and LoRA-fine-tune, and the trained adapters load with
onnxruntime-genai's adapter API.

Runs where onnxruntime-genai imports (it needs onnxruntime >= 1.31) beside PyTorch and
transformers (the builder loads the model with them): ``dev.py test``'s ``.venv-genai``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxgrad import add_lora, onnx_derivative
from onnxgrad.graph.lora_runtime import runtime_adapter_model
from onnxgrad.normalize import normalized_model
from tests.derivative.fd import numerical_vjp
from tests.normalize.genai_builder import KV_HEADS, LAYERS, VOCAB, build, save_tiny_llama
from tests.normalize.kernels import run

pytestmark = pytest.mark.slow
og = pytest.importorskip("onnxruntime_genai")

HIDDEN, HEAD = 64, 16
PAST = [f"past_key_values.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``form -> folder`` of the builder's output, made once."""
    folder = tmp_path_factory.mktemp("genai")
    save_tiny_llama(folder / "hf", hidden=HIDDEN)
    made = {}

    def get(form: str) -> Path:
        """``fp32``, ``int4``, or ``embeds`` (fp32 reading ``inputs_embeds``)."""
        if form not in made:
            options = ["exclude_embeds=true"] if form == "embeds" else []
            precision = "fp32" if form == "embeds" else form
            made[form] = build(folder / "hf", folder / form, precision, *options)
        return made[form]

    return get


def _session(model: onnx.ModelProto | Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(source, options, ["CPUExecutionProvider"])


def _feeds(
    batch: int, length: int, past: int, seed: int = 0, embeds: bool = False
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {"attention_mask": np.ones((batch, past + length), np.int64)}
    if embeds:
        feeds["inputs_embeds"] = rng.standard_normal((batch, length, HIDDEN)).astype(np.float32)
    else:
        feeds["input_ids"] = rng.integers(0, VOCAB, (batch, length)).astype(np.int64)
    for name in PAST:
        feeds[name] = rng.standard_normal((batch, KV_HEADS, past, HEAD)).astype(np.float32)
    return feeds


def _float_activations(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with ``MatMulNBits``'s ``accuracy_level`` 0: the builder asks for 4, int8
    quantization of the activations inside the kernel, which the lowering reads as the
    identity (a kernel precision hint, not part of the weights)."""
    for node in model.graph.node:
        for attribute in node.attribute:
            if attribute.name == "accuracy_level":
                attribute.i = 0
    return model


@pytest.mark.parametrize("form", ["fp32", "int4", "embeds"])
def test_builder_output_lowers_and_differentiates(built, form):
    model = _float_activations(onnx.load(built(form) / "model.onnx"))
    ops = {node.op_type for node in model.graph.node}
    assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= ops
    assert ("MatMulNBits" in ops) == (form == "int4")
    # the kernel wants batch 1 for a prompt after a past
    feeds = _feeds(batch=1, length=3, past=2, embeds=form == "embeds")
    weight = "model.layers.1.post_attention_layernorm.weight"
    reference = _with_weight_input(model, weight)
    session = _session(reference)
    initial = {i.name: i for i in model.graph.initializer}[weight]
    point = {**feeds, weight: onnx.numpy_helper.to_array(initial)}
    expected = session.run(None, point)
    for got, want in zip(run(normalized_model(model), feeds), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    rng = np.random.default_rng(1)
    seeds = [rng.standard_normal(value.shape).astype(np.float32) for value in expected]
    names = [o.name for o in session.get_outputs()]
    # a norm weight's gradient too, but under unit-scale embeddings it is small against the
    # float32 rounding of the logits
    first = "inputs_embeds" if form == "embeds" else "past_key_values.0.key"
    weights = [] if form == "embeds" else [weight]
    targets = [first, "past_key_values.1.value"]
    gradient = onnx_derivative(model, inputs=targets, weights=weights)
    values = {**point, **{f"{n}_grad": s for n, s in zip(names, seeds, strict=True)}}
    declared = [i.name for i in gradient.graph.input]
    outputs = run(gradient, {k: values[k] for k in declared})
    got = dict(zip([o.name for o in gradient.graph.output], outputs, strict=True))

    def function(changed):
        cast = {k: np.asarray(v, np.float32) for k, v in changed.items()}
        return [v.astype(np.float64) for v in session.run(None, {**point, **cast})]

    # a large step: below 1e-2 the rounding of the logits dominates the weight's small
    # gradient (errors 1.5e-2, 1.8e-3, 6e-4 at steps 1e-3, 1e-2, 3e-2)
    varied = {k: point[k] for k in [*targets, *weights]}
    wanted = numerical_vjp(function, varied, list(varied), seeds, eps=3e-2)
    for name in varied:
        difference = np.abs(got[f"{name}_grad"] - wanted[name]).max()
        assert difference < 2e-3 * np.abs(wanted[name]).max(), name


def _with_weight_input(model: onnx.ModelProto, weight: str) -> onnx.ModelProto:
    """A copy of ``model`` that reads ``weight`` as an input (its initializer the default)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    init = {i.name: i for i in copy.graph.initializer}[weight]
    copy.graph.input.append(
        onnx.helper.make_tensor_value_info(weight, init.data_type, list(init.dims))
    )
    return copy


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_lora_of_builder_output_runs_as_genai_adapter(built, precision, tmp_path):
    """add_lora, generate_artifacts and plain onnxruntime steps lower the loss; the trained
    adapters, written as an .onnx_adapter over the builder's model, make onnxruntime-genai
    compute the trained model's logits (and the base model's without them)."""
    from onnxgrad.training import (
        Checkpoint,
        generate_artifacts,
        load_train_step,
        merge_checkpoint,
    )
    from onnxgrad.training.artifacts.onnx_adapter import save_onnx_adapter

    folder = built(precision)
    model = onnx.load(folder / "model.onnx")
    feeds = _feeds(batch=2, length=4, past=0)
    base_logits = _session(model).run(["logits"], feeds)[0]
    target = base_logits + np.random.default_rng(2).standard_normal(base_logits.shape)
    adapted = add_lora(model, rank=4)
    art = generate_artifacts(adapted, optimizer="adam", artifact_directory=tmp_path / "art")
    trained = _train(art, load_train_step(tmp_path / "art"), feeds, target.astype(np.float32))

    deployed = tmp_path / "deployed"
    deployed.mkdir()
    for item in folder.iterdir():
        if not item.name.startswith("model.onnx"):
            (deployed / item.name).write_bytes(item.read_bytes())
    base = runtime_adapter_model(model, adapted)
    onnx.save(base, deployed / "model.onnx", save_as_external_data=True, location="model.data")
    save_onnx_adapter(trained, deployed / "trained.onnx_adapter")

    merged = merge_checkpoint(tmp_path / "art", Checkpoint(trained, {}))
    prompt = feeds["input_ids"][:1]
    prompt_feeds = {k: v[:1] for k, v in feeds.items()}
    want = _session(merged).run(["logits"], prompt_feeds)[0]
    genai = og.Model(str(deployed))
    adapters = og.Adapters(genai)
    adapters.load(str(deployed / "trained.onnx_adapter"), "trained")
    with_adapter = _genai_logits(genai, prompt, adapters)
    without = _genai_logits(genai, prompt, None)
    assert np.abs(want - base_logits[:1]).max() > 0.5  # training moved the logits
    # int4: the kernel's int8 activations (accuracy_level 4) against the lowering's floats
    tolerance = 1e-4 if precision == "fp32" else 2e-2
    np.testing.assert_allclose(with_adapter, want, atol=tolerance * np.abs(want).max())
    np.testing.assert_allclose(without, base_logits[:1], atol=1e-5)


def _train(art, step, feeds, target, steps: int = 10) -> dict[str, np.ndarray]:
    session = _session(Path(art.path("training_model.onnx")))
    values = {**art.checkpoint.weights, **art.checkpoint.optimizer_state}
    declared = {i.name for i in session.get_inputs()}
    losses = []
    for _ in range(steps):
        batch = {**feeds, "label": target, "learning_rate": np.array(0.01, np.float32), **values}
        loss, *new = session.run(
            [step.loss, *step.new_weights, *step.new_state],
            {k: v for k, v in batch.items() if k in declared},
        )
        losses.append(float(loss))
        values = dict(zip([*step.weights, *step.state], new, strict=True))
    assert losses[-1] < 0.7 * losses[0], losses
    return {w: values[w] for w in step.weights}


def _genai_logits(model, prompt: np.ndarray, adapters) -> np.ndarray:
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=16)
    generator = og.Generator(model, params)
    if adapters is not None:
        generator.set_active_adapter(adapters, "trained")
    generator.append_tokens(prompt.astype(np.int32))
    return generator.get_output("logits")


def test_info_reads_the_builder_file(built, tmp_path):
    """``onnxgrad info`` on the file as written (its declared constant shapes are wrong,
    which onnx's strict check refuses and onnxruntime ignores)."""
    from tests.cli.helpers import run_in_process

    path = built("int4") / "model.onnx"
    result = run_in_process("info", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for line in (
        "com.microsoft::GroupQueryAttention x2: lowered to standard ONNX and trained",
        "com.microsoft::MatMulNBits x11: lowered over its dequantized weight",
    ):
        assert line in result.stdout
