"""Plain-operator dequantizations per block and of 4-bit codes: the codes ``q`` (int8, uint8,
int4 or uint4, ``K x N`` or ``N x K``) cast, ``Reshape``d so that ``K`` splits into blocks of
``b`` (``[K/b, b, N]`` or ``[N, K/b, b]``), less a zero point and times (or divided by) a scale
of one value per block (and per column), ``Reshape``d back: group quantization written with
default-domain operators; and 4-bit codes per column without blocks. ``add_lora`` puts a float
adapter beside the product; ``merge_lora`` keeps it or writes new codes in the file's form.

References, none of them onnxgrad: float64 central differences (:mod:`tests.derivative.fd`)
of the file with ``W`` replaced by ``W + s A B``; numpy's ``W + s A B`` for the merged codes
(each value within half its block's new step); onnx's reference evaluator for the outputs
(onnxruntime 1.19 has no ``Cast`` from 4-bit integers; a newer one is checked against it)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import add_lora, get_train_initializer, merge_lora, onnx_derivative
from onnxgrad.graph.initializers import replace_initializers_into_onnx
from onnxgrad.graph.lora import lora_adapters
from onnxgrad.graph.lora_runtime import runtime_adapter_model
from tests.derivative.fd import onnx_numerical_vjp
from tests.normalize.kernels import kernel_outputs

K, N, M, RANK = 8, 5, 3, 2

#: (code type, layout, block size (0: none), scale per column, form, zero point); layout
#: ``rows``: ``q`` ``K x N`` read by a ``MatMul``, ``cols``: ``N x K`` by a ``Gemm`` with
#: ``transB``; form ``mul`` or ``div`` (by ``d = 1 / s``); zero ``''``, ``float`` or ``cast``
#: (integer codes cast)
CASES = [
    ("int8", "rows", 4, True, "mul", ""),
    ("uint8", "cols", 4, True, "mul", "float"),
    ("int8", "rows", 2, False, "div", "cast"),
    ("int4", "rows", 0, True, "mul", ""),
    ("uint4", "cols", 4, True, "mul", "cast"),
    ("int4", "rows", 4, True, "div", "float"),
]
TYPES = {"int8": np.int8, "uint8": np.uint8, "int4": ml_dtypes.int4, "uint4": ml_dtypes.uint4}


def _ids(case) -> str:
    kind, layout, block, per_column, form, zero = case
    blocks = f"b{block}" if block else "2d"
    return f"{kind}-{layout}-{blocks}-{'col' if per_column else 'block'}-{form}-{zero or 'no_z'}"


def _blocks(case) -> tuple[int, ...]:
    """The 3-D shape the codes are reshaped to (their own 2-D one without blocks)."""
    _, layout, block, _, _, _ = case
    if not block:
        return (K, N) if layout == "rows" else (N, K)
    return (K // block, block, N) if layout == "rows" else (N, K // block, block)


def _parameter_shape(case) -> tuple[int, ...]:
    """The scale's (and zero point's) shape: per block (and column), with 1 within a block."""
    _, layout, block, per_column, _, _ = case
    if not block:
        return (1, N) if layout == "rows" else (N, 1)
    if layout == "rows":
        return (K // block, 1, N if per_column else 1)
    return (N if per_column else 1, K // block, 1)


def _model(case, rng):
    """``y = tanh(x W (+ c))``, ``W`` the value ``w`` dequantized from ``q``."""
    kind, layout, block, _, form, zero = case
    dtype = TYPES[kind]
    info = ml_dtypes.iinfo(dtype)
    low, high = int(info.min) + (0 if zero or info.min == 0 else 1), int(info.max)
    shape = _blocks(case)
    codes = rng.integers(low, high + 1, shape)
    within = -1 if layout == "cols" else 1 if block else 0  # the axis along a group
    # as a quantizer writes them: each group reaches both ends of the range
    np.moveaxis(codes, within, 0)[:2] = np.array([low, high]).reshape(
        (2,) + (1,) * (len(shape) - 1)
    )
    stored = (K, N) if layout == "rows" else (N, K)
    scale = (rng.random(_parameter_shape(case)) * 0.1 + 0.1) / high  # weights up to 0.2
    inits = {
        "q": numpy_helper.from_array(codes.reshape(stored).astype(dtype), "q"),
        "s": numpy_helper.from_array((1 / scale if form == "div" else scale).astype(np.float32)),
    }
    nodes = [helper.make_node("Cast", ["q"], ["qf"], to=TensorProto.FLOAT)]
    value = "qf"
    if block:
        inits["blocks"] = numpy_helper.from_array(np.array(shape, np.int64))
        nodes.append(helper.make_node("Reshape", ["qf", "blocks"], ["qb"]))
        value = "qb"
    if zero:
        middle = 0 if info.min < 0 else (high + 1) // 2
        points = middle + rng.integers(-2, 3, _parameter_shape(case))
        if zero == "cast":
            inits["z"] = numpy_helper.from_array(points.astype(dtype))
            nodes.append(helper.make_node("Cast", ["z"], ["zf"], to=TensorProto.FLOAT))
        else:
            inits["z"] = numpy_helper.from_array(points.astype(np.float32))
        nodes.append(helper.make_node("Sub", [value, "zf" if zero == "cast" else "z"], ["qz"]))
        value = "qz"
    op_type = "Div" if form == "div" else "Mul"
    nodes.append(helper.make_node(op_type, [value, "s"], ["ws" if block else "w"]))
    if block:
        inits["stored"] = numpy_helper.from_array(np.array(stored, np.int64))
        nodes.append(helper.make_node("Reshape", ["ws", "stored"], ["w"]))
    if layout == "rows":
        nodes.append(helper.make_node("MatMul", ["x", "w"], ["h"]))
    else:
        inits["c"] = numpy_helper.from_array(rng.standard_normal(N).astype(np.float32))
        nodes.append(helper.make_node("Gemm", ["x", "w", "c"], ["h"], transB=1))
    nodes.append(helper.make_node("Tanh", ["h"], ["y"]))
    for name, tensor in inits.items():
        tensor.name = name
    graph = helper.make_graph(
        nodes,
        "plain_blocked",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, N])],
        list(inits.values()),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _values(model) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def _run(model, feeds) -> np.ndarray:
    return ReferenceEvaluator(model).run(None, feeds)[0]


def _steps(case, model) -> np.ndarray:
    """Each stored weight's quantization step (``s``, or ``1 / d``), in the codes' layout."""
    scale = _values(model)["s"].astype(np.float64)
    step = 1 / scale if case[4] == "div" else scale
    shape = _blocks(case)
    return np.broadcast_to(step, shape).reshape(_values(model)["q"].shape)


def _dequantized(case, model) -> np.ndarray:
    """``(q - z) s`` (float64) in the codes' layout, with numpy."""
    values = _values(model)
    shape = _blocks(case)
    codes = values["q"].astype(np.float64).reshape(shape)
    zero = values["z"].astype(np.float64) if "z" in values else 0.0
    scale = values["s"].astype(np.float64)
    step = 1 / scale if case[4] == "div" else scale
    return ((codes - zero) * step).reshape(values["q"].shape)


