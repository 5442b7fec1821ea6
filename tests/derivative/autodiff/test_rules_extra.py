"""Checks of the native rules beyond the finite-difference table.

* MatMul, Gemm and Einsum gradients against PyTorch's autograd, on shapes given as known,
  symbolic and unknown dims, run by the inference-only onnxruntime;
* the tie rule of Max/Min for more than two tied inputs (finite differences see a one-sided
  average there, not a subgradient);
* Dropout in training mode under onnxruntime, against the mask it drew (its own mask output
  or the one the gradient adds);
* the errors of the rules: they name the node, the equation or the attribute.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import DerivativeOptions, onnx_derivative

FLOAT = TensorProto.FLOAT


def single_node_model(
    op_type, inputs, outputs=("y",), opset=18, initializers=(), elem_type=FLOAT, **attrs
):
    """A model of one node; ``inputs`` maps names to shapes (``None``: unknown rank), each of
    ``elem_type``."""
    node = helper.make_node(op_type, list(inputs), list(outputs), name=f"the_{op_type}", **attrs)
    graph = helper.make_graph(
        [node],
        "single",
        [helper.make_tensor_value_info(n, elem_type, s) for n, s in inputs.items() if s != "init"],
        [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outputs],
        list(initializers),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
    inferred = {o.name: o.type for o in onnx.shape_inference.infer_shapes(model).graph.output}
    for output in model.graph.output:
        output.type.CopyFrom(inferred[output.name])
    return model


def run_ort(model, feeds):
    session = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))


def unit_step_vjp(model, feeds: dict, x: str, output: str, seed: np.ndarray) -> np.ndarray:
    """``seed . d output / d x`` from unit steps of ``x`` on onnxruntime: exact (up to
    float32 rounding) for an output linear in ``x``, as a Resize's."""
    y = run_ort(model, feeds)[output]
    expected = np.zeros(feeds[x].shape)
    for j in np.ndindex(feeds[x].shape):
        step = np.zeros_like(feeds[x])
        step[j] = 1.0
        moved = run_ort(model, {**feeds, x: feeds[x] + step})[output]
        expected[j] = np.sum((moved - y) * seed)
    return expected


def native_gradients(model, values: dict, seed: np.ndarray) -> dict:
    grad_model = onnx_derivative(model, weights=[], backend="onnx")
    return run_ort(grad_model, {**values, "y_grad": seed})


def torch_gradients(torch, function, values: dict, seed: np.ndarray) -> dict:
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in values.items()}
    function(*tensors.values()).backward(torch.tensor(seed))
    return {f"{k}_grad": t.grad.numpy() for k, t in tensors.items()}


def dims(shape, mode):
    """The declared shape of a graph input: known, symbolic (one name per axis) or unknown."""
    if mode == "known":
        return list(shape)
    if mode == "symbolic":
        return [f"d{k}_{n}" for k, n in enumerate(shape)]
    return [None] * len(shape)


def compare(torch, op_type, function, values, mode, opset=18, **attrs):
    rng = np.random.default_rng(0)
    model = single_node_model(
        op_type, {k: dims(v.shape, mode) for k, v in values.items()}, opset=opset, **attrs
    )
    expected_output = function(*(torch.tensor(v) for v in values.values())).numpy()
    seed = rng.standard_normal(expected_output.shape).astype(np.float32)
    got = native_gradients(model, values, seed)
    expected = torch_gradients(torch, function, values, seed)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def random_inputs(*shapes, seed=1):
    rng = np.random.default_rng(seed)
    return {f"x{k}": rng.standard_normal(s).astype(np.float32) for k, s in enumerate(shapes)}


MODES = ["known", "symbolic", "unknown"]

MATMUL_SHAPES = [
    ((4,), (4,)),
    ((4,), (4, 3)),
    ((5, 4), (4,)),
    ((4,), (2, 4, 3)),
    ((2, 5, 4), (4,)),
    ((5, 4), (4, 3)),
    ((2, 5, 4), (4, 3)),
    ((5, 4), (2, 4, 3)),
    ((2, 1, 5, 4), (3, 4, 2)),
    ((1, 5, 4), (2, 4, 3)),
    ((3, 2, 5, 4), (2, 4, 3)),
]


@pytest.mark.torch
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=str)
def test_matmul_against_torch(shapes, mode):
    torch = pytest.importorskip("torch")
    compare(torch, "MatMul", torch.matmul, random_inputs(*shapes), mode)


GEMM_SETTINGS = [
    ({}, (5,)),
    ({"transA": 1}, (3, 1)),
    ({"transB": 1, "alpha": 0.5}, ()),
    ({"transA": 1, "transB": 1, "beta": -2.0}, (3, 5)),
    ({"alpha": 3.0, "beta": 0.5}, (1, 5)),
    ({"transB": 1}, None),
]


