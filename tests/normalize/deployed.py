"""A tiny BERT classifier and a tiny Llama-like LM (random weights, exported by torch, with
``inputs_embeds`` as their float input) and the forms onnxruntime's tools make of them."""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import onnx

HIDDEN, SEQ, BATCH = 32, 5, 2
FORMS = ("float32", "opt1", "opt2", "float16", "int8", "qdq", "int4")


def tiny_bert(**options):
    """A random two-layer BertForSequenceClassification (3 labels, vocabulary of 50);
    ``options`` go to its config."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * HIDDEN,
        max_position_embeddings=max(16, 2 * SEQ),
        num_labels=3,
        **options,
    )
    return transformers.BertForSequenceClassification(config).eval()


def export_bert(path: Path) -> None:
    import torch

    model = tiny_bert()

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, inputs_embeds, attention_mask):
            return self.model(inputs_embeds=inputs_embeds, attention_mask=attention_mask).logits

    embeds, mask = torch.randn(BATCH, SEQ, HIDDEN), torch.ones(BATCH, SEQ, dtype=torch.int64)
    _export(Classifier(), (embeds, mask), ["inputs_embeds", "attention_mask"], path)


#: the config of the tiny decoders (Llama here, Qwen2 in :mod:`tests.architectures`)
DECODER = {
    "vocab_size": 50,
    "hidden_size": HIDDEN,
    "intermediate_size": 2 * HIDDEN,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": max(32, 2 * SEQ),
    "attn_implementation": "eager",
}


def export_llama(path: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER)).eval()

    class LanguageModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, inputs_embeds):
            mask = torch.ones(inputs_embeds.shape[:2], dtype=torch.int64)
            out = self.model(inputs_embeds=inputs_embeds, attention_mask=mask, use_cache=False)
            return out.logits

    _export(LanguageModel(), (torch.randn(BATCH, SEQ, HIDDEN),), ["inputs_embeds"], path)


def _export(
    module, args, names, path: Path, dynamic: dict | None = None, folding: bool = True
) -> None:
    """Opset 17, TorchScript exporter; ``dynamic`` axes (default: batch and sequence),
    constants folded unless not ``folding``."""
    import torch

    dynamic = dynamic or {name: {0: "batch", 1: "sequence"} for name in names}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            args,
            str(path),
            input_names=names,
            output_names=["logits"],
            opset_version=17,
            dynamo=False,
            dynamic_axes=dynamic,
            do_constant_folding=folding,
        )


def make_form(
    source: Path,
    form: str,
    kind: str,
    folder: Path,
    model_type: str = "",
    heads: int = 0,
    hidden: int = HIDDEN,
    calibration: list | None = None,
    static_op_types: list[str] | None = None,
) -> Path:
    """The file onnxruntime's (or onnxconverter-common's) tool makes of ``source``; the
    float16 form is converted from the optimized one (onnxconverter-common 1.16 fails on the
    raw Llama export), as onnxruntime's deployment guides do, its rotary tables kept in
    float32 (converted, they no longer type-check in onnxruntime). ``model_type``, ``heads``
    and ``hidden`` go to onnxruntime's optimizer (by default this module's BERT's or
    Llama's), ``calibration`` (feeds) and ``static_op_types`` to static quantization."""
    target = folder / f"{kind}_{form}.onnx"
    settings = {"model_type": model_type, "heads": heads, "hidden": hidden}
    logging.disable(logging.WARNING)
    try:
        if form == "float32":
            return source
        if form in ("opt1", "opt2"):
            from onnxruntime.transformers.optimizer import optimize_model

            heads = heads or (2 if kind == "bert" else 4)
            model_type = model_type or ("bert" if kind == "bert" else "gpt2")
            optimized = optimize_model(
                str(source), model_type, heads, hidden, opt_level=int(form[-1])
            )
            optimized.save_model_to_file(str(target))
        elif form == "float16":
            from onnxconverter_common import float16

            optimized = make_form(source, "opt1", kind, folder, **settings)
            model = onnx.load(optimized)
            rotary = [n.name for n in model.graph.node if "rotary_emb" in n.name]
            converted = float16.convert_float_to_float16(
                model, keep_io_types=True, node_block_list=rotary
            )
            del converted.graph.value_info[:]  # some disagree with the Cast nodes it keeps
            onnx.save(converted, target)
        elif form == "int8":
            from onnxruntime.quantization import QuantType, quantize_dynamic

            quantize_dynamic(source, target, weight_type=QuantType.QInt8)
        elif form == "qdq":
            batches = calibration or [feeds(kind, seed, False) for seed in range(4)]
            _quantize_static(source, target, batches, static_op_types)
        elif form == "int4":
            quantizer = _nbits_quantizer(onnx.load(source))
            quantizer.process()
            quantizer.model.save_model_to_file(str(target))
    finally:
        logging.disable(logging.NOTSET)
    return target