def _trained(model, rng):
    adapted = add_lora(model, rank=RANK)
    (adapter,) = lora_adapters(adapted)
    b = (rng.standard_normal((RANK, N)) * 0.4).astype(np.float32)
    return replace_initializers_into_onnx(adapted, {adapter["b"]: b}), adapter


def _update(case, adapter, values) -> np.ndarray:
    """``s A B`` (float64) in the codes' layout (``K x N`` as the product reads it)."""
    a, b = (values[adapter[key]].astype(np.float64) for key in ("a", "b"))
    update = adapter["scale"] * (a @ b)
    return update if case[1] == "rows" else update.T


def _reference(model, adapter, values, case):
    """The file reading ``w + s A B`` (computed in the graph from ``A`` and ``B``)."""
    reference = model.__class__()
    reference.CopyFrom(model)
    graph = reference.graph
    for node in graph.node:
        node.input[:] = ["w_new" if name == "w" else name for name in node.input]
    names = (adapter["a"], adapter["b"])
    graph.initializer.extend(numpy_helper.from_array(values[n], n) for n in names)
    graph.initializer.append(numpy_helper.from_array(np.float32(adapter["scale"]), "lora_s"))
    made = [
        helper.make_node("MatMul", list(names), ["ab"]),
        helper.make_node("Mul", ["ab", "lora_s"], ["sab"]),
    ]
    if case[1] == "cols":
        made.append(helper.make_node("Transpose", ["sab"], ["sab_t"], perm=[1, 0]))
    made.append(helper.make_node("Add", ["w", "sab_t" if case[1] == "cols" else "sab"], ["w_new"]))
    nodes = list(graph.node)
    at = next(i + 1 for i, n in enumerate(nodes) if "w" in n.output)
    del graph.node[:]
    graph.node.extend([*nodes[:at], *made, *nodes[at:]])
    return reference


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_adapter_gradient_against_float64_differences(case):
    """The codes get an adapter beside their product (kind ``Cast``); the scale and zero
    point are no weights; the gradient with respect to ``A`` and ``B`` equals float64
    central differences of the file reading ``W + s A B``."""
    rng = np.random.default_rng(1)
    model = _model(case, rng)
    trained, adapter = _trained(model, rng)
    assert (adapter["weight"], adapter["quantized"], adapter["shape"]) == ("q", "Cast", [K, N])
    names = sorted([adapter["a"], adapter["b"]])
    assert set(get_train_initializer(trained)) == {*names, "c"} & set(_values(trained))
    values = _values(trained)
    x = rng.standard_normal((M, K)).astype(np.float32)
    seed = rng.standard_normal((M, N)).astype(np.float32)
    gradient = onnx_derivative(trained, inputs=[], weights=names)
    declared = {i.name for i in gradient.graph.input}
    feeds = {"x": x, "y_grad": seed, **{n: values[n] for n in names}}
    outputs = ReferenceEvaluator(gradient).run(
        None, {k: v for k, v in feeds.items() if k in declared}
    )
    got = dict(zip([o.name for o in gradient.graph.output], outputs, strict=True))
    reference = _reference(model, adapter, values, case)
    point = {"x": x, **{n: values[n] for n in names}}
    want = onnx_numerical_vjp(reference, point, names, seeds=[seed], eps=1e-6)
    for name in names:
        np.testing.assert_allclose(got[f"{name}_grad"], want[name], rtol=1e-4, atol=1e-6)
        assert np.abs(want[name]).max() > 1e-2


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_merged_forms_against_w_plus_sab(case):
    """``keep`` and the runtime adapter model: the adapted outputs; ``requantize``: the
    file's nodes, codes, scales and zero points of the same types and shapes, every weight
    within half its block's new step of ``W + s A B``, the outputs within the bound that
    gives of the float file; untrained adapters give back the file's initializers."""
    rng = np.random.default_rng(2)
    model = _model(case, rng)
    trained, adapter = _trained(model, rng)
    values = _values(trained)
    x = rng.standard_normal((M, K)).astype(np.float32)
    adapted = _run(trained, {"x": x})
    assert np.abs(adapted - _run(model, {"x": x})).max() > 0.05
    np.testing.assert_array_equal(_run(merge_lora(trained), {"x": x}), adapted)
    served = runtime_adapter_model(model, trained)
    np.testing.assert_allclose(_run(served, {"x": x}), adapted, rtol=0, atol=1e-6)

    merged = merge_lora(trained, quantized="requantize")
    assert [n.op_type for n in merged.graph.node] == [n.op_type for n in model.graph.node]
    before, after = _values(model), _values(merged)
    for name, value in before.items():
        assert (after[name].dtype, after[name].shape) == (value.dtype, value.shape), name
    for name in set(before) - {"q", "s", "z"}:
        np.testing.assert_array_equal(after[name], before[name])
    wanted = _dequantized(case, model) + _update(case, adapter, values)
    step = _steps(case, merged)
    assert np.all(np.abs(_dequantized(case, merged) - wanted) <= 0.5 * step * (1 + 1e-6))
    if "z" in after:
        assert np.array_equal(after["z"].astype(np.float64), np.round(after["z"]))
    float_y = _run(_reference(model, adapter, values, case), {"x": x})
    column_step = step.max(axis=0) if case[1] == "rows" else step.max(axis=1)
    bound = 0.5 * np.abs(x).sum(axis=1, keepdims=True) * column_step + 1e-6
    assert np.all(np.abs(_run(merged, {"x": x}) - float_y) <= bound)

    unchanged = _values(merge_lora(add_lora(model, rank=RANK), quantized="requantize"))
    for name, value in before.items():
        np.testing.assert_array_equal(unchanged[name], value, err_msg=name)