@pytest.mark.torch
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("attrs, c_shape", GEMM_SETTINGS, ids=str)
def test_gemm_against_torch(attrs, c_shape, mode):
    torch = pytest.importorskip("torch")
    a_shape = (4, 3) if attrs.get("transA") else (3, 4)
    b_shape = (5, 4) if attrs.get("transB") else (4, 5)
    shapes = [a_shape, b_shape] if c_shape is None else [a_shape, b_shape, c_shape]
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)

    def gemm(a, b, c=None):
        a = a.T if attrs.get("transA") else a
        b = b.T if attrs.get("transB") else b
        return alpha * a @ b + (0 if c is None else beta * c)

    compare(torch, "Gemm", gemm, random_inputs(*shapes), mode, **attrs)


EINSUM_SETTINGS = [
    ("ij,jk->ik", [(3, 4), (4, 2)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 2)]),
    ("ij,kj->", [(3, 4), (2, 4)]),
    ("i,i", [(4,), (4,)]),
    ("ijk->ki", [(2, 3, 4)]),
    ("ii->i", [(3, 3)]),
    ("iij->j", [(3, 3, 2)]),
    ("iji,jk->ik", [(3, 2, 3), (2, 4)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)]),
    ("...ij,...jk->...ik", [(2, 1, 3, 4), (1, 3, 4, 2)]),
    ("b...,b->...", [(3, 2, 4), (3,)]),
    ("...i,...i->...", [(1, 4), (3, 4)]),
    ("aB,Ba->", [(2, 3), (3, 2)]),
]


@pytest.mark.torch
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("equation, shapes", EINSUM_SETTINGS, ids=[e for e, _ in EINSUM_SETTINGS])
def test_einsum_against_torch(equation, shapes, mode):
    torch = pytest.importorskip("torch")

    def einsum(*operands):
        return torch.einsum(equation, *operands)

    compare(torch, "Einsum", einsum, random_inputs(*shapes), mode, equation=equation)


@pytest.mark.parametrize("op_type", ["Max", "Min"])
def test_extremum_splits_ties_equally(op_type):
    values = {
        "a": np.array([1.0, 2.0, 5.0, 0.0], np.float32),
        "b": np.array([1.0, 3.0, 5.0, 0.0], np.float32),
        "c": np.array([1.0, 2.0, 4.0, 0.0], np.float32),
        "d": np.array([1.0, 2.0, 5.0, -1.0], np.float32),
    }
    if op_type == "Min":
        values = {k: -v for k, v in values.items()}
    model = single_node_model(op_type, {k: [4] for k in values})
    seed = np.array([4.0, 3.0, 6.0, 5.0], np.float32)
    got = native_gradients(model, values, seed)
    stacked = np.stack(list(values.values()))
    winners = stacked == (stacked.max(0) if op_type == "Max" else stacked.min(0))
    for k, name in enumerate(values):
        np.testing.assert_allclose(got[f"{name}_grad"], seed * winners[k] / winners.sum(0))


@pytest.mark.parametrize("ratio", [None, 0.25])
def test_dropout_training_mode_in_onnxruntime(ratio):
    """``x_bar = y_bar * mask / (1 - ratio)`` with the mask onnxruntime drew (ratio 0.5 when
    omitted), checked in one run of the gradient graph that keeps the outputs."""
    inits = [helper.make_tensor("mode", TensorProto.BOOL, [], [True])]
    if ratio is not None:
        inits.append(helper.make_tensor("ratio", FLOAT, [], [ratio]))
    model = single_node_model(
        "Dropout",
        {"x": [3, 40], "ratio" if ratio is not None else "": "init", "mode": "init"},
        outputs=("y", "mask"),
        opset=13,
        initializers=inits,
    )
    grad_model = onnx_derivative(
        model, weights=[], inputs=["x"], options=DerivativeOptions.KeepOutputs, backend="onnx"
    )
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 40)).astype(np.float32)
    seed = rng.standard_normal((3, 40)).astype(np.float32)
    assert [i.name for i in grad_model.graph.input] == ["x", "y_grad"]  # no bool mask_grad
    got = run_ort(grad_model, {"x": x, "y_grad": seed})
    mask = got["mask"]
    assert 0 < mask.sum() < mask.size
    scale = 1 / (1 - (0.5 if ratio is None else ratio))
    np.testing.assert_allclose(got["x_grad"], seed * mask * scale, rtol=1e-6)


