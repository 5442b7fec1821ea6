"""Five more architectures (GPT-2, a Qwen2 decoder, a ViT, a T5 and a Whisper encoder) in every form
onnxruntime's tools deploy (float32, optimized at levels 1 and 2, float16, int8 dynamic,
static QDQ, 4-bit): each lowers to what onnxruntime computes, differentiates, and LoRA-trains
through a train step onnxruntime loads at its default optimization level.

References, never onnxgrad itself: central finite differences of the deployed file run by
onnxruntime, with activation rounding and ReLU masks frozen at the point
(:mod:`tests.normalize.unrounded`: the straight-through gradient of int8 and QDQ, and no
kink at the point); of the level-1 file for its float16 conversion."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnxgrad import onnx_derivative
from onnxgrad.normalize import normalized_model
from tests import architectures
from tests.derivative.fd import numerical_vjp
from tests.normalize.kernels import kernel_outputs, run
from tests.normalize.unrounded import with_frozen_rounding

pytestmark = pytest.mark.slow
pytest.importorskip("torch")
pytest.importorskip("transformers")

#: the file whose finite differences the gradient of a form is checked against
REFERENCE = {"float16": "opt1"}
#: the point differentiated: not a calibration batch of static quantization, whose extreme
#: activations sit on the clipping bounds (a kink)
POINT = 4
#: relative error bound against finite differences of float32 outputs: their rounding noise
#: (~1e-7 |y| / EPS) reach 5e-3 on the tiny ViT (measured against torch's float64
#: autograd); float16 adds its own rounding, up to twice PyTorch's own float16 backward's
BOUND = {"float16": 2e-2}
DEFAULT_BOUND = 1e-2
EPS = 1e-3
#: Whisper's 2560 input features each move its normalized outputs little: at 1e-3 the
#: float32 outputs' rounding dominates the differences (7e-2 off torch's float64 autograd
#: on the float32 file, 1e-2 at 1e-2, 4e-3 at 3e-2)
EPS_OF = {"whisper": 3e-2}
#: architectures whose output is a LayerNorm's (Whisper's encoder): the mean of each
#: token's features is its bias's whatever the adapters do, so the target moves them by a
#: zero-mean shift
NORMALIZED_OUTPUT = ("whisper",)
#: Adam on the adapters: small enough for the tiny ViT (whose logits are ~1e-2)
LEARNING_RATE = 1e-3


#: the forms of the matrix: what onnxruntime's tools make (the export's own Constant
#: nodes promoted, a form of the weights-by-role property test, left out)
FORMS = tuple(f for f in architectures.forms("gpt2") if f != "initializers")


def _form(kind: str, name: str) -> onnx.ModelProto:
    try:
        return onnx.load(architectures.deployed_form(kind, name))
    except ImportError as exc:  # a tool whose kernel this onnxruntime build lacks
        pytest.skip(f"this onnxruntime cannot make the {name} form: {exc}")


def _input_gradient(model: onnx.ModelProto, name: str, feeds, seed) -> np.ndarray:
    gradient = onnx_derivative(model, inputs=[name], weights=[])
    names = [o.name for o in gradient.graph.output]
    out = run(gradient, {**feeds, "logits_grad": seed})
    return dict(zip(names, out, strict=True))[f"{name}_grad"]


def _finite_differences(model: onnx.ModelProto, name: str, feeds, seed, eps=EPS) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])

    def function(values):
        x = np.asarray(values[name], dtype=np.float32)
        return [session.run(None, {name: x})[0].astype(np.float64)]

    return numerical_vjp(function, {name: feeds[name]}, [name], [seed], eps=eps)[name]


def _relative(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def _reference(kind: str, form: str, model: onnx.ModelProto, feeds) -> onnx.ModelProto:
    """The file finite differences are taken of: the deployed one with its activation
    rounding and ReLU masks frozen at the point (kinks there: T5's ReLU reads values rounded
    to exactly 0), or the float32 source of a float16 conversion with the float16 file's
    ReLU masks (rounded to float16, T5's ReLU inputs cross 0 elsewhere)."""
    source = REFERENCE.get(form)
    if source is not None:
        return with_frozen_rounding(_form(kind, source), feeds, masks_from=model)
    return with_frozen_rounding(model, feeds)


def _torch_float16_error(kind: str, feeds, seed) -> float:
    """How far PyTorch's own float16 backward of the module is from its float64 one: the
    precision a float16 gradient of this model can have (T5, unscaled attention over an
    unnormalized residual stream: 6e-2 at some points)."""
    import torch

    name = architectures.INPUT[kind]
    grads = []
    for dtype in (torch.float64, torch.float16):
        x = torch.from_numpy(feeds[name]).to(dtype).requires_grad_()
        y = architectures.forward(architectures.module(kind).to(dtype), kind, x)
        (y * torch.from_numpy(seed).to(dtype)).sum().backward()
        grads.append(x.grad.double().numpy())
    return _relative(grads[1], grads[0])


@pytest.mark.parametrize("kind", architectures.FLOAT_INPUT)
@pytest.mark.parametrize("form", FORMS)
def test_input_gradient_of_architecture_form(kind, form):
    model = _form(kind, form)
    name = architectures.INPUT[kind]
    feeds = architectures.feeds(kind, POINT)
    outputs = kernel_outputs(model, feeds)[0]  # a skip where this onnxruntime lacks a kernel
    np.testing.assert_allclose(
        run(normalized_model(model), feeds)[0], outputs, rtol=2e-3, atol=2e-3
    )
    seed = np.random.default_rng(1).standard_normal(outputs.shape).astype(np.float32)
    got = _input_gradient(model, name, feeds, seed)
    reference = _reference(kind, form, model, feeds)
    want = _finite_differences(reference, name, feeds, seed, EPS_OF.get(kind, EPS))
    bound = BOUND.get(form, DEFAULT_BOUND)
    if form == "float16":
        bound = max(bound, 2 * _torch_float16_error(kind, feeds, seed))
    assert _relative(got, want) < bound


@pytest.mark.parametrize("kind", architectures.FLOAT_INPUT)
def test_input_gradient_of_float32_export_against_torch(kind):
    """The exported file's gradient against torch's float64 autograd of the module it came
    from: tight, where finite differences of float32 outputs are not."""
    import torch

    name = architectures.INPUT[kind]
    feeds = architectures.feeds(kind)
    model = _form(kind, "float32")
    outputs = kernel_outputs(model, feeds)[0]  # a skip where this onnxruntime lacks a kernel
    seed = np.random.default_rng(1).standard_normal(outputs.shape)
    x = torch.from_numpy(feeds[name].astype(np.float64)).requires_grad_()
    y = architectures.forward(architectures.module(kind).double(), kind, x)
    (y * torch.from_numpy(seed)).sum().backward()
    got = _input_gradient(model, name, feeds, seed.astype(np.float32))
    assert _relative(got, x.grad.numpy()) < 1e-5


@pytest.mark.parametrize("kind", architectures.FLOAT_INPUT)
@pytest.mark.parametrize("form", FORMS)
def test_lora_training_of_architecture_form(kind, form, tmp_path):
    """add_lora, generate_artifacts, then steps in an onnxruntime session at its default
    optimization level (whose optimizers must accept what onnxgrad emits): finite losses,
    falling."""
    import onnxruntime as ort

    from onnxgrad import add_lora
    from onnxgrad.training import generate_artifacts, load_train_step

    model = _form(kind, form)
    art = generate_artifacts(add_lora(model, rank=4), optimizer="adam", artifact_directory=tmp_path)
    step = load_train_step(tmp_path)
    feeds = architectures.feeds(kind)
    outputs = kernel_outputs(model, feeds)[0]  # a skip where this onnxruntime lacks a kernel
    target = _target(kind, outputs)
    session = ort.InferenceSession(
        str(art.path("training_model.onnx")), providers=["CPUExecutionProvider"]
    )
    values = {**art.checkpoint.weights, **art.checkpoint.optimizer_state}
    declared = {i.name for i in session.get_inputs()}
    losses = []
    rate = np.array(LEARNING_RATE, np.float32)
    for _ in range(15):
        batch = {**feeds, "label": target, "learning_rate": rate, **values}
        loss, *new = session.run(
            [step.loss, *step.new_weights, *step.new_state],
            {k: v for k, v in batch.items() if k in declared},
        )
        losses.append(float(loss))
        values = dict(zip([*step.weights, *step.state], new, strict=True))
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.9 * losses[0]


def _target(kind: str, outputs: np.ndarray) -> np.ndarray:
    """The outputs shifted: by one number (a multiple of their largest), or for a
    LayerNorm's output by a zero-mean vector along the features."""
    rng = np.random.default_rng(2)
    if kind in NORMALIZED_OUTPUT:
        shift = rng.standard_normal(outputs.shape[-1]).astype(np.float32)
        return outputs + 0.5 * (shift - shift.mean())
    shift = rng.standard_normal((1,)).astype(np.float32)
    return outputs + shift * np.abs(outputs).max()


@pytest.mark.parametrize("form", ["opt1", "opt2"])
def test_weight_gradient_through_embed_layer_norm_into_attention(form):
    """onnxruntime's optimized BERT (``EmbedLayerNormalization`` whose mask index feeds each
    ``Attention``), run at another batch size than it was exported with: the gradient of
    the fused operators' weights, along a random direction, against central finite
    differences of the deployed file."""
    import onnxruntime as ort

    model = onnx.load(architectures.deployed_form("bert", form))
    fused = [n for n in model.graph.node if n.op_type in ("EmbedLayerNormalization", "Attention")]
    if {n.op_type for n in fused} != {"EmbedLayerNormalization", "Attention"}:
        import onnxruntime as ort

        pytest.skip(f"onnxruntime {ort.__version__}'s optimizer fuses neither on this export")
    floats = {i.name: i for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT}
    names = sorted({name for n in fused for name in n.input if name in floats})
    feeds = architectures.feeds("bert", seed=1, batch=3)
    outputs = run(model, feeds)[0]
    seed = np.random.default_rng(1).standard_normal(outputs.shape).astype(np.float32)
    gradient = onnx_derivative(model, weights=names, inputs=[])
    values = {n: onnx.numpy_helper.to_array(floats[n]) for n in names}
    declared = {i.name for i in gradient.graph.input}
    batch = {k: v for k, v in {**feeds, **values, "logits_grad": seed}.items() if k in declared}
    got = dict(zip([o.name for o in gradient.graph.output], run(gradient, batch), strict=True))
    rng = np.random.default_rng(2)
    direction = {n: rng.standard_normal(v.shape).astype(np.float32) for n, v in values.items()}
    along = sum(float(np.sum(got[f"{n}_grad"] * direction[n])) for n in names)

    def shifted(step: float) -> float:
        moved = onnx.ModelProto()
        moved.CopyFrom(model)
        for init in moved.graph.initializer:
            if init.name in direction:
                value = values[init.name] + step * direction[init.name]
                init.CopyFrom(onnx.numpy_helper.from_array(value.astype(np.float32), init.name))
        session = ort.InferenceSession(
            moved.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        return float(np.sum(session.run(None, feeds)[0].astype(np.float64) * seed))

    want = (shifted(EPS) - shifted(-EPS)) / (2 * EPS)
    assert abs(along - want) < DEFAULT_BOUND * abs(want)