def test_onnxruntime_runs_the_merged_4bit_file():
    """onnxruntime (with a ``Cast`` from 4-bit integers: newer than 1.19) computes what the
    reference evaluator does for the 4-bit block file, kept and re-quantized."""
    rng = np.random.default_rng(3)
    case = CASES[4]
    trained, _ = _trained(_model(case, rng), rng)
    x = rng.standard_normal((M, K)).astype(np.float32)
    for merged in (merge_lora(trained), merge_lora(trained, quantized="requantize")):
        (got,) = kernel_outputs(merged, {"x": x})
        np.testing.assert_allclose(got, _run(merged, {"x": x}), rtol=0, atol=1e-6)


def test_other_block_layouts_are_no_product():
    """A scale with one value per element of each block, or a ``Reshape`` back to another
    shape than the codes', is no per-block dequantization: no adapter, refused as before."""
    for change in ("scale", "back"):
        model = _model(CASES[0], np.random.default_rng(4))
        inits = {i.name: i for i in model.graph.initializer}
        if change == "scale":
            value = np.full(_blocks(CASES[0]), 0.01, np.float32)
            inits["s"].CopyFrom(numpy_helper.from_array(value, "s"))
        else:
            value = np.array([N, K], np.int64)
            inits["stored"].CopyFrom(numpy_helper.from_array(value, "stored"))
            model.graph.node[-2].input[:] = ["x", "w_t"]
            model.graph.node.insert(
                len(model.graph.node) - 2,
                helper.make_node("Transpose", ["w"], ["w_t"], perm=[1, 0]),
            )
        with pytest.raises(ValueError, match="no MatMul, Gemm or Conv weight to adapt"):
            add_lora(model, rank=RANK)


