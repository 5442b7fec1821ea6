"""Tiny models of twenty-five architectures (random weights, every parameter distinct), each
exported once by torch and turned into the forms onnxruntime's tools deploy, in one cache:
``~/.cache/onnxgrad-tests/architectures/<digest of this module and of
tests/normalize/deployed.py>`` (``$ONNXGRAD_TEST_CACHE``), its forms keyed by the
onnxruntime that made them (exports made by one environment serve another, without torch).

* :data:`AS_FED`: inputs as a user feeds them, integer ones among them: an MLP, a CNN, a GRU
  over token ids, bytes compared with ``arange(256)`` (one-hot by ``Equal``), class indices
  through ``one_hot``, log-mel features (``STFT``, a mel filterbank buffer) before a
  ``Conv1d``, a Llama decoder over token ids (its embedding tied to its head) and a BERT
  classifier over ids, mask and segments (onnxruntime's optimizer fuses its front into
  ``EmbedLayerNormalization``);
* :data:`FLOAT_INPUT`: transformers taking a float input (the one the deployed-forms matrix
  differentiates): GPT-2, a Qwen2 decoder (grouped key/value heads, rotary), a ViT, a T5
  encoder (relative position bias) and a Whisper encoder (log-mel features
  ``[B, 80, frames]``, two ``Conv1d`` with exact GELU, sinusoidal positions);
* :data:`THIRD_SET`: Mistral, BLOOM, GPT-NeoX, ALBERT and BART over token ids and a
  Segformer classifier over pixels, randomized like the small ones;
* :data:`FOURTH_SET`: DeBERTa-v2, Gemma, wav2vec2, ConvNeXt, Swin and a CLIP text encoder.

``$ONNXGRAD_TEST_FORMS_OF`` (an onnxruntime version) reads the forms another onnxruntime made
where they exist (the 4-bit form of onnxruntime >= 1.20 in the training environment).

The weights-by-role property test (``tests/graph/test_weight_roles.py``) reads every
architecture in every form (the third and fourth sets in :data:`SUITE_FORM`, every form in
``benchmarks/sweep_architectures.py``), the deployed-forms matrix
(``tests/normalize/test_architecture_forms.py``) the float-input ones and BERT's fusions.
"""

from __future__ import annotations

import hashlib
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

from tests.normalize import deployed

#: sizes of the models fed as users feed them
HIDDEN, SEQ, BATCH, VOCAB = 16, 6, 2, 40
#: sizes of the float-input transformers (and BERT): ``tests.normalize.deployed``'s
WIDE, WIDE_SEQ = deployed.HIDDEN, deployed.SEQ
IMAGE, PATCH, CHANNELS = 8, 4, 3
#: Whisper's mel bins and input frames (twice its positions: the second Conv1d has stride 2)
MELS, FRAMES = 80, 16
#: the log-mel model's waveform: samples, window (and FFT) length, hop, mel bands
SAMPLES, WINDOW, HOP, BANDS = 64, 16, 4, 6