def test_dropout_training_mode_without_mask_output():
    """The forward Dropout returns its mask for the gradient: dropped elements (``y == 0``
    for a normal ``x``) get 0, kept ones ``g / (1 - ratio)``."""
    model = single_node_model(
        "Dropout",
        {"x": [3, 40], "ratio": "init", "mode": "init"},
        opset=13,
        initializers=[
            helper.make_tensor("ratio", FLOAT, [], [0.25]),
            helper.make_tensor("mode", TensorProto.BOOL, [], [True]),
        ],
    )
    grad_model = onnx_derivative(
        model, weights=[], inputs=["x"], options=DerivativeOptions.KeepOutputs, backend="onnx"
    )
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 40)).astype(np.float32)
    seed = rng.standard_normal((3, 40)).astype(np.float32)
    got = run_ort(grad_model, {"x": x, "y_grad": seed})
    kept = got["y"] != 0
    assert 0 < kept.sum() < kept.size
    np.testing.assert_allclose(got["x_grad"], seed * kept / 0.75, rtol=1e-6)


def test_einsum_ellipsis_of_unknown_rank_names_the_equation():
    model = single_node_model("Einsum", {"a": None, "b": [3, 2]}, equation="...ij,jk->...ik")
    with pytest.raises(NotImplementedError, match=r"the_Einsum.*\.\.\.ij,jk->\.\.\.ik"):
        onnx_derivative(model, weights=[], backend="onnx")


def test_einsum_bad_equation_names_it():
    model = single_node_model("Einsum", {"a": [2, 3], "b": [3, 2]}, equation="ij,j1->i")
    with pytest.raises(ValueError, match=r"the_Einsum.*ij,j1->i"):
        onnx_derivative(model, weights=[], backend="onnx")


def test_gelu_unknown_approximation_names_the_attribute():
    model = single_node_model("Gelu", {"x": [2, 3]}, opset=20, approximate="sigmoid")
    with pytest.raises(NotImplementedError, match=r"the_Gelu.*approximate"):
        onnx_derivative(model, weights=[], backend="onnx")


