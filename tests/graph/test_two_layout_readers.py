"""One weight ``W`` (``K x N``) read in its two layouts: ``MatMul(x, W)`` and, by a second
product, ``W^T`` (``MatMul(x2, Transpose(W))`` or ``Gemm(x2, W, transB=1)``), ``W`` a float
initializer, a QDQ weight ``DequantizeLinear(q, s)`` or the same written with plain operators,
``(Cast(q) - z) s``. ``add_lora`` gives ``W`` one adapter ``A B`` (``K x N`` as the first
product reads ``W``): beside a quantized weight a branch ``s (x A) B`` by the first product and
``s (x2 B^T) A^T`` by the second, so both read ``W + s A B``.

References, none of them onnxgrad: float64 central differences (:mod:`tests.derivative.fd`)
of the file with ``W`` replaced by ``W + s A B`` (every reader reading the sum) for the
adapters' gradient; numpy's ``W + s A B`` for the merged weights (quantized: each value within
half its new step); onnxruntime on that float file for the merged outputs."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import add_lora, merge_lora, onnx_derivative
from onnxgrad.graph.initializers import replace_initializers_into_onnx
from onnxgrad.graph.lora import lora_adapters
from onnxgrad.graph.lora_runtime import runtime_adapter_model
from tests.derivative.fd import onnx_numerical_vjp
from tests.normalize.kernels import run

K, N, M, RANK = 6, 5, 3, 2

#: (weight form, second reader, K, N, the W^T reader first in the graph)
CASES = [
    ("float", "transpose", K, N, False),
    ("float", "gemm", K, N, False),
    ("qdq", "transpose", K, N, False),
    ("qdq", "gemm", K, N, True),
    ("qdq", "transpose", N, N, False),  # square: the layout, not the shape, tells them apart
    ("plain", "transpose", K, N, True),
    ("plain", "gemm", K, N, False),
    ("plain", "gemm", N, N, False),
]


def _ids(case) -> str:
    form, second, k, n, reversed_order = case
    return f"{form}-{second}-{k}x{n}{'-WT_first' if reversed_order else ''}"


def _model(case, rng):
    """``y1 = tanh(x W)``, ``y2 = tanh(x2 W^T (+ c))``; ``W`` is the value ``w``."""
    form, second, k, n, reversed_order = case
    nodes, inits = [], {}
    if form == "float":
        inits["w"] = (rng.standard_normal((k, n)) * 0.5).astype(np.float32)
    else:
        codes = rng.integers(-127, 128, (k, n)).astype(np.int8)
        codes[:2] = np.array([[-127], [127]])  # each column's group reaches both ends
        inits.update(q=codes, s=(rng.random(n) * 0.01 + 0.004).astype(np.float32))
        if form == "qdq":
            nodes.append(helper.make_node("DequantizeLinear", ["q", "s"], ["w"], axis=1))
        else:
            inits["s"] = inits["s"].reshape(1, n)
            inits["z"] = rng.integers(-3, 4, (1, n)).astype(np.float32)
            nodes += [
                helper.make_node("Cast", ["q"], ["qf"], to=TensorProto.FLOAT),
                helper.make_node("Sub", ["qf", "z"], ["qz"]),
                helper.make_node("Mul", ["qz", "s"], ["w"]),
            ]
    first = [
        helper.make_node("MatMul", ["x", "w"], ["h1"], name="first"),
        helper.make_node("Tanh", ["h1"], ["y1"]),
    ]
    if second == "transpose":
        other = [
            helper.make_node("Transpose", ["w"], ["w_t"], perm=[1, 0]),
            helper.make_node("MatMul", ["x2", "w_t"], ["h2"], name="second"),
        ]
    else:
        inits["c"] = rng.standard_normal(k).astype(np.float32)
        other = [helper.make_node("Gemm", ["x2", "w", "c"], ["h2"], transB=1, name="second")]
    other.append(helper.make_node("Tanh", ["h2"], ["y2"]))
    nodes += other + first if reversed_order else first + other
    graph = helper.make_graph(
        nodes,
        "two_layouts",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, k]),
            helper.make_tensor_value_info("x2", TensorProto.FLOAT, [M, n]),
        ],
        [
            helper.make_tensor_value_info("y1", TensorProto.FLOAT, [M, n]),
            helper.make_tensor_value_info("y2", TensorProto.FLOAT, [M, k]),
        ],
        [numpy_helper.from_array(v, name) for name, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)


def _values(model) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def _trained(model, rng):
    """``add_lora(model)`` with ``B`` drawn (it starts at 0), and its adapter record."""
    adapted = add_lora(model, rank=RANK)
    (adapter,) = lora_adapters(adapted)
    shape = _values(adapted)[adapter["b"]].shape
    b = (rng.standard_normal(shape) * 0.4).astype(np.float32)
    return replace_initializers_into_onnx(adapted, {adapter["b"]: b}), adapter


def _adapter_transposed(case) -> bool:
    """Whether ``A B`` is ``W^T``: a quantized weight's adapter has the layout its first
    product reads (a float one ``W``'s stored layout)."""
    return case[0] != "float" and case[4]


def _update(case, adapter, values) -> np.ndarray:
    """``s A B`` (float64) in ``W``'s ``K x N`` layout."""
    a, b = (values[adapter[key]].astype(np.float64) for key in ("a", "b"))
    update = adapter["scale"] * (a @ b)
    return update.T if _adapter_transposed(case) else update


def _reference(model, update: np.ndarray):
    """The file with ``w`` replaced by ``w + update`` before all its readers."""
    reference = model.__class__()
    reference.CopyFrom(model)
    graph = reference.graph
    for node in graph.node:
        node.input[:] = ["w_new" if name == "w" else name for name in node.input]
    graph.initializer.append(numpy_helper.from_array(update.astype(np.float32), "update"))
    add = helper.make_node("Add", ["w", "update"], ["w_new"])
    nodes = list(graph.node)
    at = next((i + 1 for i, n in enumerate(nodes) if "w" in n.output), 0)
    del graph.node[:]
    graph.node.extend([*nodes[:at], add, *nodes[at:]])
    return reference


def _reference_with_adapters(model, adapter, values, transposed: bool):
    """:func:`_reference` with ``update = s A B`` computed in the graph from ``A`` and ``B``
    (initializers, to differentiate), transposed where the adapter is ``N x K``."""
    reference = _reference(model, np.zeros((1, 1)))
    graph = reference.graph
    graph.initializer.remove(next(i for i in graph.initializer if i.name == "update"))
    names = (adapter["a"], adapter["b"])
    graph.initializer.extend(numpy_helper.from_array(values[n], n) for n in names)
    graph.initializer.append(numpy_helper.from_array(np.float32(adapter["scale"]), "lora_s"))
    made = [
        helper.make_node("MatMul", list(names), ["ab"]),
        helper.make_node("Mul", ["ab", "lora_s"], ["sab" if transposed else "update"]),
    ]
    if transposed:
        made.append(helper.make_node("Transpose", ["sab"], ["update"], perm=[1, 0]))
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(made + nodes)
    return reference


def _feeds(case, rng) -> dict[str, np.ndarray]:
    _, _, k, n, _ = case
    return {
        "x": rng.standard_normal((M, k)).astype(np.float32),
        "x2": rng.standard_normal((M, n)).astype(np.float32),
    }


def _dequantized(model) -> np.ndarray:
    values = _values(model)
    zero = values.get("z", np.zeros(()))
    return (values["q"].astype(np.float64) - zero.astype(np.float64)) * values["s"].astype(
        np.float64
    )


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_adapter_gradient_against_float64_differences(case):
    """One adapter for ``W``; a quantized one gets a branch beside each product (the
    ``W^T`` reader ``(x2 B^T) A^T``); the gradient with respect to ``A`` and ``B`` equals
    float64 central differences of the file reading ``W + s A B`` everywhere."""
    rng = np.random.default_rng(1)
    model = _model(case, rng)
    trained, adapter = _trained(model, rng)
    assert adapter["weight"] == ("w" if case[0] == "float" else "q")
    if case[0] != "float":
        assert adapter["quantized"] == ("DequantizeLinear" if case[0] == "qdq" else "Cast")
        assert len(adapter["sums"]) == 2
    values = _values(trained)
    names = [adapter["a"], adapter["b"]]
    feeds = _feeds(case, rng)
    seeds = [rng.standard_normal((M, case[3])), rng.standard_normal((M, case[2]))]
    seeds = [s.astype(np.float32) for s in seeds]
    gradient = onnx_derivative(trained, inputs=[], weights=names)
    declared = {i.name for i in gradient.graph.input}
    fed = {**feeds, "y1_grad": seeds[0], "y2_grad": seeds[1], **{n: values[n] for n in names}}
    outputs = run(gradient, {k: v for k, v in fed.items() if k in declared})
    got = dict(zip([o.name for o in gradient.graph.output], outputs, strict=True))
    reference = _reference_with_adapters(model, adapter, values, _adapter_transposed(case))
    point = {**feeds, **{n: values[n] for n in names}}
    want = onnx_numerical_vjp(reference, point, names, seeds=seeds, eps=1e-6)
    for name in names:
        np.testing.assert_allclose(got[f"{name}_grad"], want[name], rtol=1e-4, atol=1e-6)
        assert np.abs(want[name]).max() > 1e-2


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_merged_and_served_against_w_plus_sab(case):
    """``keep`` and the runtime adapter model give the adapted outputs; ``requantize`` (a
    float weight: ``W + s A B`` itself) keeps the file's operators, every weight within half
    its new step of ``W + s A B``, the outputs within the bound that gives of the float file
    reading ``W + s A B``; ``apply="weights"`` (QDQ: quantized again per run) too."""
    rng = np.random.default_rng(2)
    model = _model(case, rng)
    trained, adapter = _trained(model, rng)
    values = _values(trained)
    update = _update(case, adapter, values)
    feeds = _feeds(case, rng)
    adapted = run(trained, feeds)
    float_file = run(_reference(model, update), feeds)
    for got, want in zip(adapted, float_file, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    assert max(np.abs(a - b).max() for a, b in zip(adapted, run(model, feeds))) > 0.05
    for got, want in zip(run(merge_lora(trained), feeds), adapted, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    served = runtime_adapter_model(model, trained)
    for got, want in zip(run(served, feeds), adapted, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)

    merged = merge_lora(trained, quantized="requantize")
    assert [n.op_type for n in merged.graph.node] == [n.op_type for n in model.graph.node]
    if case[0] == "float":
        want_w = _values(model)["w"].astype(np.float64) + update
        np.testing.assert_allclose(_values(merged)["w"], want_w, rtol=1e-6, atol=1e-7)
        return
    wanted = _dequantized(model) + update
    step = np.broadcast_to(_values(merged)["s"].astype(np.float64).reshape(1, -1), wanted.shape)
    assert np.all(np.abs(_dequantized(merged) - wanted) <= 0.5 * step * (1 + 1e-6))
    # tanh is 1-Lipschitz: |dy| <= 0.5 max(step) sum |x|
    forms = [("requantize", merged)]
    if case[0] == "qdq":
        forms.append(("weights", runtime_adapter_model(model, trained, apply="weights")))
    for label, form in forms:
        for got, want, x in zip(run(form, feeds), float_file, (feeds["x"], feeds["x2"])):
            bound = 0.5 * step.max() * np.abs(x).sum(axis=1, keepdims=True) * (1 + 1e-5) + 1e-6
            assert np.all(np.abs(got - want) <= bound), label