AS_FED = ("mlp", "cnn", "gru", "bytes", "classes", "melspec", "llama", "bert")
FLOAT_INPUT = ("gpt2", "qwen2", "vit", "t5", "whisper")
#: a third set, as fed (token ids, except Segformer's pixels): a Mistral decoder (sliding
#: window shorter than the sequence), BLOOM (ALiBi), GPT-NeoX (parallel attention, rotary on a
#: quarter of each head), ALBERT (factorized embedding, one layer's weights read by both
#: layers), BART (encoder-decoder, cross attention, embeddings tied to the head) and a
#: Segformer classifier (overlapping patch convolutions, reduced keys, depthwise Mix-FFN)
THIRD_SET = ("mistral", "bloom", "neox", "albert", "bart", "segformer")
#: a fourth set: DeBERTa-v2 over ids and a padding mask (disentangled attention: content to
#: position and position to content through log position buckets, its relative embeddings
#: LayerNorm'd), Gemma over ids (RMSNorm scaled by ``1 + w``, tanh-GELU gated MLP, the
#: embedding scaled by ``sqrt(hidden)`` and tied to the head), wav2vec2 over a waveform
#: (a convolutional feature encoder with GroupNorm, a grouped positional ``Conv1d`` whose
#: kernel is weight-normed: exported unfolded, its ``g`` and ``v`` the parameters), ConvNeXt
#: over pixels (7x7 depthwise convolutions, channels-last LayerNorm, layer-scale gamma),
#: Swin over pixels (shifted windows by ``roll``, a relative position bias table gathered by
#: a buffer of indices, patch merging) and a CLIP text encoder with its projection (causal
#: mask, quick GELU, the features at each sequence's largest id)
FOURTH_SET = ("deberta", "gemma", "wav2vec2", "convnext", "swin", "clip")
ARCHITECTURES = AS_FED + FLOAT_INPUT + THIRD_SET + FOURTH_SET
#: the forms of every architecture; onnxruntime's transformer optimizer only for transformers
#: (not ConvNeXt: optimized as a ViT, onnxruntime 1.19 fuses its residual LayerNorms into
#: ``SkipLayerNormalization`` over 4-D values, which its own kernel refuses to run)
FORMS = ("float32", "initializers", "float16", "int8", "qdq", "int4")
OPTIMIZED = ("opt1", "opt2")
#: onnxruntime.transformers.optimizer's model type, head count and hidden size
OPTIMIZER = {
    "llama": ("gpt2", 2, HIDDEN),
    "bert": ("bert", 2, WIDE),
    "gpt2": ("gpt2", 2, WIDE),
    "qwen2": ("gpt2", 4, WIDE),
    "vit": ("vit", 2, WIDE),
    "t5": ("t5", 2, WIDE),
    "whisper": ("bart", 2, WIDE),  # onnxruntime's Whisper scripts optimize it as BART
    "mistral": ("gpt2", 2, WIDE),
    "bloom": ("gpt2", 2, WIDE),
    "neox": ("gpt_neox", 2, WIDE),
    "albert": ("bert", 2, WIDE),
    "bart": ("bart", 2, WIDE),
    "segformer": ("vit", 0, 0),  # widths differ by stage: heads and width detected
    "deberta": ("bert", 2, WIDE),
    "gemma": ("gpt2", 2, WIDE),
    "wav2vec2": ("bert", 2, WIDE),
    "swin": ("swin", 0, 0),
    "clip": ("clip", 2, WIDE),
}
#: the float input of each :data:`FLOAT_INPUT` export (the one differentiated)
INPUT = {
    "gpt2": "inputs_embeds",
    "qwen2": "inputs_embeds",
    "vit": "pixel_values",
    "t5": "inputs_embeds",
    "whisper": "input_features",
}
#: the operators static quantization is limited to: T5's relative-position buckets (a
#: ``Log`` of ``|i - j|``, minus infinity on the diagonal) quantized give onnxruntime itself
#: out-of-range ``Gather`` indices, so its weighted operators and the bias lookup only
STATIC_OP_TYPES = {"t5": ["MatMul", "Gemm", "Gather"]}


#: the one form of each :data:`THIRD_SET` and :data:`FOURTH_SET` architecture the suite
#: checks (every form: ``benchmarks/sweep_architectures.py``)
SUITE_FORM = {
    "mistral": "int8",  # a quantized embedding over ids, sliding-window masks
    "bloom": "float16",  # ALiBi slopes and masks in float16
    "neox": "opt2",  # onnxruntime's GPT-NeoX fusions, rotary on a quarter of each head
    "albert": "opt2",  # one layer's weights read twice, BERT fusions
    "bart": "float32",  # cross attention, tied embeddings, the logits' bias buffer
    "segformer": "initializers",  # every Constant an initializer
    "deberta": "initializers",  # score = 0's 0.0, the relative table tiled to the batch
    "gemma": "float16",  # the (1 + w) RMSNorm and sqrt(hidden) scale in float16
    "wav2vec2": "float32",  # weight norm's g and v, GroupNorm, grouped Conv1d
    "convnext": "int8",  # depthwise kernels and layer scales beside int8 products
    "swin": "initializers",  # the bias table's index buffer and the window masks initializers
    "clip": "int4",  # 4-bit products, the causal mask and quick GELU's 1.702
}


def forms(architecture: str) -> tuple[str, ...]:
    return FORMS + OPTIMIZED if architecture in OPTIMIZER else FORMS


def suite_forms(architecture: str) -> tuple[str, ...]:
    """The forms the suite checks: every one, one of a third- or fourth-set architecture."""
    if architecture in SUITE_FORM:
        return (SUITE_FORM[architecture],)
    return forms(architecture)


