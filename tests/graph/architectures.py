"""Tiny PyTorch models of eleven architectures (random weights, every parameter distinct),
exported by torch and turned into the deployed forms onnxruntime's tools make, cached under
``~/.cache/onnxgrad-tests`` (``$ONNXGRAD_TEST_CACHE``) keyed by the versions that made them.

Integer-input ones among them: token ids (GRU, decoders, BERT, T5), bytes compared with
``arange(256)`` (one-hot by ``Equal``), class indices through ``one_hot``.
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

HIDDEN, SEQ, BATCH, VOCAB = 16, 6, 2, 40
TRANSFORMERS = ("llama", "qwen2", "gpt2", "bert", "vit", "t5")
ARCHITECTURES = ("mlp", "cnn", "gru", "bytes", "classes", *TRANSFORMERS)
#: the forms of every architecture; onnxruntime's transformer optimizer only for transformers
FORMS = ("float32", "initializers", "float16", "int8", "qdq", "int4")
OPTIMIZED = ("opt1", "opt2")
#: onnxruntime.transformers.optimizer's model type of each transformer
_MODEL_TYPES = {"llama": "gpt2", "qwen2": "gpt2", "gpt2": "gpt2", "bert": "bert", "vit": "vit"}
_MODEL_TYPES["t5"] = "t5"


def forms(architecture: str) -> tuple[str, ...]:
    return FORMS + OPTIMIZED if architecture in TRANSFORMERS else FORMS


def cache_dir() -> Path:
    """The cache folder of this module's exports, keyed by its source (exports made by one
    environment serve another, without torch)."""
    source = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    root = Path(os.environ.get("ONNXGRAD_TEST_CACHE", "~/.cache/onnxgrad-tests")).expanduser()
    folder = root / "architectures" / source
    folder.mkdir(parents=True, exist_ok=True)
    return folder


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
            self.lin, self.norm, self.out = nn.Linear(256, HIDDEN), nn.LayerNorm(HIDDEN), None
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

    mlp = lambda: nn.Sequential(nn.Linear(8, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 3))  # noqa: E731
    cnn = lambda: nn.Sequential(  # noqa: E731
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.BatchNorm2d(8),  # after the ReLU: the exporter folds a BatchNorm into its Conv
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 3),
    )
    return {"mlp": mlp, "cnn": cnn, "gru": Recurrent, "bytes": Bytes, "classes": Classes}


def _transformer(architecture: str):
    import torch
    import transformers as tf

    sizes = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2)
    decoder = dict(sizes, vocab_size=VOCAB, intermediate_size=2 * HIDDEN)
    if architecture == "llama":
        config = tf.LlamaConfig(**decoder, num_key_value_heads=1, max_position_embeddings=32)
        model = tf.LlamaForCausalLM(config)
    elif architecture == "qwen2":
        config = tf.Qwen2Config(**decoder, num_key_value_heads=1, max_position_embeddings=32)
        model = tf.Qwen2ForCausalLM(config)
    elif architecture == "gpt2":
        config = tf.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=2, n_positions=32)
        model = tf.GPT2LMHeadModel(config)
    elif architecture == "bert":
        config = tf.BertConfig(**decoder, max_position_embeddings=32, num_labels=3)
        model = tf.BertForSequenceClassification(config)
    elif architecture == "vit":
        config = tf.ViTConfig(
            **sizes, intermediate_size=2 * HIDDEN, image_size=8, patch_size=4, num_labels=3
        )
        model = tf.ViTForImageClassification(config)
    else:
        config = tf.T5Config(
            vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=2 * HIDDEN, num_layers=2, num_heads=2,
            relative_attention_num_buckets=8,
        )  # fmt: skip
        model = tf.T5EncoderModel(config)
    config._attn_implementation = "eager"
    model = _randomized(model)

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *args):
            names = [n for n, _ in _inputs(architecture)]
            out = self.model(**dict(zip(names, args)))
            if architecture == "t5":
                return out.last_hidden_state
            return out.logits

    return Wrapped()


def _inputs(architecture: str) -> list[tuple[str, tuple]]:
    if architecture == "mlp":
        return [("x", (BATCH, 8))]
    if architecture in ("cnn",):
        return [("x", (BATCH, 3, 8, 8))]
    if architecture == "vit":
        return [("pixel_values", (BATCH, 3, 8, 8))]
    if architecture == "bert":
        return [("input_ids", (BATCH, SEQ)), ("attention_mask", (BATCH, SEQ))]
    if architecture in TRANSFORMERS:
        return [("input_ids", (BATCH, SEQ))]
    return [("data", (BATCH, SEQ))]


def feeds(architecture: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    values = {}
    for name, shape in _inputs(architecture):
        if name in ("x", "pixel_values"):
            values[name] = rng.standard_normal(shape).astype(np.float32)
        elif name == "attention_mask":
            values[name] = np.ones(shape, np.int64)
        else:
            high = {"bytes": 256, "classes": 10}.get(architecture, VOCAB)
            values[name] = rng.integers(1, high, shape).astype(np.int64)
    return values


def module(architecture: str):
    """The PyTorch module of ``architecture`` (the same random weights every call)."""
    small = _small_modules()
    if architecture in small:
        return _randomized(small[architecture]())
    return _transformer(architecture)


def parameters(architecture: str) -> list[np.ndarray]:
    """The values of ``module(architecture).parameters()``, saved beside the export."""
    path = exported(architecture).with_suffix(".npz")
    with np.load(path) as saved:
        return [saved[k] for k in sorted(saved.files, key=int)]


def exported(architecture: str) -> Path:
    """The float32 export of ``architecture`` (TorchScript exporter, opset 17, dynamic
    batch and sequence), its parameters' values beside it."""
    path = cache_dir() / f"{architecture}_float32.onnx"
    if path.exists():
        return path
    import torch

    built = module(architecture)
    values = [p.detach().numpy() for p in built.parameters()]
    np.savez(path.with_suffix(".npz"), **{str(i): v for i, v in enumerate(values)})
    names = [n for n, _ in _inputs(architecture)]
    args = tuple(torch.from_numpy(v) for v in feeds(architecture).values())
    dynamic = {n: {0: "batch"} if n in ("x", "pixel_values") else {0: "b", 1: "s"} for n in names}
    partial = path.with_suffix(".partial")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            built,
            args,
            str(partial),
            input_names=names,
            output_names=["y"],
            opset_version=17,
            dynamo=False,
            dynamic_axes=dynamic,
        )
    partial.rename(path)
    return path


