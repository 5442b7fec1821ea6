"""Adapters beside ``quantize_dynamic``'s int8 products with ``integer_branch=True``: the
first product ``x A`` computed from the codes of ``x`` and ``A`` quantized per column
(7 bits), checked against numpy computing that formula from the ONNX specification, against
the float branch (within the rounding of ``x`` and ``A``), and in onnxruntime's optimized
graph (the branch runs as an integer kernel, the base's kernels kept)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import add_lora, merge_lora
from onnxgrad.graph.lora import lora_adapters
from onnxgrad.graph.lora_runtime import runtime_adapter_model
from onnxgrad.training import merge_checkpoint
from onnxgrad.training.artifacts.checkpoint import Checkpoint
from tests.normalize.integer_products import dynamic_quantize

K, H, N, ROWS, RANK = 24, 16, 5, 12, 4
#: onnxruntime's kernels of a product of dynamically quantized activations
INTEGER_KERNELS = ("MatMulIntegerToFloat", "DynamicQuantizeMatMul")


def _integer_product(x: str, weight: str, out: str, bias: str | None = None) -> list:
    """``quantize_dynamic``'s chain for ``x @ weight`` (codes ``<weight>_q``, per-tensor
    scale ``<weight>_s``) reading the codes of ``x`` made by ``<x>_dql``."""
    codes, scale, zero = f"{x}_q", f"{x}_scale", f"{x}_zero"
    nodes = [
        helper.make_node("MatMulInteger", [codes, f"{weight}_q", zero], [f"{out}_i"]),
        helper.make_node("Cast", [f"{out}_i"], [f"{out}_c"], to=TensorProto.FLOAT),
        helper.make_node("Mul", [scale, f"{weight}_s"], [f"{out}_scales"]),
        helper.make_node("Mul", [f"{out}_c", f"{out}_scales"], [f"{out}_m" if bias else out]),
    ]
    if bias:
        nodes.append(helper.make_node("Add", [f"{out}_m", bias], [out]))
    return nodes


def _quantized(name: str, shape, scale: float, rng) -> list:
    """Codes within 7 bits (exact on every CPU) and a per-tensor scale (one per weight:
    onnxruntime merges equal ones, and a shared scale blocks its fusion)."""
    codes = rng.integers(-63, 64, shape).astype(np.int8)
    return [
        numpy_helper.from_array(codes, f"{name}_q"),
        numpy_helper.from_array(np.float32(scale), f"{name}_s"),
    ]


@pytest.fixture(scope="module", params=[17, 21])
def deployed(request) -> onnx.ModelProto:
    """``y1 = x W1 + b``, ``y2 = x W2`` (one ``DynamicQuantizeLinear`` of ``x`` for both),
    ``z = relu(y1) W3``: the int8 form ``quantize_dynamic`` writes, at an opset where
    ``ReduceMax`` takes its axes as an attribute (17) and one where they are an input (21)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["x_q", "x_scale", "x_zero"])]
    nodes += _integer_product("x", "w1", "y1", bias="b1")
    nodes += _integer_product("x", "w2", "y2")
    nodes.append(helper.make_node("Relu", ["y1"], ["h"]))
    nodes.append(helper.make_node("DynamicQuantizeLinear", ["h"], ["h_q", "h_scale", "h_zero"]))
    nodes += _integer_product("h", "w3", "z")
    inits = [
        *_quantized("w1", (K, H), 0.02, rng),
        *_quantized("w2", (K, H), 0.03, rng),
        *_quantized("w3", (H, N), 0.04, rng),
        numpy_helper.from_array(rng.standard_normal(H).astype(np.float32), "b1"),
    ]
    graph = helper.make_graph(
        nodes,
        "int8",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
        [
            helper.make_tensor_value_info(name, TensorProto.FLOAT, [None, cols])
            for name, cols in (("y1", H), ("y2", H), ("z", N))
        ],
        inits,
    )
    opsets = [helper.make_opsetid("", request.param)]
    return helper.make_model(
        graph, opset_imports=opsets, ir_version=10 if request.param > 19 else 8
    )


@pytest.fixture(scope="module")
def trained(deployed) -> onnx.ModelProto:
    """``add_lora``'s model with ``B`` moved off zero, as training does."""
    adapted = add_lora(deployed, rank=RANK)
    rng = np.random.default_rng(1)
    values = {init.name: init for init in adapted.graph.initializer}
    for adapter in lora_adapters(adapted):
        b = values[adapter["b"]]
        b.CopyFrom(
            numpy_helper.from_array(rng.standard_normal(tuple(b.dims)).astype(np.float32), b.name)
        )
    return adapted


