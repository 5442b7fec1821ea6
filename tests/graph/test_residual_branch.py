"""Where the runtime adapter model's branch joins a float product whose bias and residual sum
a ``LayerNormalization`` reads, ``LN((x W + b) + r)``: onto the residual, ``(x W + b) + (r +
s x A B)``, so onnxruntime still fuses the product's bias ``Add``, the residual ``Add`` and
the norm into one ``SkipLayerNormalization`` (wav2vec2's feed-forward output: a branch
between the product and its bias left onnxruntime 1.32 one bias ``Add`` unfused per layer)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import add_lora, merge_lora
from onnxgrad.graph.deployed_products import weight_products
from onnxgrad.graph.lora_runtime import runtime_adapter_model
from tests.normalize.deployed import trained_adapters
from tests.normalize.kernels import run

K, SEQ = 16, 6


def _model(transposed: bool, residual_first: bool) -> onnx.ModelProto:
    """``LayerNorm((x W + b) + r)`` over ``[2, SEQ, K]``, ``r = LayerNorm(x)`` (the residual
    computed before the product, or after it), ``W`` read as ``Transpose(W^T)`` where
    ``transposed`` (wav2vec2's unfolded export)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((K, K)) * 0.3
    values = {
        "w": w.T if transposed else w,
        "b": rng.standard_normal(K) * 0.3,
        "gamma": 1 + rng.standard_normal(K) * 0.1,
        "beta": rng.standard_normal(K) * 0.1,
    }
    inits = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in values.items()]
    node = helper.make_node
    weight = [node("Transpose", ["w"], ["wt"], perm=[1, 0])] if transposed else []
    norm = [node("LayerNormalization", ["x", "gamma", "beta"], ["r"], axis=-1)]
    product = [node("MatMul", ["x", "wt" if transposed else "w"], ["xw"])]
    nodes = [
        *weight,
        *(norm + product if residual_first else product + norm),
        node("Add", ["xw", "b"], ["h"]),
        node("Add", ["h", "r"], ["s"]),
        node("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=-1),
    ]
    shape = [2, SEQ, K]
    graph = helper.make_graph(
        nodes,
        "residual",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("transposed", [False, True])
def test_the_branch_joins_the_residual_of_a_product_a_skip_layer_norm_reads(tmp_path, transposed):
    model = _model(transposed, residual_first=True)
    weight = "w"
    (product,) = weight_products(model)[weight]
    assert product.residual is not None and product.residual[0].input[1] == "r"
    adapted = trained_adapters(add_lora(model, rank=4, weights=[weight]))
    served = runtime_adapter_model(model, adapted)
    producers = {o: n for n in served.graph.node for o in n.output}
    bias = next(n for n in served.graph.node if n.op_type == "Add" and "b" in n.input)
    assert producers[bias.input[0]].op_type == "MatMul" and bias.input[0] == "xw"
    residual = next(n for n in served.graph.node if n.output[0] == "s")
    total = producers[residual.input[1]]  # r + s x A B, read where r was
    assert total.op_type == "Add" and total.input[0] == "r"
    x = {"x": np.random.default_rng(1).standard_normal((2, SEQ, K)).astype(np.float32)}
    merged = run(merge_lora(adapted), x)[0]
    assert np.abs(run(served, x)[0] - merged).max() < 1e-5
    assert np.abs(run(model, x)[0] - merged).max() > 1e-2  # the adapters change the output
    for rows in (0, 10**6):  # in apply="auto"'s If: the weights' body, the branch's
        chosen = runtime_adapter_model(model, adapted, apply="auto", rows=rows)
        assert np.abs(run(chosen, x)[0] - merged).max() < 1e-5
    deployed, returned = _optimized(model, tmp_path), _optimized(served, tmp_path)
    # the branch's sum is the one Add more; a fused bias stays fused
    assert returned["Add"] == deployed["Add"] + 1
    assert returned["SkipLayerNormalization"] == deployed["SkipLayerNormalization"]


def test_a_residual_computed_after_the_product_keeps_the_branch_at_the_product():
    model = _model(transposed=False, residual_first=False)
    (product,) = weight_products(model)["w"]
    assert product.residual is None  # the branch is inserted after the product: r not yet
    adapted = trained_adapters(add_lora(model, rank=4, weights=["w"]))
    served = runtime_adapter_model(model, adapted)
    producers = {o: n for n in served.graph.node for o in n.output}
    bias = next(n for n in served.graph.node if n.op_type == "Add" and "b" in n.input)
    assert producers[bias.input[0]].op_type == "Add"  # the product's sum with its branch
    x = {"x": np.random.default_rng(1).standard_normal((2, SEQ, K)).astype(np.float32)}
    assert np.abs(run(served, x)[0] - run(merge_lora(adapted), x)[0]).max() < 1e-5


def _optimized(model: onnx.ModelProto, folder) -> Counter:
    """The operators of onnxruntime's optimized graph of ``model`` (default level)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(folder / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return Counter(n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node)