def cache_dir() -> Path:
    """The cache folder of the exports, keyed by the builders' source."""
    builders = Path(__file__).read_bytes() + Path(deployed.__file__).read_bytes()
    source = hashlib.sha256(builders).hexdigest()[:12]
    root = Path(os.environ.get("ONNXGRAD_TEST_CACHE", "~/.cache/onnxgrad-tests")).expanduser()
    folder = root / "architectures" / source
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# -- the modules ---------------------------------------------------------------------------


def _randomized(module):
    """``module`` in eval mode with every parameter drawn anew (distinct values: an exporter
    merges equal initializers, and ones or zeros would match a constant)."""
    import torch

    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)
    return module.eval()


def _small_modules() -> dict[str, Callable]:
    import torch
    from torch import nn

    class Bytes(nn.Module):
        """Bytes one-hot by ``Equal``, tanh GELU, a -inf masked max and a 1/512 scale."""

        def __init__(self):
            super().__init__()
            self.lin, self.norm = nn.Linear(256, HIDDEN), nn.LayerNorm(HIDDEN)
            self.out = nn.Linear(HIDDEN, 3)

        def forward(self, data):
            onehot = (data.unsqueeze(-1) == torch.arange(256)).float()
            h = self.norm(nn.functional.gelu(self.lin(onehot), approximate="tanh"))
            h = h.masked_fill((data == 0).unsqueeze(-1), float("-inf")).max(dim=1).values
            return self.out(h / 512.0)

    class Classes(nn.Module):
        """Class indices through ``one_hot``, erf GELU, a mean and an epsilon."""

        def __init__(self):
            super().__init__()
            self.lin, self.out = nn.Linear(10, HIDDEN), nn.Linear(HIDDEN, 2)

        def forward(self, data):
            h = self.lin(nn.functional.one_hot(data, 10).float())
            h = 0.5 * h * (1 + torch.erf(h / 1.4142135))
            return self.out(h.mean(1) * 0.125 + 1e-5)

    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.gru = nn.Embedding(VOCAB, HIDDEN), nn.GRU(HIDDEN, HIDDEN)
            self.out = nn.Linear(HIDDEN, 3)

        def forward(self, data):
            out, _ = self.gru(self.embed(data).transpose(0, 1))
            return self.out(out[-1])

    class LogMel(nn.Module):
        """A waveform's power spectrum (``STFT``, a Hann window, reflect padding) times a
        mel filterbank (a non-negative buffer, not a parameter), ``log(. + 1e-6)``, then a
        ``Conv1d`` and a dense head."""

        def __init__(self):
            super().__init__()
            self.register_buffer("window", torch.hann_window(WINDOW))
            bank = torch.rand(WINDOW // 2 + 1, BANDS, generator=torch.Generator().manual_seed(1))
            self.register_buffer("mel", bank)
            self.conv, self.out = nn.Conv1d(BANDS, HIDDEN, 3, padding=1), nn.Linear(HIDDEN, 3)

        def forward(self, wave):
            # the TorchScript exporter writes STFT for the real form only
            spectrum = torch.stft(wave, WINDOW, HOP, window=self.window, return_complex=False)
            power = spectrum.pow(2).sum(-1).transpose(1, 2)
            features = torch.log(torch.matmul(power, self.mel) + 1e-6).transpose(1, 2)
            return self.out(torch.relu(self.conv(features)).mean(-1))

    mlp = lambda: nn.Sequential(nn.Linear(8, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 3))  # noqa: E731
    cnn = lambda: nn.Sequential(  # noqa: E731
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.BatchNorm2d(8),  # after the ReLU: the exporter folds a BatchNorm into its Conv
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 3),
    )
    return {
        "mlp": mlp,
        "cnn": cnn,
        "gru": Recurrent,
        "bytes": Bytes,
        "classes": Classes,
        "melspec": LogMel,
    }


def _llama():
    import transformers as tf

    config = tf.LlamaConfig(
        hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, vocab_size=VOCAB,
        intermediate_size=2 * HIDDEN, num_key_value_heads=1, max_position_embeddings=32,
        tie_word_embeddings=True,
    )  # fmt: skip
    config._attn_implementation = "eager"
    return _randomized(tf.LlamaForCausalLM(config))