def _session(model: onnx.ModelProto, optimized: str | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    if optimized:
        options.optimized_model_filepath = optimized
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _run(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    session = _session(model)
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def _adapter(model: onnx.ModelProto, weight: str) -> tuple[np.ndarray, np.ndarray, float]:
    values = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    adapter = next(a for a in lora_adapters(model) if a["weight"] == weight)
    return values[adapter["a"]], values[adapter["b"]], adapter["scale"]


def _integer_first_product(x: np.ndarray, a: np.ndarray) -> np.ndarray:
    """``s_x (x_q - z_x) (A_q * s_A)`` (float64) as the specification computes it:
    ``DynamicQuantizeLinear``'s codes, ``A`` rounded half to even per column on 63 steps."""
    codes, scale, zero = dynamic_quantize(x)
    step = np.maximum(np.abs(a).max(axis=0) / np.float32(63), np.finfo(np.float32).tiny)
    a_codes = np.rint(a / step.astype(np.float32))
    assert np.abs(a_codes).max() <= 63
    exact = (codes.astype(np.int64) - zero) @ a_codes.astype(np.int64)
    return exact * (np.float64(scale) * step.astype(np.float64))


@pytest.fixture(scope="module")
def x() -> np.ndarray:
    return np.random.default_rng(2).standard_normal((ROWS, K)).astype(np.float32)


def test_the_branch_computes_the_integer_formula(deployed, trained, x):
    floating = _run(merge_lora(trained), {"x": x})
    integer = _run(merge_lora(trained, integer_branch=True), {"x": x})
    for output, weight in (("y1", "w1_q"), ("y2", "w2_q")):
        a, b, scale = _adapter(trained, weight)
        a = (a * np.float32(scale)).astype(np.float32)
        float_branch = x.astype(np.float64) @ a @ b
        integer_branch = _integer_first_product(x, a) @ b
        expected = floating[output] - float_branch + integer_branch
        np.testing.assert_allclose(integer[output], expected, rtol=0, atol=2e-5)
        # the integer branch moves the outputs by the rounding of x and A: a few % of it
        moved = np.abs(integer[output] - floating[output]).max()
        assert 0 < moved < 0.05 * np.abs(float_branch).max()


def test_the_base_kernels_stay_and_the_branch_runs_in_integers(deployed, trained, tmp_path):
    def optimized(model):
        path = str(tmp_path / "optimized.onnx")
        _session(model, path)
        return onnx.load(path)

    def float_readers_of_x(model):
        return sorted(n.op_type for n in model.graph.node if "x" in n.input)

    def integer_weights(model):
        return {n.input[1] for n in model.graph.node if n.op_type in INTEGER_KERNELS}

    base = optimized(deployed)
    floating = optimized(merge_lora(trained))
    assert "MatMul" in float_readers_of_x(floating)  # the float branch reads x again
    for model in (
        merge_lora(trained, integer_branch=True),
        runtime_adapter_model(deployed, trained, integer_branch=True),
    ):
        got = optimized(model)
        assert set(float_readers_of_x(got)) == {"DynamicQuantizeLinear"}
        assert integer_weights(base) <= integer_weights(got)  # each base product fused
        kernels = Counter(n.op_type for n in got.graph.node if n.op_type in INTEGER_KERNELS)
        # 3 products of the base, 2 first products of the branches (x [A1 | A2] shared)
        assert sum(kernels.values()) == 3 + 2, kernels


def test_runtime_adapters_are_quantized_as_fed(deployed, trained, x):
    served = runtime_adapter_model(deployed, trained, integer_branch=True)
    a, b, scale = _adapter(trained, "w1_q")
    adapter = next(ad for ad in lora_adapters(trained) if ad["weight"] == "w1_q")
    other = (np.random.default_rng(3).standard_normal(a.shape) * 0.3).astype(np.float32)
    fed = _run(served, {"x": x, adapter["a"]: other})
    default = _run(served, {"x": x})
    a_scaled = (a * np.float32(scale)).astype(np.float32)
    other_scaled = (other * np.float32(scale)).astype(np.float32)
    expected = (
        default["y1"]
        - _integer_first_product(x, a_scaled) @ b
        + _integer_first_product(x, other_scaled) @ b
    )
    np.testing.assert_allclose(fed["y1"], expected, rtol=0, atol=2e-5)
    merged = _run(merge_lora(trained, integer_branch=True), {"x": x})
    for name in ("y1", "y2", "z"):
        np.testing.assert_allclose(default[name], merged[name], rtol=0, atol=1e-5)


def test_a_kept_integer_branch_folds_again(trained, x):
    kept = merge_lora(trained, integer_branch=True)
    again = merge_lora(kept, quantized="requantize")
    direct = merge_lora(trained, quantized="requantize")
    assert Counter(n.op_type for n in again.graph.node) == Counter(
        n.op_type for n in direct.graph.node
    )
    for name, value in _run(direct, {"x": x}).items():
        np.testing.assert_array_equal(_run(again, {"x": x})[name], value)


def test_merge_checkpoint_passes_the_option(trained, x):
    values = {init.name: numpy_helper.to_array(init) for init in trained.graph.initializer}
    names = [name for a in lora_adapters(trained) for name in (a["a"], a["b"])]
    checkpoint = Checkpoint({name: values[name] for name in names})
    merged = merge_checkpoint(trained, checkpoint, integer_branch=True)
    expected = _run(merge_lora(trained, integer_branch=True), {"x": x})
    for name, value in _run(merged, {"x": x}).items():
        np.testing.assert_array_equal(value, expected[name])
    assert "MatMulInteger" in {n.op_type for n in merged.graph.node if "lora" in n.name}


def test_integer_branch_is_a_bool(trained, deployed):
    with pytest.raises(TypeError, match="integer_branch"):
        merge_lora(trained, integer_branch="int8")
    with pytest.raises(TypeError, match="integer_branch"):
        runtime_adapter_model(deployed, trained, integer_branch=1)
