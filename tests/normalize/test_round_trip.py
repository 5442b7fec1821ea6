"""What comes back ships like what went in: for each form onnxruntime's tools make of a tiny
Llama and a tiny BERT (and of one architecture per class of product,
:data:`ARCHITECTURE_CASES`), the adapted model, the merged ones (``keep`` and ``requantize``)
and the runtime adapter model hold the deployed file's operators (plus the adapters' own
branch where it stays beside a quantized base, nothing that exists for training), pass
onnx's checker where it knows their operators, and predict what the training graph (the
normalised adapted model, with the same trained adapters) predicts: to float rounding where
adapters are kept or folded into float weights, within the re-quantization error
otherwise."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest

from onnxgrad import add_lora, merge_lora
from onnxgrad._onnx_utils import checker_knows
from onnxgrad.graph.lora import lora_adapters
from onnxgrad.graph.lora_runtime import runtime_adapter_model
from onnxgrad.normalize import normalized_model
from tests import architectures
from tests.normalize import deployed
from tests.normalize.integer_products import u8s8_kernel_path, with_exact_integer_products
from tests.normalize.kernels import run

pytestmark = pytest.mark.slow
pytest.importorskip("torch")
pytest.importorskip("transformers")

QUANTIZED = ("int8", "qdq", "int4")
_CODES = {
    onnx.TensorProto.INT8,
    onnx.TensorProto.UINT8,
    onnx.TensorProto.INT4,
    onnx.TensorProto.UINT4,
}
#: onnxruntime's kernels computing a weight product, fused from the deployed operators
PRODUCT_KERNELS = frozenset(
    {"QLinearMatMul", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "MatMulNBits", "Gemm"}
)


def _optimized(model: onnx.ModelProto, folder) -> onnx.ModelProto:
    """The graph onnxruntime runs ``model`` with at its default optimization level (the
    optimized model it writes)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    options.optimized_model_filepath = str(folder / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return onnx.load(options.optimized_model_filepath)


def _kernels(optimized: onnx.ModelProto, integer: bool) -> Counter:
    """The product kernels of ``optimized``; for an ``integer`` branch, which reads the codes
    ``DynamicQuantizeLinear`` gives the base, a ``DynamicQuantizeMatMul`` counts as the
    ``MatMulIntegerToFloat`` it then becomes."""
    kernels = Counter(n.op_type for n in optimized.graph.node if n.op_type in PRODUCT_KERNELS)
    if integer:
        kernels["MatMulIntegerToFloat"] += kernels.pop("DynamicQuantizeMatMul", 0)
    return kernels


def _fused_weights(optimized: onnx.ModelProto, deployed: onnx.ModelProto) -> set[str]:
    """The integer weights of ``deployed`` that a product kernel of ``optimized`` reads."""
    integer = {i.name for i in deployed.graph.initializer if i.data_type in _CODES}
    return {
        name
        for n in optimized.graph.node
        if n.op_type in PRODUCT_KERNELS
        for name in n.input
        if name in integer
    }


def _check(model: onnx.ModelProto) -> None:
    if checker_knows(model):
        onnx.checker.check_model(model, full_check=True)


def _predicted(model: onnx.ModelProto, feeds) -> np.ndarray:
    """``model``'s output with its integer products summed exactly, as their specification
    says: onnxruntime's u8s8 kernels on CPUs without VNNI saturate pairs of products to int16,
    so a model holding int8 weights of ``MatMulInteger`` runs as its ``uint8`` copy (the same
    products, exact on every CPU), checked equal to the model itself where its kernels are
    exact too."""
    exact = with_exact_integer_products(model)
    if exact.SerializeToString() == model.SerializeToString():
        return run(model, feeds)[0]
    outputs = run(exact, feeds)[0]
    if u8s8_kernel_path() == "exact":
        np.testing.assert_array_equal(run(model, feeds)[0], outputs)
    return outputs


@pytest.mark.parametrize("kind", ["bert", "llama"])
@pytest.mark.parametrize("form", deployed.FORMS)
def test_what_comes_back_keeps_the_deployed_form(forms, kind, form, tmp_path):
    model = onnx.load(forms(kind, form))
    source = onnx.load(forms(kind, "float32"))
    _assert_round_trip(model, form, deployed.feeds(kind), tmp_path, source)


#: one small architecture per class of product the round trip must find: GPT-2's ``Gemm``
#: over QDQ weights (``QGemm``), the convolution kernels of a ViT's patch embedding (which
#: the runtime adapter model updates, no product reading them) over float and 4-bit bases,
#: GPT-NeoX's int8 products whose bias a GELU reads (onnxruntime's ``BiasGelu`` kept)
ARCHITECTURE_CASES = [("gpt2", "qdq"), ("vit", "float32"), ("vit", "int4"), ("neox", "int8")]


@pytest.mark.parametrize(("kind", "form"), ARCHITECTURE_CASES)
def test_architecture_comes_back_in_its_form(kind, form, tmp_path):
    try:
        model = onnx.load(architectures.deployed_form(kind, form))
    except ImportError as exc:  # a tool whose kernel this onnxruntime build lacks
        pytest.skip(f"this onnxruntime cannot make the {form} form: {exc}")
    export = onnx.load(architectures.deployed_form(kind, "float32"))
    adapted = _assert_round_trip(model, form, architectures.feeds(kind), tmp_path, export)
    # every weight its float32 export adapts has an adapter in this form too
    assert len(lora_adapters(adapted)) == len(lora_adapters(add_lora(export, rank=4)))


def _assert_round_trip(
    model: onnx.ModelProto, form: str, feeds, tmp_path, source: onnx.ModelProto | None = None
) -> onnx.ModelProto:
    """Every model that comes back from ``model`` keeps its form and predicts what the
    training graph predicts (module docstring); returns the adapted model. Where rounding
    enters (float16 weights, requantized codes, an integer branch's codes of ``x``), within
    a fraction of the adapters' effect or the precision of the form itself, how far
    ``model`` is from its float32 ``source`` (randomized layers of 0.3 std give activations
    whose int8 step is coarse: Mistral's int8 file is 0.09 off its source, its integer
    branch 0.05 off the training graph)."""
    quantized = form in QUANTIZED
    adapted = add_lora(model, rank=4)
    deployed.assert_deployed_form(model, adapted, beside=True)
    trained = deployed.trained_adapters(adapted)
    before = _predicted(model, feeds)
    reference = run(normalized_model(trained), feeds)[0]  # the training graph
    effect = np.abs(reference - before).max()
    assert effect > 0
    precision = 0.0 if source is None else float(np.abs(before - run(source, feeds)[0]).max())
    exact = max(5e-3 * effect, precision) if form == "float16" else 1e-5 * effect + 1e-6

    keep = merge_lora(trained)
    deployed.assert_deployed_form(model, keep, beside=quantized)
    requantized = merge_lora(trained, quantized="requantize")
    deployed.assert_deployed_form(model, requantized, beside=False)
    served = runtime_adapter_model(model, trained)
    deployed.assert_deployed_form(model, served, beside=True)
    weighted = runtime_adapter_model(model, trained, apply="weights")
    _assert_weight_update_form(model, weighted)
    for result in (adapted, keep, requantized):
        _check(result)
    returned = {"adapted": trained, "keep": keep, "runtime": served, "runtime-w": weighted}
    integer = {}
    if form == "int8":  # the branch's x A from the codes of x (integer_branch=True)
        integer["keep-int"] = merge_lora(trained, integer_branch=True)
        integer["runtime-int"] = runtime_adapter_model(model, trained, integer_branch=True)
        for result in integer.values():
            deployed.assert_deployed_form(model, result, beside=True, integer=True)
    # the branch beside a product leaves it to onnxruntime's fusions: every product kernel
    # (QDQ: QLinearMatMul) and every Add folded into one (a bias) stay fused
    optimized = _optimized(model, tmp_path)
    for name, result in {**returned, **integer}.items():
        got = _optimized(result, tmp_path)
        lost = _kernels(optimized, name in integer) - _kernels(got, name in integer)
        assert not lost, f"{name}: onnxruntime no longer fuses {dict(lost)}"
        # (runtime-w: the kernels read the codes computed per run, as many kernels)
        unfused = _fused_weights(optimized, model) - _fused_weights(got, model)
        assert not unfused or name == "runtime-w", f"{name}: no kernel reads {sorted(unfused)}"
        fused_adds = Counter(n.op_type for n in optimized.graph.node)["Add"]
        got_adds = Counter(n.op_type for n in got.graph.node)["Add"]
        sums = deployed.operators(result)["", "Add"] - deployed.operators(model)["", "Add"]
        assert got_adds - fused_adds <= sums, f"{name}: Adds no longer fused"

    for result in (trained, keep, served):
        np.testing.assert_allclose(_predicted(result, feeds), reference, rtol=0, atol=exact)
    for result in integer.values():  # within the rounding of x and A: ~2 % of the effect
        tolerance = max(0.05 * effect, precision)
        np.testing.assert_allclose(_predicted(result, feeds), reference, rtol=0, atol=tolerance)
    # requantized codes: a new rounding of every weight where the training graph reads the
    # deployed codes, so up to two roundings of the form's precision
    tolerance = max(0.25 * effect, 2 * precision) if quantized else exact
    np.testing.assert_allclose(_predicted(requantized, feeds), reference, rtol=0, atol=tolerance)
    # weights updated per run: float ones as the training graph, QDQ and int8 ones as the
    # merge quantizes them again (same codes, 4-bit blocks packed again included)
    requantized_like = form in ("qdq", "int8", "int4")
    want = _predicted(requantized if requantized_like else trained, feeds)
    tolerance = 1e-3 * effect if requantized_like else exact
    np.testing.assert_allclose(_predicted(weighted, feeds), want, rtol=0, atol=tolerance)
    return adapted


#: what ``runtime_adapter_model(..., apply="weights")`` adds to the deployed operators:
#: ``W + s A B`` and, over a quantized weight, its quantization again (4-bit codes unpacked
#: and packed again: ``Mod``, ``Pad``, ``ReduceSum``)
WEIGHT_UPDATE_OPS = deployed.BRANCH_OPS | {
    *("Sub", "Div", "Min", "Max", "ReduceMin", "ReduceMax", "Greater", "Where", "Round", "Clip"),
    *("Mod", "Pad", "ReduceSum", "Neg"),
}


def _assert_weight_update_form(model: onnx.ModelProto, got: onnx.ModelProto) -> None:
    want, have = deployed.operators(model), deployed.operators(got)
    assert not want - have, f"deployed operators lost: {dict(want - have)}"
    extra = have - want
    assert all(not d and op in WEIGHT_UPDATE_OPS for d, op in extra), dict(extra)