def _nbits_quantizer(model: onnx.ModelProto):
    """onnxruntime's 4-bit MatMulNBits quantizer, blocks of 16: its default (round to
    nearest, in C++) where this onnxruntime has that kernel, else its HQQ algorithm (in
    torch; onnxruntime-training 1.19 lacks the C++ one), which writes float zero points."""
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ImportError:
        from onnxruntime.quantization import matmul_4bits_quantizer as module

        config = module.HQQWeightOnlyQuantConfig(block_size=16, bits=4)
        return module.MatMul4BitsQuantizer(model, algo_config=config)
    return MatMulNBitsQuantizer(model, block_size=16, is_symmetric=False)


def feeds(kind: str, seed: int = 0, padded: bool = True) -> dict[str, np.ndarray]:
    """Random embeddings (and, for BERT, a mask padding the second sequence's last two
    tokens). Static quantization is calibrated without padding: padded positions add
    -3.4e38 to the attention scores, a range whose scale overflows to infinity."""
    rng = np.random.default_rng(seed)
    values = {"inputs_embeds": rng.standard_normal((BATCH, SEQ, HIDDEN)).astype(np.float32)}
    if kind == "bert":
        mask = np.ones((BATCH, SEQ), dtype=np.int64)
        if padded:
            mask[1, -2:] = 0
        values["attention_mask"] = mask
    return values


def _quantize_static(
    source: Path, target: Path, calibration: list, op_types: list[str] | None
) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter(calibration)

        def get_next(self):
            return next(self.batches, None)

    quantize_static(
        source, target, Reader(), quant_format=QuantFormat.QDQ, op_types_to_quantize=op_types
    )


#: the operators of an adapter kept beside its base: ``y + s (x A) B`` (casts to float16,
#: transposes of a weight stored transposed, ``x A`` shared by the branches reading one
#: ``x``) or ``W + s reshape(A B)`` over a float weight
BRANCH_OPS = frozenset(
    {"MatMul", "Add", "Mul", "Constant", "Cast", "Transpose", "Reshape"}
    | {"QuantizeLinear", "DequantizeLinear"}  # a QDQ product's sum quantized again
    | {"Concat", "Split"}  # x [A_1 | A_2 | ...] once for the branches reading one x
)


#: the operators an integer branch adds (``integer_branch=True``): ``A`` quantized per column,
#: ``x A`` from the codes of ``x``
INTEGER_BRANCH_OPS = frozenset({"Abs", "ReduceMax", "Div", "Max", "Round", "MatMulInteger"})


def operators(model: onnx.ModelProto) -> Counter:
    """``{(domain, op_type): count}`` of the main graph."""
    return Counter(
        (n.domain if n.domain not in ("", "ai.onnx") else "", n.op_type) for n in model.graph.node
    )


def assert_deployed_form(
    deployed: onnx.ModelProto, got: onnx.ModelProto, beside: bool, integer: bool = False
) -> None:
    """``got`` holds every operator of ``deployed`` (as many times) plus, where adapters
    stay ``beside`` their base, only the default-domain operators of :data:`BRANCH_OPS`
    (and :data:`INTEGER_BRANCH_OPS` for an ``integer`` branch); nothing that exists for
    training (``Floor``, ``Where``, ``Round`` outside an integer branch...)."""
    want, have = operators(deployed), operators(got)
    if not beside:
        assert have == want, {k: have[k] - want[k] for k in want | have if have[k] != want[k]}
        return
    assert not want - have, f"deployed operators lost: {dict(want - have)}"
    extra = have - want
    allowed = BRANCH_OPS | INTEGER_BRANCH_OPS if integer else BRANCH_OPS
    assert all(not d and op in allowed for d, op in extra), f"not an adapter's: {dict(extra)}"
    assert extra, "no adapter branch"


def trained_adapters(adapted: onnx.ModelProto) -> onnx.ModelProto:
    """``adapted`` (``add_lora``'s output) with every ``B`` moved off zero, as training does
    (``N(0, 0.05^2)``, seeded)."""
    from onnxgrad.graph.initializers import replace_initializers_into_onnx
    from onnxgrad.graph.lora import lora_adapters

    rng = np.random.default_rng(1)
    shapes = {i.name: tuple(i.dims) for i in adapted.graph.initializer}
    values = {
        a["b"]: (rng.standard_normal(shapes[a["b"]]) * 0.05).astype(np.float32)
        for a in lora_adapters(adapted)
    }
    return replace_initializers_into_onnx(adapted, values)
