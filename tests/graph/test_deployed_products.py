"""Where an adapter's branch joins a deployed int8 product with a bias: after the bias ``Add``
(onnxruntime folds that bias, ``[N]`` or ``[1, N]``, into ``MatMulIntegerToFloat`` or
``DynamicQuantizeMatMul``), except where a GELU reads the
sum, whose bias onnxruntime folds into ``BiasGelu`` / ``FastGelu`` (GPT-NeoX, BLOOM, BERT
MLPs): a branch between the bias and the GELU left onnxruntime 1.19 a ``Gelu`` and an
unfused ``Add`` per layer."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import add_lora
from onnxgrad.graph.deployed_products import weight_products
from tests.normalize.deployed import trained_adapters
from tests.normalize.kernels import run

K, N, ROWS = 16, 12, 6


def _erf_gelu(x: str, y: str) -> list:
    node = helper.make_node
    return [
        node("Div", [x, "sqrt2"], [f"{y}_d"]),
        node("Erf", [f"{y}_d"], [f"{y}_e"]),
        node("Add", [f"{y}_e", "one"], [f"{y}_p"]),
        node("Mul", [x, f"{y}_p"], [f"{y}_m"]),
        node("Mul", [f"{y}_m", "half"], [y]),
    ]


def _tanh_gelu(x: str, y: str) -> list:
    """``0.5 x (1 + tanh(c (x + 0.044715 x^3)))``, as BLOOM and GPT-2 write it."""
    node = helper.make_node
    return [
        node("Pow", [x, "three"], [f"{y}_cube"]),
        node("Mul", [f"{y}_cube", "k"], [f"{y}_k"]),
        node("Add", [x, f"{y}_k"], [f"{y}_s"]),
        node("Mul", [f"{y}_s", "c"], [f"{y}_c"]),
        node("Tanh", [f"{y}_c"], [f"{y}_t"]),
        node("Add", [f"{y}_t", "one"], [f"{y}_p"]),
        node("Mul", [x, f"{y}_p"], [f"{y}_m"]),
        node("Mul", [f"{y}_m", "half"], [y]),
    ]


def _residual(x: str, y: str) -> list:
    return [helper.make_node("Add", [x, "x_wide"], [y])]


def _int8_model(tmp_path, after, bias_shape=(N,)) -> onnx.ModelProto:
    """``after(x W + b)`` over ``[ROWS, K]``, quantized by onnxruntime's ``quantize_dynamic``."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    rng = np.random.default_rng(0)
    constants = {
        "w": rng.standard_normal((K, N)) * 0.3,
        "b": rng.standard_normal(bias_shape) * 0.3,
        "sqrt2": np.sqrt(2.0),
        "one": 1.0,
        "half": 0.5,
        "three": 3.0,
        "k": 0.044715,
        "c": np.sqrt(2 / np.pi),
    }
    inits = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in constants.items()]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["h"]),
        helper.make_node("Slice", ["x", "zero", "n", "one_axis"], ["x_wide"]),
        *after("h", "y"),
    ]
    inits += [
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([N], np.int64), "n"),
        numpy_helper.from_array(np.array([1], np.int64), "one_axis"),
    ]
    graph = helper.make_graph(
        nodes,
        "int8",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])],
        inits,
    )
    source = tmp_path / "float.onnx"
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), source
    )
    target = tmp_path / "int8.onnx"
    quantize_dynamic(source, target, weight_type=QuantType.QInt8)
    return onnx.load(target)


def _bias_add(model: onnx.ModelProto) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.op_type == "Add" and "b" in n.input)


#: the exact GELU onnxruntime fuses with its bias (``BiasGelu``); the tanh form as written
#: here it leaves unfused (BLOOM's, which it fuses into ``FastGelu``, is checked by
#: ``benchmarks/sweep_architectures.py``: as many unfused ``Add`` nodes as branch sums)
@pytest.mark.parametrize(("after", "fused"), [(_erf_gelu, True), (_tanh_gelu, False)])
def test_a_branch_beside_an_int8_product_joins_before_a_bias_a_gelu_reads(tmp_path, after, fused):
    model = _int8_model(tmp_path, after)
    (product,) = weight_products(model)["w_quantized"]
    assert product.node.op_type == "Mul"  # the scales' product, before the bias
    adapted = trained_adapters(add_lora(model, rank=4))
    bias = _bias_add(adapted)
    producers = {o: n for n in adapted.graph.node for o in n.output}
    sums = [producers[name] for name in bias.input if name in producers]
    assert [n.name for n in sums] == ["w_quantized_lora_Add"]  # the bias reads the branch's sum
    x = np.random.default_rng(1).standard_normal((ROWS, K)).astype(np.float32)
    assert np.abs(run(adapted, {"x": x})[0] - run(model, {"x": x})[0]).max() > 0
    if fused:  # the branch's sum is the one Add more than the deployed graph keeps
        assert _unfused_adds(adapted, tmp_path) <= _unfused_adds(model, tmp_path) + 1


@pytest.mark.parametrize("bias_shape", [(N,), (1, N)])  # [1, N]: BART's logits bias
def test_a_branch_beside_an_int8_product_joins_after_a_bias_a_residual_reads(tmp_path, bias_shape):
    model = _int8_model(tmp_path, _residual, bias_shape)
    (product,) = weight_products(model)["w_quantized"]
    assert product.node.op_type == "Add" and "b" in product.node.input
    adapted = trained_adapters(add_lora(model, rank=4))
    assert _unfused_adds(adapted, tmp_path) <= _unfused_adds(model, tmp_path) + 1


def _unfused_adds(model: onnx.ModelProto, folder) -> int:
    """The ``Add`` nodes onnxruntime's optimized graph of ``model`` keeps (default level)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(folder / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(options.optimized_model_filepath)
    return Counter(n.op_type for n in optimized.graph.node)["Add"]
