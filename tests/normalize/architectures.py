"""Five more transformer architectures (tiny configs of transformers' own classes, random
weights, exported by torch with a float input) and every form onnxruntime's tools deploy of
them: GPT-2, a Qwen2 decoder (grouped key/value heads, rotary), a ViT, a T5 encoder
(relative position bias) and a Whisper encoder (log-mel features ``[B, 80, frames]``, two
strided ``Conv1d`` with exact GELU, sinusoidal positions). Exports and forms are cached in
``$ONNXGRAD_TEST_CACHE`` (default ``~/.cache/onnxgrad-tests``), keyed by the versions of the
tools that made them and the digest of the builders (this module and
:mod:`tests.normalize.deployed`)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from tests.normalize import deployed

HIDDEN, SEQ, BATCH = deployed.HIDDEN, deployed.SEQ, deployed.BATCH
IMAGE, PATCH, CHANNELS = 8, 4, 3
#: Whisper's mel bins and input frames (twice its positions: the second Conv1d has stride 2)
MELS, FRAMES = 80, 16
ARCHITECTURES = ("gpt2", "qwen2", "vit", "t5", "whisper")
FORMS = deployed.FORMS
#: onnxruntime.transformers.optimizer's model_type and head count of each architecture
OPTIMIZER = {
    "gpt2": ("gpt2", 2),
    "qwen2": ("gpt2", 4),
    "vit": ("vit", 2),
    "t5": ("t5", 2),
    "whisper": ("bart", 2),  # onnxruntime's Whisper scripts optimize it as BART
}
#: the operators static quantization is limited to: T5's relative-position buckets (a
#: ``Log`` of ``|i - j|``, minus infinity on the diagonal) quantized give onnxruntime itself
#: out-of-range ``Gather`` indices, so its weighted operators and the bias lookup only
STATIC_OP_TYPES = {"t5": ["MatMul", "Gemm", "Gather"]}
#: the float input each export takes (the one differentiated)
INPUT = {
    "gpt2": "inputs_embeds",
    "qwen2": "inputs_embeds",
    "vit": "pixel_values",
    "t5": "inputs_embeds",
    "whisper": "input_features",
}


def cache_dir() -> Path:
    import onnxruntime
    import torch
    import transformers

    root = Path(os.environ.get("ONNXGRAD_TEST_CACHE", Path.home() / ".cache" / "onnxgrad-tests"))
    tools = f"torch{torch.__version__}-tf{transformers.__version__}-ort{onnxruntime.__version__}"
    builders = hashlib.sha256(Path(__file__).read_bytes() + Path(deployed.__file__).read_bytes())
    key = f"{tools.replace('+', '_')}-{builders.hexdigest()[:12]}"
    folder = root / "deployed-architectures" / key
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def module(kind: str):
    import torch
    import transformers

    torch.manual_seed(0)
    common = {"attn_implementation": "eager"}
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=50, n_embd=HIDDEN, n_layer=2, n_head=2, n_positions=16, **common
        )
        model = transformers.GPT2LMHeadModel(config)
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**deployed.DECODER))
    elif kind == "vit":
        config = transformers.ViTConfig(
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=2 * HIDDEN,
            image_size=IMAGE,
            patch_size=PATCH,
            num_channels=CHANNELS,
            num_labels=3,
            **common,
        )
        model = transformers.ViTForImageClassification(config)
    elif kind == "whisper":
        config = transformers.WhisperConfig(
            d_model=HIDDEN,
            encoder_layers=2,
            encoder_attention_heads=2,
            encoder_ffn_dim=2 * HIDDEN,
            num_mel_bins=MELS,
            max_source_positions=FRAMES // 2,
            **common,
        )
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        model = WhisperEncoder(config)
    else:
        config = transformers.T5Config(
            vocab_size=50,
            d_model=HIDDEN,
            d_kv=HIDDEN // 2,
            d_ff=2 * HIDDEN,
            num_layers=2,
            num_heads=2,
            relative_attention_num_buckets=8,
            **common,
        )
        model = transformers.T5EncoderModel(config)
    return model.eval()


def export(kind: str, path: Path) -> None:
    import torch

    model = module(kind)
    name = INPUT[kind]

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x):
            return forward(self.model, kind, x)

    x = torch.from_numpy(feeds(kind)[name])
    # Whisper's encoder checks its frame count: the batch only is dynamic
    dynamic = {name: {0: "batch"}} if kind == "whisper" else None
    deployed._export(Wrapped(), (x,), [name], path, dynamic)


def bert_ids(name: str) -> Path:
    """A tiny BERT classifier taking token ids, mask and segments (batch and sequence
    dynamic): onnxruntime's optimizer fuses its front into ``EmbedLayerNormalization``,
    whose mask index feeds every ``Attention``; ``name`` is a form (``opt1``, ``opt2``)."""
    folder = cache_dir()
    source = folder / "bert_ids.onnx"
    if not source.exists():
        partial = folder / "bert_ids.partial.onnx"
        _export_bert_ids(partial)
        partial.rename(source)
    target = folder / f"bert_ids_{name}.onnx"
    if not target.exists():
        scratch = folder / "scratch"
        scratch.mkdir(exist_ok=True)
        deployed.make_form(source, name, "bert_ids", scratch, "bert", 2, HIDDEN).rename(target)
    return target


def _export_bert_ids(path: Path) -> None:
    import torch

    model = deployed.tiny_bert(attn_implementation="eager")  # the optimizer fuses eager's

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            out = self.model(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            )
            return out.logits

    values = {k: torch.from_numpy(v) for k, v in bert_ids_feeds(BATCH).items()}
    deployed._export(Classifier(), tuple(values.values()), list(values), path)


def bert_ids_feeds(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Token ids, a mask padding the last sequence's last two tokens, segments."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, SEQ), dtype=np.int64)
    mask[-1, -2:] = 0
    return {
        "input_ids": rng.integers(0, 50, (batch, SEQ)),
        "attention_mask": mask,
        "token_type_ids": rng.integers(0, 2, (batch, SEQ)),
    }


def forward(model, kind: str, x):
    """The output the export names ``logits`` (T5, Whisper: the encoder's last hidden
    state)."""
    import torch

    if kind == "vit":
        return model(pixel_values=x).logits
    if kind == "t5":
        return model(inputs_embeds=x).last_hidden_state
    if kind == "whisper":
        return model(input_features=x).last_hidden_state
    mask = torch.ones(x.shape[:2], dtype=torch.int64)
    return model(inputs_embeds=x, attention_mask=mask, use_cache=False).logits


def feeds(kind: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"vit": (BATCH, CHANNELS, IMAGE, IMAGE), "whisper": (BATCH, MELS, FRAMES)}
    shape = shapes.get(kind, (BATCH, SEQ, HIDDEN))
    return {INPUT[kind]: rng.standard_normal(shape).astype(np.float32)}


def form(kind: str, name: str) -> Path:
    """The cached file of form ``name`` of architecture ``kind`` (made on first use)."""
    folder = cache_dir()
    source = folder / f"{kind}.onnx"
    if not source.exists():
        partial = folder / f"{kind}.partial.onnx"
        export(kind, partial)
        partial.rename(source)
    if name == "float32":
        return source
    target = folder / f"{kind}_{name}.onnx"
    if not target.exists():
        made = _make(source, name, kind, folder)
        if made != target:
            made.rename(target)
    return target


def _make(source: Path, name: str, kind: str, folder: Path) -> Path:
    """``deployed.make_form`` with this architecture's optimizer settings and feeds; float16
    by the optimizer's own converter (``OnnxModel.convert_float_to_float16``, as
    onnxruntime's deployment scripts do) from the level-1 form: onnxconverter-common's
    leaves the T5 encoder's relative-bias ``Div`` with a float and a float16 input, a file
    onnxruntime refuses to load."""
    if name == "float16":
        return _float16(form(kind, "opt1"), folder / f"{kind}_float16.onnx")
    model_type, heads = OPTIMIZER[kind]
    scratch = folder / "scratch"
    scratch.mkdir(exist_ok=True)
    return deployed.make_form(
        source,
        name,
        kind,
        scratch,
        model_type=model_type,
        heads=heads,
        hidden=HIDDEN,
        calibration=[feeds(kind, seed) for seed in range(4)],
        static_op_types=STATIC_OP_TYPES.get(kind),
    )


def _float16(optimized: Path, target: Path) -> Path:
    import onnx
    from onnxruntime.transformers.onnx_model import OnnxModel

    model = OnnxModel(onnx.load(optimized))
    model.convert_float_to_float16(keep_io_types=True)
    model.save_model_to_file(str(target))
    return target