def deployed(architecture: str, form: str) -> Path:
    """The file of ``architecture`` in ``form``: its ``Constant`` nodes as initializers (as
    the dynamo exporter, tf2onnx or onnx-simplifier write them), onnxruntime's transformer
    optimizer at level 1 or 2, float16 by onnxconverter-common (inputs, outputs and casts
    kept float32: a converted cast of ids no longer type-checks), int8 by
    ``quantize_dynamic``, QDQ by ``quantize_static`` (four calibration batches), 4-bit
    ``MatMulNBits`` (blocks of 16)."""
    import onnxruntime

    source = exported(architecture)
    if form == "float32":
        return source
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

        optimized = optimize_model(
            str(source), _MODEL_TYPES[architecture], 2, HIDDEN, opt_level=int(form[-1])
        )
        optimized.save_model_to_file(str(target))
    elif form == "initializers":
        model = onnx.load(source)
        constants = [n for n in model.graph.node if n.op_type == "Constant"]
        for node in constants:
            tensor = onnx.TensorProto()
            tensor.CopyFrom(node.attribute[0].t)
            tensor.name = node.output[0]
            model.graph.initializer.append(tensor)
            model.graph.node.remove(node)
        onnx.save(model, target)
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

        quantize_dynamic(source, target, weight_type=QuantType.QInt8)
    elif form == "qdq":
        from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

        class Reader(CalibrationDataReader):
            def __init__(self):
                self.batches = iter([feeds(architecture, seed) for seed in range(4)])

            def get_next(self):
                return next(self.batches, None)

        quantize_static(source, target, Reader(), quant_format=QuantFormat.QDQ)
    elif form == "int4":
        from tests.normalize.deployed import _nbits_quantizer

        quantizer = _nbits_quantizer(onnx.load(source))
        quantizer.process()
        quantizer.model.save_model_to_file(str(target))
    else:
        raise ValueError(f"unknown form {form!r}")