def test_dropout_with_constant_false_training_mode_is_identity_without_mask():
    graph = helper.make_graph(
        [helper.make_node("Dropout", ["x", "ratio", "training"], ["y"], name="drop")],
        "dropout",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [
            numpy_helper.from_array(np.array(0.3, np.float32), "ratio"),
            numpy_helper.from_array(np.array(False), "training"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    grad = onnx_derivative(model)
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    g = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
    (x_grad,) = ReferenceEvaluator(grad).run(None, {"x": x, "y_grad": g})
    np.testing.assert_array_equal(x_grad, g)


def test_roi_align_with_adaptive_sampling_names_the_node():
    model = single_node_model(
        "RoiAlign", {"x": [1, 1, 4, 4], "rois": [2, 4], "batch": "init"}, opset=22,
        initializers=[numpy_helper.from_array(np.zeros(2, np.int64), "batch")],
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match=r"the_RoiAlign.*sampling_ratio=0"):
        onnx_derivative(model, weights=[], backend="onnx")


def _conv_transpose_beyond(beyond: int, stride: int = 3, auto_pad: str = "NOTSET"):
    """A ConvTranspose (3 x 3 input, 2 x 2 kernel, full output ``3 stride - 1``) whose
    ``output_shape`` is ``beyond`` more than the full output along the first axis."""
    full = 2 * stride + 2
    return single_node_model(
        "ConvTranspose", {"x": [1, 1, 3, 3], "w": [1, 1, 2, 2]}, strides=[stride, stride],
        output_shape=[full + beyond, full], auto_pad=auto_pad,
    )  # fmt: skip


def _run_or_none(run, model, feeds):
    try:
        return run(model, feeds)
    except Exception:  # a runtime refusing the model
        return None


def _reference(model, feeds):
    return ReferenceEvaluator(model).run(None, feeds)[0]


def _ort(model, feeds):
    return run_ort(model, feeds)["y"]


@pytest.mark.parametrize("stride", [2, 3, 4])
def test_conv_transpose_output_shape_beyond_the_full_output_within_the_stride(stride):
    """Up to ``stride - 1`` beyond the full output, onnxruntime and the reference evaluator
    both run the forward and agree (the table checks the gradients); ``stride`` beyond, the
    reference evaluator refuses it (as onnxruntime 1.32 does; 1.19 leaves outputs
    uninitialised), and so does the rule, naming the node and the sizes."""
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal(s).astype(np.float32)
             for k, s in (("x", (1, 1, 3, 3)), ("w", (1, 1, 2, 2)))}  # fmt: skip
    for beyond in range(stride + 1):
        model = _conv_transpose_beyond(beyond, stride)
        reference = _run_or_none(_reference, model, feeds)
        ort = _run_or_none(_ort, model, feeds)
        if beyond < stride:
            assert reference is not None and ort is not None, beyond
            np.testing.assert_allclose(ort, reference, rtol=1e-5, atol=1e-5)
            assert ort.shape[2] == 2 * stride + 2 + beyond
            onnx_derivative(model, weights=[], backend="onnx")
            continue
        assert reference is None
        full = 2 * stride + 2
        expected = (
            rf"the_ConvTranspose.*output_shape \[{full + beyond}, {full}\] exceeds the full "
            rf"output \[{full}, {full}\] by more than strides - 1 = \[{stride - 1}, {stride - 1}\]"
        )
        with pytest.raises(NotImplementedError, match=expected):
            onnx_derivative(model, weights=[], backend="onnx")


def test_conv_transpose_output_shape_beyond_with_same_lower_is_refused_where_runtimes_disagree():
    """With SAME_LOWER, one beyond the full output both runtimes append; two beyond they
    compute different outputs, and the rule refuses it."""
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal(s).astype(np.float32)
             for k, s in (("x", (1, 1, 3, 3)), ("w", (1, 1, 2, 2)))}  # fmt: skip
    agreeing, disagreeing = (_conv_transpose_beyond(b, 3, "SAME_LOWER") for b in (1, 2))
    np.testing.assert_allclose(
        run_ort(agreeing, feeds)["y"], ReferenceEvaluator(agreeing).run(None, feeds)[0],
        rtol=1e-5, atol=1e-5,
    )  # fmt: skip
    onnx_derivative(agreeing, weights=[], backend="onnx")
    ort, reference = (
        run_ort(disagreeing, feeds)["y"],
        ReferenceEvaluator(disagreeing).run(None, feeds)[0],
    )
    assert not np.allclose(ort, reference, atol=1e-3)
    with pytest.raises(
        NotImplementedError, match=r"the_ConvTranspose.*more than 1 beyond.*SAME_LOWER"
    ):
        onnx_derivative(disagreeing, weights=[], backend="onnx")


def test_conv_transpose_output_shape_far_beyond_the_full_output_names_the_node():
    model = single_node_model(
        "ConvTranspose", {"x": [1, 1, 3, 3], "w": [1, 1, 3, 3]}, strides=[2, 2],
        output_shape=[9, 9],
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match=r"the_ConvTranspose.*output_shape \[9, 9\]"):
        onnx_derivative(model, weights=[], backend="onnx")


def _old_resize_model(op_type, opset, mode, scales, shape, name="the_Upsample"):
    """One opset-``opset`` Upsample/Resize node reading constant ``scales``."""
    graph = helper.make_graph(
        [helper.make_node(op_type, ["x", "scales"], ["y"], mode=mode, name=name)],
        "upsample",
        [helper.make_tensor_value_info("x", FLOAT, shape)],
        [helper.make_tensor_value_info("y", FLOAT, None)],
        [numpy_helper.from_array(np.array(scales, np.float32), "scales")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=7)


@pytest.mark.parametrize(
    ("op_type", "opset", "mode", "scales", "shape"),
    [
        ("Upsample", 9, "nearest", [1, 1, 2.3, 1.7], [1, 1, 3, 4]),
        ("Upsample", 9, "linear", [1, 1, 2.3, 1.7], [1, 1, 3, 4]),
        ("Resize", 10, "nearest", [1, 1, 2, 3], [1, 2, 4, 5]),  # grows: floor
        ("Resize", 10, "nearest", [1, 1, 0.6, 0.5], [1, 2, 4, 5]),  # shrinks: ceil
        ("Resize", 10, "nearest", [1, 1, 0.6, 0.6], [1, 2, 5, 7]),
        ("Resize", 10, "nearest", [1, 1, 0.75, 1.5], [1, 2, 4, 5]),  # both: two nodes
        ("Resize", 10, "nearest", [1, 1, 1.7, 0.4], [1, 1, 5, 9]),
        ("Resize", 10, "nearest", [1, 1, 0.5, 2.5], [2, 3, 4, 2]),
        ("Resize", 10, "linear", [1, 1, 0.6, 0.5], [1, 2, 4, 5]),
    ],
)
def test_upsample_below_opset_11_keeps_its_sampling(op_type, opset, mode, scales, shape):
    """A Upsample or Resize below opset 11 is raised to a Resize-11 by onnx's converter, which
    drops its asymmetric sampling and onnxruntime's rounding (nearest: ceil on the axes it
    shrinks, floor on the others): the gradient on onnxruntime is checked against
    differences of the original model (linear in X: a unit step is exact)."""
    model = _old_resize_model(op_type, opset, mode, scales, shape)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    y = run_ort(model, {"x": x})["y"]
    seed = np.random.default_rng(1).standard_normal(y.shape).astype(np.float32)
    got = native_gradients(model, {"x": x}, seed)["x_grad"]
    expected = unit_step_vjp(model, {"x": x}, "x", "y", seed)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_resize_10_nearest_downsampling_raised_as_onnxruntime_runs_it():
    """onnx's own Resize-10 downsampling example: onnxruntime reads x[ceil(i / 0.6)]."""
    from onnxgrad.graph.opset_raise import raised_opset

    model = _old_resize_model("Resize", 10, "nearest", [1, 1, 0.6, 0.6], [1, 1, 2, 4])
    x = np.arange(1, 9, dtype=np.float32).reshape(1, 1, 2, 4)
    np.testing.assert_array_equal(run_ort(model, {"x": x})["y"], [[[[1, 3]]]])
    np.testing.assert_array_equal(run_ort(raised_opset(model, 13), {"x": x})["y"], [[[[1, 3]]]])


def _fed_scales_model(op_type: str, opset: int, shape, scales: str = "scales"):
    """``y = op_type(x, scales)`` in nearest mode, ``scales`` a graph input fed at run time."""
    graph = helper.make_graph(
        [helper.make_node(op_type, ["x", scales], ["y"], mode="nearest", name=f"the_{op_type}")],
        op_type.lower(),
        [helper.make_tensor_value_info("x", FLOAT, list(shape)),
         helper.make_tensor_value_info(scales, FLOAT, [4])],
        [helper.make_tensor_value_info("y", FLOAT, None)],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=7)


def test_resize_10_nearest_with_computed_scales_names_the_node():
    model = _fed_scales_model("Resize", 10, [1, 1, 4, 4], scales="s")
    with pytest.raises(ValueError, match=r"'the_Resize'.*scales 's'.*not a constant"):
        onnx_derivative(model, weights=[], inputs=["x"], backend="onnx")


def test_upsample_with_scales_as_an_input_takes_the_floor():
    """Upsample's scales may be fed at run time (onnx's own test case): onnxruntime refuses
    scales < 1 there, so the raised Resize takes the floor without a constant."""
    model = _fed_scales_model("Upsample", 9, [1, 1, 2, 3])
    x = np.random.default_rng(0).standard_normal((1, 1, 2, 3)).astype(np.float32)
    scales = np.array([1, 1, 2.5, 1.5], np.float32)
    y = run_ort(model, {"x": x, "scales": scales})["y"]
    seed = np.random.default_rng(1).standard_normal(y.shape).astype(np.float32)
    grad_model = onnx_derivative(model, weights=[], inputs=["x"], backend="onnx")
    got = run_ort(grad_model, {"x": x, "scales": scales, "y_grad": seed})["x_grad"]
    expected = unit_step_vjp(model, {"x": x, "scales": scales}, "x", "y", seed)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [[1, 1, 4, 6], [1, 1, 4, "w"]])
def test_resize_10_nearest_mixed_scales_that_may_keep_a_size_names_the_node(shape):
    """Shrinking one axis and growing another by 1.1 (6 -> 6, or of unknown size): the
    second of the two Resize nodes could keep its input's shape, which onnxruntime copies
    instead of sampling at floor(i / 1.1): refused by name."""
    model = _old_resize_model("Resize", 10, "nearest", [1, 1, 0.6, 1.1], shape, "the_Resize")
    with pytest.raises(ValueError, match=r"'the_Resize'.*shrinks some axes and grows"):
        onnx_derivative(model, weights=[], inputs=["x"], backend="onnx")


def _layer_norm_grad_exact(x, scale, g, epsilon):
    """The LayerNormalization input gradient over the last axis, in float64."""
    sd = np.sqrt(x.var(1, keepdims=True) + epsilon)
    xhat = (x - x.mean(1, keepdims=True)) / sd
    h = g * scale
    return (h - h.mean(1, keepdims=True) - xhat * (h * xhat).mean(1, keepdims=True)) / sd


@pytest.mark.parametrize(
    ("dtype", "attrs", "offset", "rtol"),
    [
        (np.float64, {}, 0.0, 1e-12),  # a float32 stash must not enter a double gradient
        (np.float64, {"stash_type": TensorProto.DOUBLE}, 0.0, 1e-12),
        (np.float32, {}, 100.0, 1e-4),  # a mean far from 0: two-pass moments stay exact
        (np.float32, {}, 1000.0, 1e-3),
    ],
)
def test_layer_normalization_gradient_keeps_the_input_precision(dtype, attrs, offset, rtol):
    """The gradient computes its own two-pass moments in x's type: not the forward node's
    Mean/InvStdDev, which come in ``stash_type`` (float32 by default) and, in onnxruntime's
    kernel, lose digits when the mean is large next to the spread (review finding)."""
    rng = np.random.default_rng(7)
    elem = TensorProto.DOUBLE if dtype == np.float64 else TensorProto.FLOAT
    model = single_node_model(
        "LayerNormalization",
        {"x": [4, 64], "scale": [64], "b": [64]},
        opset=17,
        elem_type=elem,
        epsilon=0.5,
        **attrs,
    )
    grad = onnx_derivative(model, weights=[], inputs=["x"], options=DerivativeOptions.Zero)
    feeds = {"x": (offset + rng.standard_normal((4, 64))).astype(dtype)}
    feeds["scale"] = rng.standard_normal(64).astype(dtype)
    feeds["b"] = rng.standard_normal(64).astype(dtype)
    feeds["y_grad"] = rng.standard_normal((4, 64)).astype(dtype)
    session = onnxruntime.InferenceSession(
        grad.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    (x_grad,) = session.run(["x_grad"], feeds)
    x, scale, g = (feeds[n].astype(np.float64) for n in ("x", "scale", "y_grad"))
    expected = _layer_norm_grad_exact(x, scale, g, 0.5)
    np.testing.assert_allclose(x_grad, expected, rtol=rtol, atol=rtol * np.abs(expected).max())


def _kept_size_cases():
    from tests.derivative.autodiff.cases_shape import RESIZE_KEPT_SIZE

    return RESIZE_KEPT_SIZE


@pytest.mark.parametrize("case", _kept_size_cases(), ids=lambda c: c.id)
def test_resize_oracle_of_the_table_follows_onnxruntime(case):
    """The float64 evaluator of the Resize-kept-size/same-shape table entries computes what
    onnxruntime computes (float32): sampling on an axis that keeps its size, a copy when the
    whole shape is kept."""
    from tests.derivative.autodiff.gradcheck import case_model, evaluator

    model, feeds = case_model(case, np.float32)
    expected = run_ort(model, feeds)["y0"]
    model64, feeds64 = case_model(case, np.float64)
    got = evaluator(model64, case.evaluator).run(None, feeds64)[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("case", _kept_size_cases(), ids=lambda c: c.id)
def test_resize_gradient_against_unit_steps_on_onnxruntime(case, dynamic):
    """The native gradient of a Resize whose scale is not 1 on an axis that keeps its size
    (or whose whole shape is kept: a copy), run by onnxruntime, against differences of the
    original model on onnxruntime: linear in x, so a unit step is exact."""
    from tests.derivative.autodiff.gradcheck import case_model

    model, feeds = case_model(case, np.float32, dynamic)
    y = run_ort(model, feeds)["y0"]
    seed = np.random.default_rng(1).standard_normal(y.shape).astype(np.float32)
    grad_model = onnx_derivative(model, weights=[], inputs=["x"], backend="onnx")
    got = run_ort(grad_model, {**feeds, "y0_grad": seed})["x_grad"]
    expected = unit_step_vjp(model, feeds, "x", "y0", seed)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("mode", "scales", "shape"),
    [
        ("nearest", [1, 1, 1.1, 1.1], [1, 1, 4, 6]),  # same shape: onnxruntime copies
        ("nearest", [1, 1, 2, 1.1], [1, 1, 3, 6]),  # 6 * 1.1 -> 6 still sampled
    ],
)
def test_resize_nearest_with_computed_scales_follows_onnxruntime(mode, scales, shape):
    """Scales fed at run time and unknown dims: the index-grid construction, with unit
    scales where the output shape equals x's (onnxruntime copies x there)."""
    graph = helper.make_graph(
        [helper.make_node("Resize", ["x", "", "s"], ["y"], mode=mode, name="the_Resize",
                          coordinate_transformation_mode="asymmetric", nearest_mode="floor")],
        "resize",
        [helper.make_tensor_value_info("x", FLOAT, ["a", "b", "c", "d"]),
         helper.make_tensor_value_info("s", FLOAT, [4])],
        [helper.make_tensor_value_info("y", FLOAT, ["e", "f", "g", "h"])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)], ir_version=8)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    s = np.array(scales, np.float32)
    y = run_ort(model, {"x": x, "s": s})["y"]
    seed = np.random.default_rng(1).standard_normal(y.shape).astype(np.float32)
    grad_model = onnx_derivative(model, weights=[], inputs=["x"], backend="onnx")
    got = run_ort(grad_model, {"x": x, "s": s, "y_grad": seed})["x_grad"]
    expected = unit_step_vjp(model, {"x": x, "s": s}, "x", "y", seed)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def _resize(source, target, mode, scales=None, sizes=None, **attrs):
    inputs = [source, "", scales or "", *([sizes] if sizes else [])]
    return helper.make_node("Resize", inputs, [target], mode=mode, **attrs)


def _float32(name, values):
    return numpy_helper.from_array(np.array(values, np.float32), name)


#: Resize nodes on ``x`` ``[1, 1, 3, 10]`` whose width ``floor(10 * 0.7)`` is 7 on
#: onnxruntime (float32: ``7.0000001``) but 6 for onnx's inference and reference evaluator
#: (float64: ``6.99999988``): ``(nodes, initializers, declared)``, where ``declared`` says
#: which types the model declares as onnx's inference gives them: ``"output"``, ``"all"``
#: (every value_info too, as a model saved after inference) or ``"rank"`` (the output's only)
RESIZE_RUNTIME_SIZES = {
    "direct-linear": (
        [_resize("x", "y", "linear", "s")],
        [_float32("s", [1, 1, 1, 0.7])],
        "output",
    ),
    "direct-nearest-axes": (
        [_resize("x", "y", "nearest", "s", axes=[3])],
        [_float32("s", [0.7])],
        "output",
    ),
    # onnx's inference sees 6 -> 6 (a copy), onnxruntime samples 7 -> 6
    "chain-sizes": (
        [_resize("x", "t", "linear", "s"), _resize("t", "y", "linear", sizes="z")],
        [_float32("s", [1, 1, 1, 0.7]), numpy_helper.from_array(np.array([1, 1, 3, 6]), "z")],
        "rank",
    ),
    "chain-scales-cubic": (
        [_resize("x", "t", "cubic", "s"), _resize("t", "y", "cubic", "r")],
        [_float32("s", [1, 1, 1, 0.7]), _float32("r", [1, 1, 2, 1.5])],
        "all",
    ),
    # onnxruntime copies 7 -> 7 through the second node, the reference evaluator samples 6 -> 7
    "chain-through-neg-nearest": (
        [
            _resize("x", "t", "nearest", "s"),
            helper.make_node("Neg", ["t"], ["n"]),
            _resize("n", "y", "nearest", sizes="z"),
        ],
        [_float32("s", [1, 1, 1, 0.7]), numpy_helper.from_array(np.array([1, 1, 3, 7]), "z")],
        "all",
    ),
}


def _runtime_sized_resize_model(case: str, elem_type=FLOAT):
    """The model of ``RESIZE_RUNTIME_SIZES[case]``, at opset 19."""
    nodes, initializers, declared = RESIZE_RUNTIME_SIZES[case]
    graph = helper.make_graph(
        nodes,
        "resize",
        [helper.make_tensor_value_info("x", elem_type, [1, 1, 3, 10])],
        [helper.make_tensor_value_info("y", elem_type, [None] * 4)],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    inferred = onnx.shape_inference.infer_shapes(model)
    if declared != "rank":
        model.graph.output[0].type.CopyFrom(inferred.graph.output[0].type)
    if declared == "all":
        model.graph.value_info.extend(inferred.graph.value_info)
    return model


def _onnxruntime_folds_resize_sizes_in_float64() -> bool:
    """Whether onnxruntime's graph optimizer folds ``Shape(Resize(x))`` to onnx's float64 size
    (6 for ``10 * 0.7``) while its kernel makes the float32 one (7): seen with onnxruntime
    1.32, not 1.19. Its own forward pass reading that shape is then wrong too."""
    model = _runtime_sized_resize_model("direct-linear")
    model.graph.node.append(helper.make_node("Shape", ["y"], ["width"], start=3))
    model.graph.output.append(helper.make_tensor_value_info("width", TensorProto.INT64, None))
    outputs = run_ort(model, {"x": np.zeros((1, 1, 3, 10), np.float32)})
    return outputs["width"].tolist() != [outputs["y"].shape[3]]


def test_runtimes_size_resize_differently():
    """The premise of the two tests below: ``10 * 0.7`` is 6 for onnx's inference and
    reference evaluator, 7 for onnxruntime."""
    model = _runtime_sized_resize_model("direct-linear")
    assert model.graph.output[0].type.tensor_type.shape.dim[3].dim_value == 6
    x = np.zeros((1, 1, 3, 10), np.float32)
    assert ReferenceEvaluator(model).run(None, {"x": x})[0].shape == (1, 1, 3, 6)
    assert run_ort(model, {"x": x})["y"].shape == (1, 1, 3, 7)


@pytest.mark.parametrize("case", sorted(RESIZE_RUNTIME_SIZES))
def test_resize_gradient_takes_the_sizes_onnxruntime_makes(case):
    """onnx's shape inference sizes ``10 * 0.7`` as 6 where onnxruntime's Resize makes 7: the
    gradient must not build on the inferred 6 (it failed with a MatMul dimension mismatch,
    or an onnxruntime load error, before), and the ``y_grad`` input is not declared with
    it. Checked against unit steps on onnxruntime (linear in x: exact). Where onnxruntime's
    optimizer folds the shapes the gradient reads at run time to the float64 size
    (:func:`_onnxruntime_folds_resize_sizes_in_float64`), the graph may be refused at load,
    never wrong: it then runs without graph optimizations."""
    model = _runtime_sized_resize_model(case)
    x = np.random.default_rng(0).standard_normal((1, 1, 3, 10)).astype(np.float32)
    y = run_ort(model, {"x": x})["y"]
    seed = np.random.default_rng(1).standard_normal(y.shape).astype(np.float32)
    grad_model = onnx_derivative(model, weights=[], backend="onnx")
    feeds = {"x": x, "y_grad": seed}
    try:
        got = run_ort(grad_model, feeds)["x_grad"]
    except Exception:  # onnxruntime's own inconsistency, refused loudly
        if not _onnxruntime_folds_resize_sizes_in_float64():
            raise
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = onnxruntime.InferenceSession(
            grad_model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        (got,) = session.run(["x_grad"], feeds)
    expected = unit_step_vjp(model, {"x": x}, "x", "y", seed)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", sorted(RESIZE_RUNTIME_SIZES))
def test_resize_gradient_on_the_reference_evaluator_takes_its_sizes(case):
    """The same models in float64 on onnx's reference evaluator, which sizes ``10 * 0.7`` as
    6: the gradient reads the sizes at run time, so it is right there too (against central
    differences)."""
    model = _runtime_sized_resize_model(case, TensorProto.DOUBLE)
    x = np.random.default_rng(0).standard_normal((1, 1, 3, 10))
    forward = ReferenceEvaluator(model)
    y = forward.run(None, {"x": x})[0]
    seed = np.random.default_rng(1).standard_normal(y.shape)
    grad_model = onnx_derivative(model, weights=[], backend="onnx")
    got = ReferenceEvaluator(grad_model).run(None, {"x": x, "y_grad": seed})[0]
    expected = np.zeros_like(x)
    for j in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[j] = 1e-6
        moved = [forward.run(None, {"x": x + sign * step})[0] for sign in (1, -1)]
        expected[j] = np.sum((moved[0] - moved[1]) * seed) / 2e-6
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_gather_elements_of_unknown_rank_data_takes_the_rank_of_its_indices():
    """GatherElements wants data and indices of one rank: where inference loses the data's
    (DeBERTa's position scores, expanded by a computed shape) the indices' serves. The
    gradient is the scatter-add of the seed (repeated indices add up)."""
    nodes = [  # a reshape to a fed shape: the data's rank unknown
        helper.make_node("Reshape", ["x", "shape"], ["data"]),
        helper.make_node("GatherElements", ["data", "i"], ["y"], name="gather", axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "gather",
        [
            helper.make_tensor_value_info("x", FLOAT, [2, 4]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [None]),
            helper.make_tensor_value_info("i", TensorProto.INT64, [2, 5]),
        ],
        [helper.make_tensor_value_info("y", FLOAT, [2, 5])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    i = np.array([[0, 2, 2, -1, 2], [1, 1, 0, 3, 0]], np.int64)
    g = np.random.default_rng(1).standard_normal((2, 5)).astype(np.float32)
    want = np.zeros_like(x)
    for row, col in np.ndindex(i.shape):
        want[row, i[row, col] % 4] += g[row, col]
    grad = onnx_derivative(model, inputs=["x"], weights=[])
    feeds = {"x": x, "shape": np.array([2, 4]), "i": i, "y_grad": g}
    got = run_ort(grad, feeds)["x_grad"]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_table_repeated_to_the_batch_through_a_filled_shape_has_a_gradient():
    """PyTorch's ``repeat`` as the TorchScript exporter writes it (DeBERTa's position keys):
    ``Expand`` to ``ConstantOfShape(Shape(repeats))``, then ``Tile``. Plain inference
    sizes no such fill, so the ``Tile`` had no rank and its gradient refused; the fill is
    shaped like the static ``repeats`` now. ``table_grad`` sums the seed over the batch."""
    node = helper.make_node
    nodes = [
        node("Shape", ["x"], ["s"]),
        node("Gather", ["s", "zero"], ["batch"], axis=0),
        node("Unsqueeze", ["batch", "axes"], ["batch1"]),
        node("Concat", ["batch1", "one", "one"], ["repeats"], axis=0),
        node("Shape", ["repeats"], ["count"]),
        node(
            "ConstantOfShape",
            ["count"],
            ["ones"],
            value=numpy_helper.from_array(np.ones(1, np.int64)),
        ),
        node("Expand", ["table", "ones"], ["expanded"]),
        node("Tile", ["expanded", "repeats"], ["tiled"], name="the_Tile"),
        node("Add", ["x", "tiled"], ["y"]),
    ]
    table = np.random.default_rng(0).standard_normal((1, 6, 4)).astype(np.float32)
    graph = helper.make_graph(
        nodes,
        "repeat",
        [helper.make_tensor_value_info("x", FLOAT, ["N", 6, 4])],
        [helper.make_tensor_value_info("y", FLOAT, ["N", 6, 4])],
        [
            numpy_helper.from_array(table, "table"),
            numpy_helper.from_array(np.array(0, np.int64), "zero"),
            numpy_helper.from_array(np.array([0], np.int64), "axes"),
            numpy_helper.from_array(np.array([1], np.int64), "one"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    grad = onnx_derivative(model, inputs=[], weights=["table"])
    g = np.random.default_rng(1).standard_normal((3, 6, 4)).astype(np.float32)
    feeds = {"x": np.zeros((3, 6, 4), np.float32), "table": table, "y_grad": g}
    declared = {i.name for i in grad.graph.input}
    got = run_ort(grad, {k: v for k, v in feeds.items() if k in declared})["table_grad"]
    np.testing.assert_allclose(got, g.sum(0, keepdims=True), rtol=1e-6)
