"""A QDQ weight read by a second product through ``Identity`` -> ``QuantizeLinear`` ->
``DequantizeLinear`` (what ``quantize_static`` makes of ALBERT's layer weights, shared by its
layers): ``add_lora`` adapts both readers with one adapter, as the float32 export's adapter
adapts the one weight both layers read; ``merge_lora(quantized="requantize")`` writes
``W + s A B`` into the shared codes, which the second reader quantizes again with its own
scale as the file does (widened where ``W + s A B`` leaves its range); where another node
reads the dequantized weight, it refuses, naming the weight and that reader. References:
the float model reading ``W + s A B`` (run by onnxruntime), float64 central differences of
it with its rounding frozen (:mod:`tests.normalize.unrounded`)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import add_lora, get_train_initializer, merge_lora, onnx_derivative
from onnxgrad.graph.initializers import replace_initializers_into_onnx
from onnxgrad.graph.lora import lora_adapters
from onnxgrad.graph.lora_runtime import runtime_adapter_model
from tests.derivative.fd import to_double
from tests.normalize.kernels import run
from tests.normalize.unrounded import with_frozen_rounding

K = 8
#: the weight's own scale and the second reader's (an activation's: zero point off 0)
SCALE, SECOND = 0.01, (0.011, -1)
#: the activations' scale and zero point
_ACT = {"s": np.float32(0.02), "z": np.uint8(128)}
WEIGHT = [("DequantizeLinear", ["w", "ws", "wz"], ["wd"])]


def _readers(activations: bool = True) -> list[tuple]:
    """``y = x W W_2`` with ``W_2 = DQ(Q(W, s_2, z_2))`` (``K x K``; quantize_static's
    second reader of a shared weight), ``x`` and ``x W`` quantized where ``activations``."""
    x, h = ("xd", "hd") if activations else ("x", "h")
    quantized = {
        name: [
            ("QuantizeLinear", [name, "s", "z"], [f"{name}q"]),
            ("DequantizeLinear", [f"{name}q", "s", "z"], [f"{name}d"]),
        ]
        for name in ("x", "h")
    }
    rounded = quantized if activations else {"x": [], "h": []}
    return [
        *rounded["x"],
        ("MatMul", [x, "wd"], ["h"], "first"),
        *rounded["h"],
        ("Identity", ["wd"], ["again"]),
        ("QuantizeLinear", ["again", "ws2", "wz2"], ["wq2"], "weight_q"),
        ("DequantizeLinear", ["wq2", "ws2", "wz2"], ["wd2"]),
        ("MatMul", [h, "wd2"], ["y"], "second"),
    ]


def _model(rng, extra=(), activations: bool = True):
    codes = rng.integers(-127, 128, (K, K)).astype(np.int8)
    inits = {
        **_ACT,
        "w": codes,
        "ws": np.float32(SCALE),
        "wz": np.int8(0),
        "ws2": np.float32(SECOND[0]),
        "wz2": np.int8(SECOND[1]),
    }
    return _graph(WEIGHT + _readers(activations) + list(extra), inits)


def _graph(nodes, inits, outputs=("y",)):
    made = [helper.make_node(n[0], n[1], n[2], name=n[3] if len(n) > 3 else "") for n in nodes]
    graph = helper.make_graph(
        made,
        "shared",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, K])],
        [_output(o) for o in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)


def _output(name: str):
    shape = [2, K] if name == "y" else [K, K]
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _trained(adapted, rng, std=0.05):
    shapes = {i.name: tuple(i.dims) for i in adapted.graph.initializer}
    b = lora_adapters(adapted)[0]["b"]
    value = (rng.standard_normal(shapes[b]) * std).astype(np.float32)
    return replace_initializers_into_onnx(adapted, {b: value})


def _values(model, names):
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.name in names}


def _float_reference(model, adapted, activations: bool = True, second: str = "rounded"):
    """``model`` reading ``W + s A B`` (computed in the graph from ``A`` and ``B``, float)
    where it read the codes' ``DequantizeLinear``: what the float32 export's adapter gives
    both layers. The second reader quantizes it again with its own scale (``"rounded"``),
    reads it as the float32 export does (``"float"``) or reads ``W`` (``"unadapted"``)."""
    adapter = lora_adapters(adapted)[0]
    inits = _values(model, {i.name for i in model.graph.initializer})
    codes = inits.pop("w").astype(np.float32)
    inits |= _values(adapted, {adapter["a"], adapter["b"]})
    inits |= {"w_float": codes * np.float32(SCALE), "lora_s": np.float32(adapter["scale"])}
    update = [
        ("MatMul", [adapter["a"], adapter["b"]], ["ab"]),
        ("Mul", ["ab", "lora_s"], ["sab"]),
        ("Add", ["w_float", "sab"], ["wd"]),
    ]
    readers = _readers(activations)
    if second == "unadapted":
        readers = [(n[0], ["w_float"], *n[2:]) if n[0] == "Identity" else n for n in readers]
    if second == "float":
        readers = [n for n in readers if n[2][0] not in ("wq2", "wd2")]
        readers = [(n[0], n[1], ["wd2"]) if n[0] == "Identity" else n for n in readers]
    return _graph(update + readers, inits, outputs=("y", "wd", "wd2"))


def test_add_lora_adapts_both_readers_with_one_adapter():
    rng = np.random.default_rng(6)
    model = _model(rng, activations=False)
    adapted = add_lora(model, rank=2)
    (adapter,) = lora_adapters(adapted)
    assert adapter["weight"] == "w" and len(adapter["sums"]) == 2
    # the float32 export: one float weight read by both layers, one adapter
    weight = rng.standard_normal((K, K)).astype(np.float32)
    float_model = _graph(_readers(), _values(model, {"ws2", "wz2"}) | {"wd": weight, **_ACT})
    assert len(lora_adapters(add_lora(float_model, rank=2))) == len(lora_adapters(adapted))
    # the training graph's forward: both layers read W + s A B, as in the float32 export,
    # the second up to the file's own rounding: |Q(W) - W| <= s_2 / 2, so y within
    # s_2 / 2 sum_k |h_k|
    trained = _trained(adapted, rng, std=0.5)
    x = rng.standard_normal((2, K)).astype(np.float32)
    y, weight, _ = run(_float_reference(model, trained, False, second="float"), {"x": x})
    bound = 0.5 * SECOND[0] * float(np.abs(x @ weight).sum(axis=-1).max())
    got = run(trained, {"x": x})[0]
    assert np.abs(got - y).max() < bound
    assert np.abs(got - run(model, {"x": x})[0]).max() > 10 * bound  # the adapters' effect
    first_only = run(_float_reference(model, trained, False, second="unadapted"), {"x": x})
    assert np.abs(got - first_only[0]).max() > 10 * bound


def test_gradient_of_both_readers_against_float64_differences():
    """At ``B = 0`` (add_lora's start), the training graph's gradient with respect to ``B``
    against float64 central differences of the float reference, its weight's rounding
    frozen (the straight-through estimator): exact where both readers are adapted, and
    another gradient where the first alone is."""
    rng = np.random.default_rng(6)
    model = _model(rng, activations=False)
    adapted = add_lora(model, rank=2)
    (adapter,) = lora_adapters(adapted)
    names = sorted(get_train_initializer(adapted))
    assert names == [adapter["a"], adapter["b"]]
    x = rng.standard_normal((2, K)).astype(np.float32)
    seed = rng.standard_normal((2, K)).astype(np.float32)
    gradient = onnx_derivative(adapted, inputs=[], weights=names)
    feeds = {"x": x, "y_grad": seed, **_values(adapted, set(names))}
    declared = [i.name for i in gradient.graph.input]
    outputs = run(gradient, {k: v for k, v in feeds.items() if k in declared})
    got = dict(zip([o.name for o in gradient.graph.output], outputs, strict=True))
    b = _values(adapted, {adapter["b"]})[adapter["b"]].astype(np.float64)
    direction = rng.standard_normal(b.shape)
    along = float(np.sum(got[f"{adapter['b']}_grad"].astype(np.float64) * direction))

    def differences(both: bool) -> float:
        second = "rounded" if both else "unadapted"
        reference = _float_reference(model, adapted, activations=False, second=second)
        del reference.graph.output[1:]
        frozen = to_double(_live(with_frozen_rounding(reference, {"x": x})))

        def score(value):
            moved = replace_initializers_into_onnx(frozen, {adapter["b"]: value})
            return float(np.sum(run(moved, {"x": x.astype(np.float64)})[0] * seed))

        eps = 1e-4
        return (score(b + eps * direction) - score(b - eps * direction)) / (2 * eps)

    want = differences(both=True)
    assert abs(along - want) <= 1e-5 * abs(want)
    assert abs(along - differences(both=False)) > 0.5 * abs(want)


@pytest.mark.parametrize("std", [0.05, 0.5])
def test_requantize_writes_w_plus_sab_into_the_shared_codes(std):
    """The merged codes hold ``W' = W + s A B`` within half their step; the second reader
    quantizes them again with its own scale and zero point where ``W'`` lies in their range
    (``B``'s std 0.05: the file's computation, unchanged), else with the range widened to
    ``W'``'s (std 0.5), so within half a step of each rounding of ``W'``, nothing clipped."""
    rng = np.random.default_rng(7)
    model = _model(rng)
    trained = _trained(add_lora(model, rank=2), rng, std=std)
    merged = merge_lora(trained, quantized="requantize")
    assert [n.op_type for n in merged.graph.node] == [n.op_type for n in model.graph.node]
    x = rng.standard_normal((2, K)).astype(np.float32)
    _, want, _ = run(_float_reference(model, trained), {"x": x})
    probed = _graph([], {}, outputs=())
    probed.CopyFrom(merged)
    probed.graph.output.extend([_output(o) for o in ("wd", "wd2")])
    _, first, second = run(probed, {"x": x})
    new = _values(merged, {"ws", "ws2", "wz2"})
    widened = std == 0.5
    assert (float(new["ws2"]) > SECOND[0]) == widened
    assert widened or (float(new["ws2"]), int(new["wz2"])) == (np.float32(SECOND[0]), SECOND[1])
    steps = float(new["ws"]), float(new["ws2"])
    assert np.abs(first - want).max() <= 0.5 * steps[0] * (1 + 1e-5)
    assert np.abs(second - first).max() <= 0.5 * steps[1] * (1 + 1e-5)
    # keep and the runtime adapter model's branches are the training graph; its weights
    # quantized again per run are the merged ones (the same rule in float32)
    expected = run(trained, {"x": x})[0]
    np.testing.assert_array_equal(run(merge_lora(trained), {"x": x})[0], expected)
    served = runtime_adapter_model(model, trained)
    np.testing.assert_allclose(run(served, {"x": x})[0], expected, rtol=0, atol=1e-5)
    weights = runtime_adapter_model(model, trained, apply="weights")
    np.testing.assert_allclose(run(weights, {"x": x})[0], run(merged, {"x": x})[0], atol=1e-5)


def _live(model):
    """``model`` without the nodes no output depends on (the frozen file's dead
    ``QuantizeLinear`` nodes)."""
    needed, kept = {o.name for o in model.graph.output}, []
    for node in reversed(model.graph.node):
        if needed & set(node.output):
            kept.append(node)
            needed |= set(node.input)
    del model.graph.node[:]
    model.graph.node.extend(reversed(kept))
    return model


@pytest.mark.parametrize("reader", ["Relu", "MatMul"])
def test_a_weight_also_read_by_another_node_is_not_requantized(reader):
    """A ``Relu`` of the requantized weight, or a product reading it as its activation (no
    weight of a product), has no adapter: ``requantize`` refuses, naming it."""
    inputs = ["wd2", "x_t"] if reader == "MatMul" else ["wd2"]
    extra = [("Transpose", ["x"], ["x_t"])] if reader == "MatMul" else []
    extra += [(reader, inputs, ["other"], "other_reader")]
    rng = np.random.default_rng(8)
    model = _model(rng, extra)
    shape = [K, 2] if reader == "MatMul" else [K, K]
    model.graph.output.append(helper.make_tensor_value_info("other", TensorProto.FLOAT, shape))
    adapted = add_lora(model, rank=2)
    assert len(lora_adapters(adapted)[0]["sums"]) == 2
    trained = _trained(adapted, rng)
    with pytest.raises(ValueError, match=r"weight 'w'.*read by node 'other_reader'.*no adapter"):
        merge_lora(trained, quantized="requantize")
    x = rng.standard_normal((2, K)).astype(np.float32)
    np.testing.assert_array_equal(run(merge_lora(trained), {"x": x})[0], run(trained, {"x": x})[0])