def _wide_transformer(kind: str):
    """The float-input transformers and BERT (``deployed``'s sizes; default init)."""
    import torch
    import transformers

    torch.manual_seed(0)
    common = {"attn_implementation": "eager"}
    if kind == "bert":
        return deployed.tiny_bert(**common)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=50, n_embd=WIDE, n_layer=2, n_head=2, n_positions=16, **common
        )
        return transformers.GPT2LMHeadModel(config).eval()
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**deployed.DECODER)).eval()
    if kind == "vit":
        config = transformers.ViTConfig(
            hidden_size=WIDE, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=2 * WIDE, image_size=IMAGE, patch_size=PATCH,
            num_channels=CHANNELS, num_labels=3, **common,
        )  # fmt: skip
        return transformers.ViTForImageClassification(config).eval()
    if kind == "whisper":
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        config = transformers.WhisperConfig(
            d_model=WIDE, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=2 * WIDE,
            num_mel_bins=MELS, max_source_positions=FRAMES // 2, **common,
        )  # fmt: skip
        return WhisperEncoder(config).eval()
    config = transformers.T5Config(
        vocab_size=50, d_model=WIDE, d_kv=WIDE // 2, d_ff=2 * WIDE, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, **common,
    )  # fmt: skip
    return transformers.T5EncoderModel(config).eval()


def _third_set(kind: str):
    """The :data:`THIRD_SET` modules at ``WIDE``, two layers, every parameter drawn anew."""
    import transformers as tf

    common = {"attn_implementation": "eager"}
    decoder = {
        "vocab_size": VOCAB, "hidden_size": WIDE, "num_hidden_layers": 2,
        "num_attention_heads": 2, "max_position_embeddings": 32, **common,
    }  # fmt: skip
    if kind == "mistral":
        config = tf.MistralConfig(
            **decoder, intermediate_size=2 * WIDE, num_key_value_heads=1, sliding_window=3
        )
        return _randomized(tf.MistralForCausalLM(config))
    if kind == "bloom":
        config = tf.BloomConfig(vocab_size=VOCAB, hidden_size=WIDE, n_layer=2, n_head=2, **common)
        return _randomized(tf.BloomForCausalLM(config))
    if kind == "neox":
        config = tf.GPTNeoXConfig(
            **decoder, intermediate_size=2 * WIDE, use_parallel_residual=True, rotary_pct=0.25
        )
        return _randomized(tf.GPTNeoXForCausalLM(config))
    if kind == "albert":
        config = tf.AlbertConfig(
            vocab_size=VOCAB, embedding_size=HIDDEN, hidden_size=WIDE, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=2 * WIDE, max_position_embeddings=32,
            num_labels=3, **common,
        )  # fmt: skip
        return _randomized(tf.AlbertForSequenceClassification(config))
    if kind == "bart":
        config = tf.BartConfig(
            vocab_size=VOCAB, d_model=WIDE, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=2 * WIDE,
            decoder_ffn_dim=2 * WIDE, max_position_embeddings=32, **common,
        )  # fmt: skip
        return _randomized(tf.BartForConditionalGeneration(config))
    config = tf.SegformerConfig(
        num_channels=CHANNELS, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
        hidden_sizes=[16, WIDE], patch_sizes=[3, 3], strides=[2, 2],
        num_attention_heads=[1, 2], mlp_ratios=[2, 2], num_labels=3,
    )  # fmt: skip
    return _randomized(tf.SegformerForImageClassification(config))