def test_artifacts_train_the_adapters_and_merge(tmp_path):
    """``generate_artifacts`` trains ``A`` and ``B`` only (codes, block scales and zero points
    frozen); five steps lower the loss; ``merge_checkpoint`` re-quantizes into the file's
    operators."""
    import onnxruntime as ort

    from onnxgrad.training import generate_artifacts, merge_checkpoint
    from onnxgrad.training.artifacts.checkpoint import Checkpoint

    rng = np.random.default_rng(6)
    model = _model(CASES[1], rng)  # uint8, N x K blocks under a Gemm: runs on onnxruntime 1.19
    adapted = add_lora(model, rank=RANK)
    art = generate_artifacts(adapted, optimizer="sgd", learning_rate=0.1, folder=tmp_path)
    step = art.train_step
    (adapter,) = lora_adapters(adapted)
    assert sorted(step.weights) == sorted([adapter["a"], adapter["b"]])
    x = rng.standard_normal((M, K)).astype(np.float32)
    session = ort.InferenceSession(
        str(art.path("training_model.onnx")), providers=["CPUExecutionProvider"]
    )
    wanted = {i.name for i in session.get_inputs()}
    values = {**art.checkpoint.weights, **art.checkpoint.optimizer_state}
    losses = []
    for _ in range(5):
        feeds = {"x": x, step.label: np.zeros((M, N), np.float32), **values}
        feeds[step.learning_rate] = np.array(art.learning_rate, np.float32)
        loss, *new = session.run(
            [step.loss, *step.new_weights, *step.new_state],
            {k: v for k, v in feeds.items() if k in wanted},
        )
        losses.append(float(loss))
        values = dict(zip([*step.weights, *step.state], new))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    weights = {name: values[name] for name in step.weights}
    merged = merge_checkpoint(tmp_path, Checkpoint(weights), quantized="requantize")
    assert [n.op_type for n in merged.graph.node] == [n.op_type for n in model.graph.node]
    assert not np.array_equal(_values(merged)["q"], _values(model)["q"])
