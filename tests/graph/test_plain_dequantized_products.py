"""A weight stored as integer codes and dequantized with plain operators, ``(Cast(q) - z) s``
(what some exports write instead of ``DequantizeLinear``), read by a ``MatMul`` or by a
``Gemm`` with ``transB``, its scale per tensor or per output column, with and without a zero
point: ``add_lora`` puts a float adapter beside the product, the training graph trains it,
and ``merge_lora`` keeps it beside the codes or writes new codes in the file's own form.

References: float64 central differences (:mod:`tests.derivative.fd`) of the file with its
weight ``W`` replaced by ``W + s A B``; numpy's ``W + s A B`` for the merged codes (each value
within half its new step); onnxruntime on that float model for the merged outputs."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import add_lora, get_train_initializer, merge_lora, onnx_derivative
from onnxgrad.graph.initializers import replace_initializers_into_onnx
from onnxgrad.graph.lora import lora_adapters
from onnxgrad.graph.lora_runtime import runtime_adapter_model
from onnxgrad.training import generate_artifacts, merge_checkpoint
from onnxgrad.training.artifacts.checkpoint import Checkpoint
from tests.derivative.fd import onnx_numerical_vjp
from tests.normalize.kernels import run

K, N, M, RANK = 6, 5, 4, 2


#: (operator, code type, scale per column, zero point, form); ``Transpose``: a ``MatMul``
#: reading the weight stored ``N x K`` through a ``Transpose``; form ``mul``: ``Mul`` by the
#: scale ``s``, ``div``: ``Div`` by ``d = 1 / s``; ``cast_z``: the zero point integer codes
#: cast (``Sub(Cast(q), Cast(z))``)
CASES = [
    ("MatMul", np.int8, True, False, "mul"),
    ("MatMul", np.uint8, False, True, "mul"),
    ("Gemm", np.int8, True, True, "mul"),
    ("Gemm", np.int8, False, False, "mul"),
    ("Transpose", np.int16, True, True, "mul"),
    ("MatMul", np.int8, True, False, "div"),
    ("MatMul", np.uint8, False, True, "div"),
    ("Gemm", np.uint8, True, True, "cast_z"),
    ("Transpose", np.int8, False, True, "div_cast_z"),
    ("MatMul", np.int16, True, True, "div_cast_z"),
]


def _ids(case) -> str:
    op, dtype, per_column, zero, form = case
    layout = "column" if per_column else "tensor"
    return f"{op}-{np.dtype(dtype).name}-{layout}-{'z' if zero else 'no_z'}-{form}"


def _model(case, rng, extra_reader: bool = False):
    """``y = tanh(x W (+ c))``, ``W = (Cast(q) - z) s`` or ``(Cast(q) - z) / d`` (``q``
    ``K x N``, or ``N x K`` read by a ``Gemm`` with ``transB`` or through a ``Transpose``;
    ``z`` float, or integer codes cast)."""
    op, dtype, per_column, zero, form = case
    gemm = op in ("Gemm", "Transpose")  # the codes stored N x K
    info = np.iinfo(dtype)
    shape = (N, K) if gemm else (K, N)
    low = info.min if zero or info.min == 0 else info.min + 1
    codes = rng.integers(low, info.max + 1, shape).astype(dtype)
    # as a quantizer writes them: each group of a scale reaches both ends of the range
    ends = codes[:, :2] if gemm else codes[:2].T
    ends[:] = [low, info.max]
    scale_shape = ((N, 1) if gemm else (1, N)) if per_column else ()
    unit = 127 / (info.max if info.min < 0 else 127)  # weights of the int8 range's size
    scale = (rng.random(scale_shape) * 0.02 + 0.01) * unit
    divides = form.startswith("div")
    inits = {"q": codes, "s": (1 / scale if divides else scale).astype(np.float32)}
    nodes = [helper.make_node("Cast", ["q"], ["qf"], to=TensorProto.FLOAT, name="cast")]
    codes_out = "qf"
    if zero:
        middle = 0 if info.min < 0 else 128
        cast_zero = form.endswith("cast_z")
        zero_type = dtype if cast_zero else np.float32
        inits["z"] = (middle + rng.integers(-9, 10, scale_shape)).astype(zero_type)
        if cast_zero:
            cast = helper.make_node("Cast", ["z"], ["zf"], to=TensorProto.FLOAT, name="cast_z")
            nodes.append(cast)
        nodes.append(
            helper.make_node("Sub", ["qf", "zf" if cast_zero else "z"], ["qz"], name="sub")
        )
        codes_out = "qz"
    op_type = "Div" if divides else "Mul"
    nodes.append(helper.make_node(op_type, [codes_out, "s"], ["w"], name="dequantize"))
    if op == "Transpose":
        nodes.append(helper.make_node("Transpose", ["w"], ["w_t"], perm=[1, 0], name="move"))
        nodes.append(helper.make_node("MatMul", ["x", "w_t"], ["h"], name="product"))
    elif gemm:
        inits["c"] = rng.standard_normal(N).astype(np.float32)
        nodes.append(helper.make_node("Gemm", ["x", "w", "c"], ["h"], transB=1, name="product"))
    else:
        nodes.append(helper.make_node("MatMul", ["x", "w"], ["h"], name="product"))
    nodes.append(helper.make_node("Tanh", ["h"], ["y"], name="tanh"))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, N])]
    if extra_reader:  # the float codes read by another node too
        nodes.append(helper.make_node("Relu", ["qf"], ["other"], name="other_reader"))
        outputs.append(helper.make_tensor_value_info("other", TensorProto.FLOAT, list(shape)))
    graph = helper.make_graph(
        nodes,
        "plain_dequantized",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
        outputs,
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _values(model) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def _trained(adapted, rng, std=0.3):
    """``adapted`` with ``B`` drawn (``add_lora`` starts it at 0)."""
    (adapter,) = lora_adapters(adapted)
    b = (rng.standard_normal((RANK, N)) * std).astype(np.float32)
    return replace_initializers_into_onnx(adapted, {adapter["b"]: b})


def _with_update(model, adapter, values):
    """``model`` (the file) whose product reads ``W + s A B`` where it read ``W`` (``A``,
    ``B`` its initializers, ``(s A B)^T`` for a ``Gemm`` reading ``N x K``): the float
    reference."""
    reference = model.__class__()
    reference.CopyFrom(model)
    graph = reference.graph
    product = next(n for n in graph.node if n.name == "product")
    transposed = product.op_type == "Gemm"
    graph.initializer.extend(
        [numpy_helper.from_array(values[adapter[k]], adapter[k]) for k in ("a", "b")]
    )
    graph.initializer.append(numpy_helper.from_array(np.float32(adapter["scale"]), "lora_s"))
    update = [
        helper.make_node("MatMul", [adapter["a"], adapter["b"]], ["ab"]),
        helper.make_node("Mul", ["ab", "lora_s"], ["sab"]),
    ]
    if transposed:
        update.append(helper.make_node("Transpose", ["sab"], ["sab_t"], perm=[1, 0]))
    weight = product.input[1]  # K x N, N x K under transB
    update.append(helper.make_node("Add", [weight, "sab_t" if transposed else "sab"], ["w_new"]))
    product.input[1] = "w_new"
    nodes = list(graph.node)
    index = nodes.index(product)
    del graph.node[:]
    graph.node.extend(nodes[:index] + update + nodes[index:])
    return reference


def _steps(model) -> np.ndarray:
    """The quantization step of a model of :func:`_model`: ``s``, or ``1 / d``."""
    divides = any(n.op_type == "Div" for n in model.graph.node)
    scale = _values(model)["s"].astype(np.float64)
    return 1 / scale if divides else scale


def _dequantized(model) -> np.ndarray:
    """``(q - z) s`` of a model of :func:`_model` (its codes' layout)."""
    values = _values(model)
    zero = values.get("z", np.zeros(()))
    return (values["q"].astype(np.float64) - zero.astype(np.float64)) * _steps(model)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_adapter_gradient_against_float64_differences(case):
    """``add_lora`` adapts the codes (the ``Cast`` their one reader); the training graph's
    gradient with respect to ``A`` and ``B`` equals float64 central differences of the file
    reading ``W + s A B``."""
    rng = np.random.default_rng(1)
    model = _model(case, rng)
    adapted = add_lora(model, rank=RANK)
    (adapter,) = lora_adapters(adapted)
    assert (adapter["weight"], adapter["quantized"], adapter["shape"]) == ("q", "Cast", [K, N])
    trained = _trained(adapted, rng)
    names = sorted([adapter["a"], adapter["b"]])
    # the codes, scale and zero point are no weights (a Gemm's bias is)
    assert set(get_train_initializer(trained)) == {*names, "c"} & set(_values(trained))
    x = rng.standard_normal((M, K)).astype(np.float32)
    seed = rng.standard_normal((M, N)).astype(np.float32)
    gradient = onnx_derivative(trained, inputs=[], weights=names)
    declared = [i.name for i in gradient.graph.input]
    feeds = {"x": x, "y_grad": seed, **{n: _values(trained)[n] for n in names}}
    outputs = run(gradient, {k: v for k, v in feeds.items() if k in declared})
    got = dict(zip([o.name for o in gradient.graph.output], outputs, strict=True))
    reference = _with_update(model, adapter, _values(trained))
    point = {"x": x, **{n: _values(trained)[n] for n in names}}
    want = onnx_numerical_vjp(reference, point, names, seeds=[seed], eps=1e-6)
    for name in names:
        np.testing.assert_allclose(got[f"{name}_grad"], want[name], rtol=1e-4, atol=1e-6)
        assert np.abs(want[name]).max() > 1e-2


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_merged_forms_against_w_plus_sab(case):
    """``keep``: the file's nodes plus the branch, the adapted outputs exactly;
    ``requantize``: the file's nodes, codes of the same type and scales (zero points) of the
    same layout holding ``W + s A B`` within half their new step; outputs within the bound
    that gives of the float model reading ``W + s A B``. ``runtime_adapter_model``: the
    adapted outputs."""
    rng = np.random.default_rng(2)
    model = _model(case, rng)
    trained = _trained(add_lora(model, rank=RANK), rng)
    (adapter,) = lora_adapters(trained)
    x = rng.standard_normal((M, K)).astype(np.float32)
    adapted_y = run(trained, {"x": x})[0]
    assert np.abs(adapted_y - run(model, {"x": x})[0]).max() > 0.05  # the adapters' effect

    kept = merge_lora(trained)
    ops = Counter(n.op_type for n in kept.graph.node) - Counter(n.op_type for n in model.graph.node)
    assert set(ops) <= {"MatMul", "Add", "Mul", "Constant", "Transpose"} and ops["MatMul"] == 2
    np.testing.assert_array_equal(run(kept, {"x": x})[0], adapted_y)
    served = runtime_adapter_model(model, trained)
    np.testing.assert_allclose(run(served, {"x": x})[0], adapted_y, rtol=0, atol=1e-6)

    merged = merge_lora(trained, quantized="requantize")
    assert [n.op_type for n in merged.graph.node] == [n.op_type for n in model.graph.node]
    before, after = _values(model), _values(merged)
    assert set(after) == set(before)
    for name, value in before.items():
        assert (after[name].dtype, after[name].shape) == (value.dtype, value.shape), name
    for name in set(before) - {"q", "s", "z"}:  # the bias
        np.testing.assert_array_equal(after[name], before[name])
    values = _values(trained)
    update = adapter["scale"] * values[adapter["a"]].astype(np.float64) @ values[adapter["b"]]
    stored_transposed = case[0] != "MatMul"  # the codes N x K
    wanted = _dequantized(model) + (update.T if stored_transposed else update)
    step = np.broadcast_to(_steps(merged), wanted.shape)
    assert np.all(np.abs(_dequantized(merged) - wanted) <= 0.5 * step * (1 + 1e-6))
    if "z" in after:
        assert np.array_equal(after["z"], np.round(after["z"]))
    # tanh is 1-Lipschitz: |dy| <= sum_k |x_k| |dW_kn| <= 0.5 sum_k |x_k| step_n
    float_y = run(_with_update(model, adapter, values), {"x": x})[0]
    column_step = step.max(axis=1) if stored_transposed else step.max(axis=0)
    bound = 0.5 * np.abs(x).sum(axis=1, keepdims=True) * column_step + 1e-6
    assert np.all(np.abs(run(merged, {"x": x})[0] - float_y) <= bound)


def test_unadapted_requantize_keeps_the_codes():
    """With ``B = 0`` the merged codes, scales and zero points are the file's."""
    rng = np.random.default_rng(3)
    for case in CASES:
        model = _model(case, rng)
        merged = merge_lora(add_lora(model, rank=RANK), quantized="requantize")
        before, after = _values(model), _values(merged)
        for name, value in before.items():
            np.testing.assert_array_equal(after[name], value, err_msg=f"{_ids(case)}: {name}")


def test_codes_read_by_another_node_are_not_requantized():
    """A ``Relu`` of the float codes has no adapter: ``requantize`` refuses, naming the
    weight and that node; ``keep`` still serves the adapted outputs."""
    rng = np.random.default_rng(4)
    model = _model(CASES[0], rng, extra_reader=True)
    trained = _trained(add_lora(model, rank=RANK), rng)
    with pytest.raises(ValueError, match=r"weight 'q'.*read by node 'other_reader'.*no adapter"):
        merge_lora(trained, quantized="requantize")
    x = rng.standard_normal((M, K)).astype(np.float32)
    np.testing.assert_array_equal(run(merge_lora(trained), {"x": x})[0], run(trained, {"x": x})[0])


def test_a_scale_per_element_is_no_product():
    """A scale with one value per weight is no ``DequantizeLinear`` layout: no adapter,
    refused as before (the model has no float weight to adapt)."""
    rng = np.random.default_rng(5)
    model = _model(CASES[0], rng)
    scale = next(i for i in model.graph.initializer if i.name == "s")
    scale.CopyFrom(numpy_helper.from_array(np.full((K, N), 0.01, np.float32), "s"))
    with pytest.raises(ValueError, match="no MatMul, Gemm or Conv weight to adapt"):
        add_lora(model, rank=RANK)


def test_artifacts_train_the_adapters_and_merge(tmp_path):
    """``generate_artifacts`` trains ``A`` and ``B`` only (the codes, scale and zero point
    frozen); five steps lower the loss; ``merge_checkpoint`` keeps or requantizes."""
    rng = np.random.default_rng(6)
    model = _model(CASES[2], rng)
    adapted = add_lora(model, rank=RANK)
    art = generate_artifacts(adapted, optimizer="sgd", learning_rate=0.5, folder=tmp_path)
    step = art.train_step
    assert sorted(step.weights) == sorted(
        [lora_adapters(adapted)[0]["a"], lora_adapters(adapted)[0]["b"]]
    )
    x = rng.standard_normal((M, K)).astype(np.float32)
    label = np.zeros((M, N), np.float32)
    training_model = str(art.path("training_model.onnx"))
    session = ort.InferenceSession(training_model, providers=["CPUExecutionProvider"])
    values = {**art.checkpoint.weights, **art.checkpoint.optimizer_state}
    losses = []
    for _ in range(5):
        feeds = {"x": x, step.label: label, **values}
        feeds[step.learning_rate] = np.array(art.learning_rate, np.float32)
        wanted = {i.name for i in session.get_inputs()}
        loss, *new = session.run(
            [step.loss, *step.new_weights, *step.new_state],
            {k: v for k, v in feeds.items() if k in wanted},
        )
        losses.append(float(loss))
        values = dict(zip([*step.weights, *step.state], new))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    weights = {name: values[name] for name in step.weights}
    kept = merge_checkpoint(tmp_path, Checkpoint(weights))
    merged = merge_checkpoint(tmp_path, Checkpoint(weights), quantized="requantize")
    assert [n.op_type for n in merged.graph.node] == [n.op_type for n in model.graph.node]
    trained = replace_initializers_into_onnx(adapted, weights)
    np.testing.assert_allclose(run(kept, {"x": x})[0], run(trained, {"x": x})[0], atol=1e-6)
    assert not np.array_equal(_values(merged)["q"], _values(model)["q"])


def test_codes_as_the_divisor_are_no_product():
    """``d / Cast(q)`` is no dequantization (the codes divide): no adapter, refused as a
    scale per element is."""
    rng = np.random.default_rng(7)
    model = _model(CASES[5], rng)
    divide = next(n for n in model.graph.node if n.op_type == "Div")
    divide.input[:] = list(divide.input)[::-1]
    with pytest.raises(ValueError, match="no MatMul, Gemm or Conv weight to adapt"):
        add_lora(model, rank=RANK)
