"""runtime_adapter_model(apply="auto"): one If running the weights update above the measured
number of rows and the branch below; its outputs equal each explicit mode's in onnxruntime
and onnx's reference evaluator, and onnxruntime still fuses the quantized products inside."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import add_lora
from onnxgrad.graph.lora_choice import CHOOSER, crossover_rows
from onnxgrad.graph.lora_runtime import runtime_adapter_model
from tests.graph.test_lora_runtime import K, _deployed, _int8_deployed, _qdq_deployed, _trained

ROWS = 3  # the rows above which the weights are updated, in these tests
RNG = np.random.default_rng(7)


def _batch(model: onnx.ModelProto, batch: str | int | None = None) -> onnx.ModelProto:
    """``model``, its input's first dimension named ``batch`` (a string), fixed (an int) or
    left unnamed."""
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    if isinstance(batch, str):
        dim.dim_param = batch
    elif isinstance(batch, int):
        dim.dim_value = batch
    return model


MODELS = {
    "qdq symmetric int8": lambda batch=None: _batch(_qdq_deployed(0), batch),
    "qdq asymmetric uint8": lambda batch=None: _batch(_qdq_deployed(3), batch),
    "int8 MatMulInteger": lambda batch=None: _batch(_int8_deployed(), batch),
}


@pytest.fixture(scope="module", params=[(name, batch) for name in MODELS for batch in (None, "n")])
def served(request):
    """``(the three models, the fed adapters)`` of one deployed model."""
    name, batch = request.param
    deployed = MODELS[name](batch)
    adapted = add_lora(deployed, rank=2, alpha=3.0)
    models = {
        "auto": runtime_adapter_model(deployed, adapted, apply="auto", rows=ROWS),
        "branch": runtime_adapter_model(deployed, adapted, apply="branch"),
        "weights": runtime_adapter_model(deployed, adapted, apply="weights"),
    }
    return models, _trained(adapted)


def _ort(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["y"], feeds)[0]


def _at_opset_21(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` at opset 21, the same operators: onnx's reference evaluator has no opset-17
    ``DequantizeLinear`` (and onnxruntime 1.19 no opset-21 ``QLinearMatMul`` it fuses)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    copy.opset_import[0].version = 21
    return copy


@pytest.mark.parametrize("rows", [1, ROWS, ROWS + 1, 17])
def test_auto_computes_what_the_mode_for_its_rows_computes(served, rows):
    """Up to ``ROWS`` rows the branch's outputs, above them the requantized weights' (the
    two differ by the codes' rounding, so the path taken shows), in onnxruntime and in
    onnx's reference evaluator."""
    models, adapters = served
    feeds = {"x": RNG.standard_normal((rows, K)).astype(np.float32), **adapters}
    chosen = "weights" if rows > ROWS else "branch"
    other = "branch" if rows > ROWS else "weights"
    want = _ort(models[chosen], feeds)
    assert np.abs(want - _ort(models[other], feeds)).max() > 1e-3
    np.testing.assert_allclose(_ort(models["auto"], feeds), want, rtol=1e-6, atol=1e-6)
    reference = ReferenceEvaluator(_at_opset_21(models["auto"])).run(["y"], feeds)[0]
    np.testing.assert_allclose(reference, want, rtol=1e-5, atol=1e-5)


def test_rows_come_from_the_named_input_dimension():
    """Where onnx's inference names an activation's rows after an input's dimension, only
    ``Shape``, ``Gather`` and the comparison run before the ``If``; unnamed, ``Size(x)``."""
    for batch, first in (("n", ["Shape", "Constant", "Gather"]), (None, ["Size"])):
        deployed = MODELS["qdq symmetric int8"](batch)
        auto = runtime_adapter_model(deployed, add_lora(deployed, rank=2), apply="auto")
        assert all(node.name.startswith(CHOOSER) for node in auto.graph.node)
        assert [node.op_type for node in auto.graph.node] == [*first, "Constant", "Greater", "If"]


@pytest.mark.parametrize(("rows", "chosen"), [(2, "branch"), (5, "weights")])
def test_static_rows_choose_once(rows, chosen):
    """A fixed number of rows needs no ``If``: the mode for it, as built explicitly."""
    deployed = MODELS["qdq symmetric int8"](rows)
    adapted = add_lora(deployed, rank=2)
    auto = runtime_adapter_model(deployed, adapted, apply="auto", rows=ROWS)
    explicit = runtime_adapter_model(deployed, adapted, apply=chosen)
    assert auto.SerializeToString() == explicit.SerializeToString()


@pytest.mark.parametrize("name", list(MODELS))
def test_the_bodies_keep_the_fused_products(name, tmp_path):
    """onnxruntime optimizes each body as it does the explicit model: the same fused
    product kernels (``QLinearMatMul``, ``MatMulIntegerToFloat``/``DynamicQuantizeMatMul``)."""
    deployed = MODELS[name]("n")
    adapted = add_lora(deployed, rank=2)
    kernels = {"QLinearMatMul", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "MatMulInteger"}

    def fused(model, path):
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(tmp_path / path)
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return onnx.load(options.optimized_model_filepath).graph

    def products(graph):
        return sorted(n.op_type for n in graph.node if n.op_type in kernels)

    choice = fused(runtime_adapter_model(deployed, adapted, apply="auto"), "auto.onnx").node[-1]
    bodies = {a.name: a.g for a in choice.attribute}
    for mode, body in (("weights", "then_branch"), ("branch", "else_branch")):
        explicit = fused(runtime_adapter_model(deployed, adapted, apply=mode), f"{mode}.onnx")
        assert products(bodies[body]) == products(explicit)
        assert products(explicit) and "MatMulInteger" not in products(explicit)


def test_the_crossover_is_the_update_against_the_branch_per_row():
    """``T = sum c K N r / sum r (K + N)``: a float 128 x 128 weight against its branch is
    64 rows; an int8 weight's update costs four times its multiply-adds."""
    assert crossover_rows([(128, 128, 8, "float")], [(128, 128, 8)]) == 64
    assert crossover_rows([(128, 128, 8, "int8")], [(128, 128, 8)]) == 256
    assert crossover_rows([], []) == 1


@pytest.mark.parametrize(
    ("rows", "apply", "message"),
    [
        *((rows, "auto", "rows must be") for rows in (-1, True, 2.5)),
        *((3, apply, "threshold of apply='auto'") for apply in ("branch", "weights")),
    ],
)
def test_a_bad_rows_is_refused(rows, apply, message):
    deployed = MODELS["int8 MatMulInteger"]()
    with pytest.raises(ValueError, match=message):
        runtime_adapter_model(deployed, add_lora(deployed, rank=2), apply=apply, rows=rows)


def test_float_and_four_bit_products_give_the_outputs_of_the_mode_for_the_rows():
    """A float ``MatMul`` before a 4-bit ``MatMulNBits``: up to ``ROWS`` rows the branches'
    outputs, above them the updated float weight's and the re-quantized 4-bit codes'."""
    deployed, _, _ = _deployed()
    adapted = add_lora(deployed, rank=2)
    adapters = _trained(adapted)
    auto = runtime_adapter_model(deployed, adapted, apply="auto", rows=ROWS)
    assert auto.graph.node[-1].op_type == "If"
    for rows, mode in ((1, "branch"), (17, "weights")):
        feeds = {"x": RNG.standard_normal((rows, K)).astype(np.float32), **adapters}
        want = _ort(runtime_adapter_model(deployed, adapted, apply=mode), feeds)
        np.testing.assert_allclose(_ort(auto, feeds), want, rtol=1e-6, atol=1e-6)


def test_rows_counted_after_the_nodes_computing_the_activation():
    """The activation quantized and dequantized first (a QDQ pair the bodies read): its
    rows are counted by ``Size`` after that pair, which each body computes again (read
    across the ``If``, such a pair made onnxruntime's QDQ propagation abort); the outputs
    are the mode's for the rows."""
    deployed = MODELS["qdq symmetric int8"]()
    first = next(n for n in deployed.graph.node if n.name == "first")
    first.input[0] = "xd"
    pair = [
        onnx.helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"], name="qx"),
        onnx.helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"], name="dqx"),
    ]
    nodes = [*pair, *deployed.graph.node]
    del deployed.graph.node[:]
    deployed.graph.node.extend(nodes)
    adapted = add_lora(deployed, rank=2, alpha=3.0)
    adapters = _trained(adapted)
    auto = runtime_adapter_model(deployed, adapted, apply="auto", rows=ROWS)
    assert [n.op_type for n in auto.graph.node][:3] == [
        "QuantizeLinear",
        "DequantizeLinear",
        "Size",
    ]
    body = auto.graph.node[-1].attribute[0].g
    assert [n.op_type for n in body.node][:2] == ["QuantizeLinear", "DequantizeLinear"]
    for rows in (1, 17):
        feeds = {"x": RNG.standard_normal((rows, K)).astype(np.float32), **adapters}
        mode = "weights" if rows > ROWS else "branch"
        want = _ort(runtime_adapter_model(deployed, adapted, apply=mode), feeds)
        np.testing.assert_allclose(_ort(auto, feeds), want, rtol=1e-6, atol=1e-6)
        reference = ReferenceEvaluator(_at_opset_21(auto)).run(["y"], feeds)[0]
        np.testing.assert_allclose(reference, want, rtol=1e-5, atol=1e-5)


def test_a_model_with_its_own_if_and_an_input_as_output():
    """The deployed model's own ``If`` (its branches reading a value the bodies rename) and
    an input that is also an output (left outside the choice): onnx's checker accepts the
    result, and it computes each mode's outputs for its rows."""
    w = RNG.standard_normal((8, 8)).astype(np.float32)
    w2 = RNG.standard_normal((8, 4)).astype(np.float32)
    relu = onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", ["h"], ["t"])], "then", [], [_value("t", None)]
    )
    neg = onnx.helper.make_graph(
        [onnx.helper.make_node("Neg", ["h"], ["e"])], "else", [], [_value("e", None)]
    )
    nodes = [
        onnx.helper.make_node("MatMul", ["x", "w"], ["h"], name="first"),
        onnx.helper.make_node("If", ["flag"], ["g"], name="own", then_branch=relu, else_branch=neg),
        onnx.helper.make_node("MatMul", ["g", "w2"], ["y"], name="second"),
    ]
    graph = onnx.helper.make_graph(
        nodes,
        "nested",
        [
            _value("x", ["batch", 8]),
            onnx.helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
        ],
        [_value("y", ["batch", 4]), _value("x", ["batch", 8])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w2, "w2")],
    )
    deployed = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    adapted = add_lora(deployed, rank=2)
    adapters = _trained(adapted)
    auto = runtime_adapter_model(deployed, adapted, apply="auto", rows=ROWS)
    onnx.checker.check_model(auto)
    assert [o for o in auto.graph.node[-1].output] == ["y"]
    for rows, mode in ((1, "branch"), (17, "weights")):
        x = RNG.standard_normal((rows, 8)).astype(np.float32)
        feeds = {"x": x, "flag": np.array(rows > 1), **adapters}
        want = _ort(runtime_adapter_model(deployed, adapted, apply=mode), feeds)
        np.testing.assert_allclose(_ort(auto, feeds), want, rtol=1e-5, atol=1e-5)
        reference = ReferenceEvaluator(auto).run(["y", "x"], feeds)
        np.testing.assert_allclose(reference[0], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(reference[1], x)


def _value(name: str, shape, elem_type: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return onnx.helper.make_tensor_value_info(name, elem_type, shape)