def _fourth_set(kind: str):
    """The :data:`FOURTH_SET` modules: two layers (ConvNeXt and Swin two stages), every
    parameter drawn anew."""
    import transformers as tf

    common = {"attn_implementation": "eager"}
    encoder = {
        "vocab_size": VOCAB, "hidden_size": WIDE, "num_hidden_layers": 2,
        "num_attention_heads": 2, "intermediate_size": 2 * WIDE, **common,
    }  # fmt: skip
    if kind == "deberta":  # DeBERTa-v3's settings: one key projection, normed relative table
        config = tf.DebertaV2Config(
            **encoder, max_position_embeddings=32, relative_attention=True, position_buckets=4,
            max_relative_positions=8, pos_att_type=["p2c", "c2p"], share_att_key=True,
            norm_rel_ebd="layer_norm", position_biased_input=False, type_vocab_size=0,
            num_labels=3,
        )  # fmt: skip
        return _randomized(tf.DebertaV2ForSequenceClassification(config))
    if kind == "gemma":
        config = tf.GemmaConfig(
            **encoder, num_key_value_heads=1, head_dim=WIDE // 2, max_position_embeddings=32
        )
        return _randomized(tf.GemmaForCausalLM(config))
    if kind == "wav2vec2":
        config = tf.Wav2Vec2Config(
            **encoder, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
            num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
            feat_extract_norm="group", classifier_proj_size=16, num_labels=3,
        )  # fmt: skip
        return _randomized(tf.Wav2Vec2ForSequenceClassification(config))
    if kind == "convnext":
        config = tf.ConvNextConfig(
            num_channels=CHANNELS, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
            patch_size=2, image_size=IMAGE, num_labels=3,
        )  # fmt: skip
        return _randomized(tf.ConvNextForImageClassification(config))
    if kind == "swin":  # 8x8 patches, 4x4 windows shifted by 2, then merged to one window
        config = tf.SwinConfig(
            image_size=IMAGE, patch_size=1, num_channels=CHANNELS, embed_dim=8, depths=[2, 1],
            num_heads=[1, 2], window_size=4, mlp_ratio=2.0, num_labels=3, **common,
        )  # fmt: skip
        return _randomized(tf.SwinForImageClassification(config))
    config = tf.CLIPTextConfig(  # eos 2: the features at the largest id (as CLIP's own)
        **encoder, max_position_embeddings=32, hidden_act="quick_gelu", projection_dim=16,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return _randomized(tf.CLIPTextModelWithProjection(config))


def module(architecture: str):
    """The PyTorch module of ``architecture`` (the same weights every call)."""
    small = _small_modules()
    if architecture in small:
        return _randomized(small[architecture]())
    if architecture == "llama":
        return _llama()
    if architecture in THIRD_SET:
        return _third_set(architecture)
    if architecture in FOURTH_SET:
        return _fourth_set(architecture)
    return _wide_transformer(architecture)


def forward(model, architecture: str, *args):
    """What the export computes from its inputs: logits, the last hidden state of the T5
    and Whisper encoders, or CLIP's projected text features."""
    import torch

    names = [n for n, _ in _inputs(architecture)]
    if architecture in ("mlp", "cnn", "gru", "bytes", "classes", "melspec"):
        return model(*args)
    logits = ("llama", "bert", "vit", "albert", "segformer", "deberta", "wav2vec2", "convnext")
    if architecture in (*logits, "swin"):
        return model(**dict(zip(names, args))).logits
    if architecture == "clip":
        return model(**dict(zip(names, args))).text_embeds
    if architecture == "bart":
        return model(**dict(zip(names, args)), use_cache=False).logits
    if architecture in (*THIRD_SET, "gemma"):  # a mask of ones: without one, transformers looks for
        (ids,) = args  # packed sequences in the positions (torch.diff, no ONNX symbolic)
        mask = torch.ones(ids.shape, dtype=torch.int64)
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    if architecture in ("t5", "whisper"):
        return model(**dict(zip(names, args))).last_hidden_state
    (x,) = args
    mask = torch.ones(x.shape[:2], dtype=torch.int64)
    return model(inputs_embeds=x, attention_mask=mask, use_cache=False).logits


def _inputs(architecture: str) -> list[tuple[str, tuple]]:
    shapes = {
        "mlp": [("x", (BATCH, 8))],
        "cnn": [("x", (BATCH, 3, 8, 8))],
        "melspec": [("wave", (BATCH, SAMPLES))],
        "llama": [("input_ids", (BATCH, SEQ))],
        "bert": [(n, (BATCH, WIDE_SEQ)) for n in ("input_ids", "attention_mask", "token_type_ids")],
        "vit": [("pixel_values", (BATCH, CHANNELS, IMAGE, IMAGE))],
        "whisper": [("input_features", (BATCH, MELS, FRAMES))],
        "albert": [(n, (BATCH, SEQ)) for n in ("input_ids", "attention_mask", "token_type_ids")],
        "bart": [(n, (BATCH, SEQ)) for n in ("input_ids", "decoder_input_ids")],
        "segformer": [("pixel_values", (BATCH, CHANNELS, IMAGE, IMAGE))],
        "deberta": [(n, (BATCH, SEQ)) for n in ("input_ids", "attention_mask")],
        "wav2vec2": [("input_values", (BATCH, SAMPLES))],
        "convnext": [("pixel_values", (BATCH, CHANNELS, IMAGE, IMAGE))],
        "swin": [("pixel_values", (BATCH, CHANNELS, IMAGE, IMAGE))],
    }
    if architecture in ("mistral", "bloom", "neox", "gemma", "clip"):
        return [("input_ids", (BATCH, SEQ))]
    if architecture in shapes:
        return shapes[architecture]
    if architecture in FLOAT_INPUT:
        return [(INPUT[architecture], (BATCH, WIDE_SEQ, WIDE))]
    return [("data", (BATCH, SEQ))]


def feeds(architecture: str, seed: int = 0, batch: int = BATCH, padded: bool = True):
    """Random inputs: floats, ids in the vocabulary, and for BERT a mask padding the last
    sequence's last two tokens (``padded``; static quantization is calibrated without: the
    padded positions' -3.4e38 would give a scale overflowing to infinity) and segments."""
    rng = np.random.default_rng(seed)
    values = {}
    for name, shape in _inputs(architecture):
        shape = (batch, *shape[1:])
        if name == "attention_mask":
            values[name] = np.ones(shape, np.int64)
            if padded:
                values[name][-1, -2:] = 0
        elif name == "token_type_ids":
            values[name] = rng.integers(0, 2, shape)
        elif name in ("input_ids", "decoder_input_ids", "data"):
            high = {"bytes": 256, "classes": 10, "bert": 50}.get(architecture, VOCAB)
            values[name] = rng.integers(1, high, shape).astype(np.int64)
        else:
            values[name] = rng.standard_normal(shape).astype(np.float32)
    return values


# -- the files -----------------------------------------------------------------------------


#: exported without constant folding: the exporter's default folds wav2vec2's weight norm
#: ``g v / |v|`` (over every axis but the kernel's last) into one kernel, and neither ``g``
#: nor ``v`` would be in the file
UNFOLDED = ("wav2vec2",)

#: buffers that are weights by their role in the graph: BART's ``final_logits_bias``, zeros
#: added to the logits (a bias of its head that PyTorch registers as a buffer and leaves at
#: zero; a fine-tuning of the file may train it like the head's other bias)
BIAS_BUFFERS = {"bart": ("final_logits_bias",)}


def _deberta_position_projections(model) -> list[np.ndarray]:
    """Each layer's position queries and keys per head, ``LayerNorm(rel) W + b``: constants
    of the parameters, which onnxruntime's optimizer folds into four tables."""
    import torch

    encoder, found = model.deberta.encoder, []
    with torch.no_grad():
        for layer in encoder.layer:
            attention = layer.attention.self
            rows = encoder.get_rel_embedding()[: 2 * attention.pos_ebd_size].unsqueeze(0)
            for project in (attention.query_proj, attention.key_proj):
                heads = attention.transpose_for_scores(project(rows), attention.num_attention_heads)
                found.append(heads.numpy())
    return found


#: values a tool may fold from parameters that no simpler relation ties to them, computed
#: by the module and saved beside the export (``folded``)
FOLDED = {"deberta": _deberta_position_projections}


def folded(architecture: str) -> list[np.ndarray]:
    """The :data:`FOLDED` values of ``architecture`` (none for most)."""
    path = exported(architecture).with_suffix(".folded.npz")
    if not path.exists():
        return []
    with np.load(path) as saved:
        return [saved[k] for k in sorted(saved.files, key=int)]


def parameters(architecture: str) -> list[np.ndarray]:
    """The values of ``module(architecture).parameters()`` that PyTorch trains (Whisper's
    sinusoidal positions are frozen), and its :data:`BIAS_BUFFERS`, saved beside the
    export."""
    path = exported(architecture).with_suffix(".npz")
    with np.load(path) as saved:
        return [saved[k] for k in sorted(saved.files, key=int)]


def exported(architecture: str) -> Path:
    """The float32 export of ``architecture`` (TorchScript exporter, opset 17; dynamic
    batch, and sequence or length where the model allows), its parameters beside it."""
    path = cache_dir() / f"{architecture}_float32.onnx"
    if path.exists():
        return path
    import torch

    built = module(architecture)
    values = [p.detach().numpy() for p in built.parameters() if p.requires_grad]
    buffers = dict(built.named_buffers())
    values += [buffers[name].numpy() for name in BIAS_BUFFERS.get(architecture, ())]
    np.savez(path.with_suffix(".npz"), **{str(i): v for i, v in enumerate(values)})
    if architecture in FOLDED:
        derived = FOLDED[architecture](built)
        np.savez(path.with_suffix(".folded.npz"), **{str(i): v for i, v in enumerate(derived)})

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = built

        def forward(self, *args):
            return forward(self.model, architecture, *args)

    names = [n for n, _ in _inputs(architecture)]
    args = tuple(torch.from_numpy(v) for v in feeds(architecture).values())
    fixed = ("x", "pixel_values", "input_features")  # Whisper checks its frame count
    dynamic = {n: {0: "batch"} if n in fixed else {0: "batch", 1: "sequence"} for n in names}
    partial = path.with_suffix(".partial")
    folding = architecture not in UNFOLDED
    deployed._export(Wrapped(), args, names, partial, dynamic, folding)
    partial.rename(path)
    return path


def deployed_form(architecture: str, form: str) -> Path:
    """The file of ``architecture`` in ``form``: its ``Constant`` nodes as initializers (as
    the dynamo exporter, tf2onnx or onnx-simplifier write them), onnxruntime's transformer
    optimizer at level 1 or 2, float16, int8 by ``quantize_dynamic``, QDQ by
    ``quantize_static`` (four unpadded calibration batches), 4-bit ``MatMulNBits`` (blocks
    of 16). Float16: onnxruntime's own converter of the level-1 file for the float-input
    transformers (as its deployment scripts do; onnxconverter-common leaves T5's
    relative-bias ``Div`` with a float and a float16 input), onnxconverter-common's of the
    export for the others (inputs, outputs and casts float32: a converted cast of ids no
    longer type-checks)."""
    import onnxruntime

    source = exported(architecture)
    if form == "float32":
        return source
    made_by = os.environ.get("ONNXGRAD_TEST_FORMS_OF", onnxruntime.__version__)
    target = cache_dir() / f"{architecture}_{form}_ort{made_by}.onnx"
    if not target.exists():  # forms another onnxruntime made are read, never made, here
        target = cache_dir() / f"{architecture}_{form}_ort{onnxruntime.__version__}.onnx"
    if target.exists():
        return target
    partial = target.with_suffix(".partial")
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _make_form(source, form, architecture, partial)
    finally:
        logging.disable(logging.NOTSET)
    partial.rename(target)
    return target


def _make_form(source: Path, form: str, architecture: str, target: Path) -> None:
    if form in OPTIMIZED:
        from onnxruntime.transformers.optimizer import optimize_model

        model_type, heads, hidden = OPTIMIZER[architecture]
        optimized = optimize_model(str(source), model_type, heads, hidden, opt_level=int(form[-1]))
        optimized.save_model_to_file(str(target))
    elif form == "initializers":
        model = onnx.load(source)
        for node in [n for n in model.graph.node if n.op_type == "Constant"]:
            tensor = onnx.TensorProto()
            tensor.CopyFrom(node.attribute[0].t)
            tensor.name = node.output[0]
            model.graph.initializer.append(tensor)
            model.graph.node.remove(node)
        onnx.save(model, target)
    elif form == "float16" and architecture in FLOAT_INPUT:
        from onnxruntime.transformers.onnx_model import OnnxModel

        model = OnnxModel(onnx.load(deployed_form(architecture, "opt1")))
        model.convert_float_to_float16(keep_io_types=True)
        model.save_model_to_file(str(target))
    elif form == "float16":
        from onnxconverter_common import float16

        model = onnx.load(source)
        casts = [n.name for n in model.graph.node if n.op_type == "Cast"]  # left float32
        converted = float16.convert_float_to_float16(
            model, keep_io_types=True, node_block_list=casts
        )
        del converted.graph.value_info[:]
        onnx.save(converted, target)
    elif form == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        model = onnx.load(source)  # a computed kernel (weight norm) stops the quantizer
        computed = _computed_kernels(model)
        quantize_dynamic(source, target, weight_type=QuantType.QInt8, nodes_to_exclude=computed)
    elif form == "qdq":
        batches = [feeds(architecture, seed, padded=False) for seed in range(4)]
        deployed._quantize_static(source, target, batches, STATIC_OP_TYPES.get(architecture))
    elif form == "int4":
        quantizer = deployed._nbits_quantizer(onnx.load(source))
        quantizer.process()
        quantizer.model.save_model_to_file(str(target))
    else:
        raise ValueError(f"unknown form {form!r}")


def _computed_kernels(model: onnx.ModelProto) -> list[str]:
    """The ``Conv`` nodes whose kernel is no initializer (``quantize_dynamic`` refuses them)."""
    stored = {i.name for i in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "Conv" and n.input[1] not in stored]
