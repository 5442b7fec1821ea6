"""Derivatives at empty points: a batch of 0, or an empty inner axis (issue 33).

Each model ``loss = sum(tanh(op(x, w))^2)`` is built once per opset with a symbolic batch
``N`` (and an inner size ``K``) and its derivative graphs are run by onnxruntime (float32) at
an empty batch, an empty inner axis and a non-empty point: the reverse gradient and the JVP
against float64 central differences of the model (the difference quotients of an empty
tensor are an empty tensor), the HVP against central differences of the reverse gradient,
each by the tangent pass and by the transposition; ``seeds=3`` equals 3 single runs.
The cases still open are listed in ``_OPEN`` with the reason, marked and not run: most are
onnxruntime 1.19's faults (1.32 runs them right).
"""

from __future__ import annotations

import functools

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper
from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as NotImplemented_

from benchmarks.coverage_modes import transposition_only
from onnxgrad import DerivativeOptions, onnx_derivative, onnx_hvp, onnx_jvp
from tests.derivative.fd import onnx_function, run_onnxruntime, to_double

pytestmark = pytest.mark.slow

FLOAT = TensorProto.FLOAT


def _ints(name: str, values: list[int]):
    return helper.make_tensor(name, TensorProto.INT64, [len(values)], values)


def _loss(outputs: list[str]) -> list:
    """``loss = sum_k sum(tanh(y_k)^2)``."""
    nodes, sums = [], []
    for y in outputs:
        nodes += [
            helper.make_node("Tanh", [y], [f"{y}_t"]),
            helper.make_node("Mul", [f"{y}_t", f"{y}_t"], [f"{y}_q"]),
            helper.make_node("ReduceSum", [f"{y}_q"], [f"{y}_s"], keepdims=0),
        ]
        sums.append(f"{y}_s")
    total = sums[0]
    for i, other in enumerate(sums[1:]):
        nodes.append(helper.make_node("Add", [total, other], [f"total{i}"]))
        total = f"total{i}"
    nodes.append(helper.make_node("Identity", [total], ["loss"]))
    return nodes


def _with_axes(op: str, inputs: list[str], out: str, axes: list[int], opset: int, since: int, **kw):
    """A node taking ``axes`` (or Split's ``split``) as an attribute before ``since``, else as
    a constant input."""
    key = "split" if op == "Split" else "axes"
    outs = out if isinstance(out, list) else [out]
    if opset < since:
        return [helper.make_node(op, inputs, outs, **{key: axes}, **kw)]
    name = f"{outs[0]}_{key}"
    return [
        helper.make_node("Constant", [], [name], value=_ints(name, axes)),
        helper.make_node(op, [*inputs, name], outs, **kw),
    ]


class Case:
    """A model: its differentiated inputs with shapes (``"N"``, ``"K"`` symbolic), the
    nodes to ``y`` (or several outputs), the lowest opset, whether it has an inner axis."""

    def __init__(self, name, inputs, nodes, outputs=("y",), since=11, inner=True):
        self.name, self.inputs, self.nodes = name, inputs, nodes
        self.outputs, self.since, self.inner = list(outputs), since, inner

    def model(self, opset: int):
        inputs = [helper.make_tensor_value_info(n, FLOAT, s) for n, s in self.inputs.items()]
        nodes = [*self.nodes(opset), *_loss(self.outputs)]
        out = [helper.make_tensor_value_info("loss", FLOAT, [])]
        graph = helper.make_graph(nodes, self.name, inputs, out)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 8
        return model

    def feeds(self, n: int, k: int, seed: int = 0) -> dict:
        rng = np.random.default_rng(seed)
        sizes = {"N": n, "K": k}
        return {
            name: (0.5 * rng.standard_normal([sizes.get(d, d) for d in shape])).astype(np.float32)
            for name, shape in self.inputs.items()
        }


def _node(op, inputs, out="y", **kw):
    return lambda opset: [helper.make_node(op, inputs, [out], **kw)]


CASES = [
    Case(
        "conv",
        {"x": ["N", 2, 4, 4], "w": [3, 2, 3, 3], "b": [3]},
        _node("Conv", ["x", "w", "b"], pads=[1, 1, 1, 1]),
        inner=False,
    ),
    Case(
        "conv_grouped",
        {"x": ["N", 4, 4, 4], "w": [4, 2, 3, 3]},
        _node("Conv", ["x", "w"], group=2, strides=[2, 2]),
        inner=False,
    ),
    Case(
        "conv_grouped_wide",
        {"x": ["N", 4, 12, 12], "w": [2, 2, 3, 3]},
        _node("Conv", ["x", "w"], group=2),
        inner=False,
    ),
    Case(
        "conv_grouped_large_kernel",
        {"x": ["N", 4, 6, 6], "w": [2, 2, 5, 5]},
        _node("Conv", ["x", "w"], group=2),
        inner=False,
    ),
    Case(
        "conv_strided_columns",
        {"x": ["N", 2, 7, 7], "w": [2, 2, 3, 3]},
        _node("Conv", ["x", "w"], strides=[2, 2]),
        inner=False,
    ),
    Case(
        "conv_transpose",
        {"x": ["N", 2, 3, 3], "w": [2, 2, 2, 2]},
        _node("ConvTranspose", ["x", "w"], strides=[2, 2]),
        inner=False,
    ),
    Case(
        "conv_transpose_grouped",
        {"x": ["N", 4, 3, 3], "w": [4, 1, 3, 3]},
        _node("ConvTranspose", ["x", "w"], group=2, pads=[1, 1, 1, 1]),
        inner=False,
    ),
    Case(
        "max_pool",
        {"x": ["N", 2, 4, 4]},
        _node("MaxPool", ["x"], kernel_shape=[2, 2], strides=[2, 2]),
        inner=False,
    ),
    Case(
        "max_pool_overlap",
        {"x": ["N", 2, 4, 4]},
        _node("MaxPool", ["x"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        inner=False,
    ),
    Case(
        "average_pool",
        {"x": ["N", 2, 5, 5]},
        _node("AveragePool", ["x"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        inner=False,
    ),
    Case(
        "global_average_pool", {"x": ["N", 2, 3, 3]}, _node("GlobalAveragePool", ["x"]), inner=False
    ),
    Case("flatten", {"x": ["N", 3, "K"]}, _node("Flatten", ["x"], axis=1)),
    Case("flatten_inner", {"x": ["N", "K", 2]}, _node("Flatten", ["x"], axis=2)),
    Case("gemm", {"x": ["N", "K"], "w": ["K", 3], "c": [3]}, _node("Gemm", ["x", "w", "c"])),
    Case("matmul", {"x": ["N", 2, "K"], "w": ["K", 3]}, _node("MatMul", ["x", "w"])),
    Case("softmax", {"x": ["N", 2, "K"]}, _node("Softmax", ["x"], axis=-1)),
    Case("softmax_inner", {"x": ["N", "K", 3]}, _node("Softmax", ["x"], axis=-1)),
    Case(
        "layer_norm",
        {"x": ["N", "K", 3], "s": [3], "c": [3]},
        _node("LayerNormalization", ["x", "s", "c"], axis=-1),
        since=17,
    ),
    Case(
        "concat",
        {"x": ["N", "K", 2], "z": ["N", "K", 3]},
        _node("Concat", ["x", "z"], axis=2),
    ),
    Case(
        "split",
        {"x": ["N", "K", 4]},
        lambda opset: _with_axes("Split", ["x"], ["y", "y2"], [1, 3], opset, 13, axis=2),
        outputs=("y", "y2"),
    ),
    Case(
        "gather",
        {"x": ["N", "K", 3]},
        lambda opset: [
            helper.make_node("Constant", [], ["i"], value=_ints("i", [2, 0, 2])),
            helper.make_node("Gather", ["x", "i"], ["y"], axis=2),
        ],
    ),
    Case(
        "reduce_mean",
        {"x": ["N", "K", 3]},
        lambda opset: _with_axes("ReduceMean", ["x"], "y", [2], opset, 18, keepdims=1),
    ),
]

OPSETS = (11, 13, 14, 18)
POINTS = {"batch0": (0, 2), "inner0": (2, 0), "full": (2, 2)}


def _open_on_1_19() -> dict:
    """``{(test, case, opset, point, mode): why}``: onnxruntime 1.19's faults at empty points
    (1.32 runs all of these right), marked and not run there."""
    gemm = "onnxruntime 1.19's Gemm refuses an empty contraction (K = 0)"
    both = ("hvp", "hvp_transposed")
    contracted = ["conv", "conv_strided_columns", "conv_transpose"]
    specs = [
        (gemm, "reverse", [*contracted, "gemm", "matmul"], "batch0", [None]),
        (gemm, "hvp", [*contracted, "gemm", "matmul"], "batch0", both),
        (gemm, "seeds", [*contracted, "gemm"], "batch0", ["hvp"]),
        (gemm + ", the model's own Gemm", "reverse", ["gemm"], "inner0", [None]),
        (gemm + ", the model's own Gemm", "jvp", ["gemm"], "inner0", ["jvp", "jvp_transposed"]),
        (gemm + ", the model's own Gemm", "hvp", ["gemm"], "inner0", both),
        (gemm + ", the model's own Gemm", "seeds", ["gemm"], "inner0", ["jvp", "hvp"]),
        (gemm, "jvp", ["matmul"], "inner0", ["jvp_transposed"]),
        (gemm, "hvp", ["matmul"], "inner0", ["hvp_transposed"]),
        ("onnxruntime 1.19's MatMul refuses to broadcast an empty batch", "seeds", ["matmul"],
         "batch0", ["jvp", "hvp"]),
        ("onnxruntime 1.19 refuses a ReduceSum over an empty axis (transposed Mul gradient)",
         "jvp", ["softmax"], "inner0", ["jvp_transposed"]),
    ]  # fmt: skip
    found = {
        (test, case, opset, point, mode): why
        for why, test, cases, point, modes in specs
        for case in cases
        for opset in OPSETS
        for mode in modes
    }
    nan = "a NaN from onnxruntime 1.19's extended graph optimisations (none without them)"
    for opset in (11, 13):
        found["hvp", "conv_grouped", opset, "batch0", "hvp_transposed"] = nan
        found["seeds", "conv_grouped", opset, "batch0", "hvp"] = nan
    flaky = "a NaN now and then from onnxruntime 1.19 (an empty contraction; not the model)"
    for opset in OPSETS:  # seen in 2 of 4 runs, at opset 14
        for test, mode in [("jvp", "jvp"), ("hvp", "hvp"), ("seeds", "jvp"), ("seeds", "hvp")]:
            found[test, "matmul", opset, "inner0", mode] = flaky
    # the weight gradient's MatMul contracts the empty batch: 1.19 leaves its output
    # unwritten (NaNs in w's gradient in about one run of two; zeros on 1.32)
    unwritten = "onnxruntime 1.19's MatMul over an empty contraction leaves its output unwritten"
    for opset in OPSETS:
        for test, mode in [("reverse", None), ("hvp", "hvp"), ("hvp", "hvp_transposed"),
                           ("seeds", "hvp")]:  # fmt: skip
            found[test, "conv_transpose_grouped", opset, "batch0", mode] = unwritten
    return found


def _open_everywhere() -> dict:
    """``{(test, case, opset, point, mode): why}``: open on every onnxruntime."""
    case = "conv_grouped_large_kernel"
    inner = (
        "the transposition of the weight gradient's Conv, whose input channels G N are 0 "
        "at batch 0: its own gradient's Reshapes"
    )
    found = {}
    for opset in OPSETS:
        found["jvp", case, opset, "batch0", "jvp_transposed"] = inner
        found["hvp", case, opset, "batch0", "hvp_transposed"] = inner
        found["seeds", case, opset, "batch0", "hvp"] = "the seeded weight-gradient Conv at batch 0"
    for opset in (11, 13):
        found["seeds", case, opset, "full", "hvp"] = (
            "below opset 14 the seed axis falls back to a Scan onnxruntime refuses (outputs "
            "without shapes), at every point"
        )
    return found


_OPEN = {
    **_open_everywhere(),
    **(_open_on_1_19() if onnxruntime.__version__ < "1.20" else {}),
}


def _params(test: str, modes=(None,)):
    for case in CASES:
        for opset in OPSETS:
            if opset < case.since:
                continue
            for point, (n, k) in POINTS.items():
                if point == "inner0" and not case.inner:
                    continue
                for mode in modes:
                    why = _OPEN.get((test, case.name, opset, point, mode))
                    marks = [pytest.mark.xfail(run=False, reason=why)] if why else []
                    name = f"{case.name}-opset{opset}-{point}" + (f"-{mode}" if mode else "")
                    args = (case, opset, n, k) + ((mode,) if mode else ())
                    yield pytest.param(*args, id=name, marks=marks)


PARAMS = list(_params("reverse"))
MODES = ("jvp", "jvp_transposed"), ("hvp", "hvp_transposed"), ("jvp", "hvp")


@functools.cache
def _graph(case: Case, opset: int, mode: str):
    model = case.model(opset)
    names = list(case.inputs)
    if mode == "reverse":
        return onnx_derivative(model, weights=[], inputs=names, options=DerivativeOptions.Loss)
    build = onnx_jvp if mode.startswith("jvp") else onnx_hvp
    seeds = 3 if mode.endswith("seeds") else None
    if "transposed" in mode:
        with transposition_only():
            return build(model, inputs=names, seeds=seeds)
    return build(model, inputs=names, seeds=seeds)


@functools.cache
def _function(case: Case, opset: int):
    """The model in float64, run by onnxruntime, or by onnx's reference evaluator where
    onnxruntime has no float64 kernel (Conv, pooling)."""
    model = to_double(case.model(opset))
    try:
        run_onnxruntime(model, {n: v.astype(np.float64) for n, v in case.feeds(1, 1).items()})
    except NotImplemented_:
        return functools.partial(_reference, onnx_function(model), case.model(opset))
    return lambda feeds: [run_onnxruntime(model, feeds)["loss"]]


def _reference(reference, model, feeds: dict) -> list:
    """``reference(feeds)``, or where a feed is empty (onnx's GlobalAveragePool divides by
    its 0 elements) the float32 model in onnxruntime: a loss of nothing, 0 at every point."""
    if all(v.size for v in feeds.values()):
        return reference(feeds)
    single = {name: v.astype(np.float32) for name, v in feeds.items()}
    return [run_onnxruntime(model, single)["loss"].astype(np.float64)]


def _check_shapes(got: dict, feeds: dict, suffix: str):
    for name, value in feeds.items():
        assert got[f"{name}{suffix}"].shape == value.shape, name


def _directional(case: Case, opset: int, feeds: dict, tangents: dict, eps: float = 1e-5):
    """``d/dt loss(feeds + t tangents)`` at 0 by float64 central differences."""
    f = _function(case, opset)
    double = {name: v.astype(np.float64) for name, v in feeds.items()}
    plus, minus = f(_moved(double, tangents, eps))[0], f(_moved(double, tangents, -eps))[0]
    return (plus - minus) / (2 * eps)


@pytest.mark.parametrize(("case", "opset", "n", "k"), PARAMS)
def test_reverse(case, opset, n, k):
    """The gradient has the inputs' shapes and ``<grad, v> = d/dt loss(x + t v)``."""
    feeds = case.feeds(n, k)
    tangents = _tangents(feeds, 1)
    got = run_onnxruntime(_graph(case, opset, "reverse"), feeds)
    _check_shapes(got, feeds, "_grad")
    projected = sum(float(np.sum(got[f"{n}_grad"] * tangents[f"{n}_tangent"])) for n in feeds)
    expected = _directional(case, opset, feeds, tangents)
    np.testing.assert_allclose(projected, expected, rtol=1e-3, atol=1e-4)


def _tangents(feeds: dict, seed: int, count: int | None = None) -> dict:
    rng = np.random.default_rng(seed)
    lead = [] if count is None else [count]
    return {
        f"{name}_tangent": rng.standard_normal([*lead, *v.shape]).astype(np.float32)
        for name, v in feeds.items()
    }


def _moved(feeds: dict, tangents: dict, step: float) -> dict:
    return {name: v + step * tangents[f"{name}_tangent"] for name, v in feeds.items()}


@pytest.mark.parametrize(("case", "opset", "n", "k", "mode"), list(_params("jvp", MODES[0])))
def test_jvp(case, opset, n, k, mode):
    feeds = case.feeds(n, k)
    tangents = _tangents(feeds, 1)
    got = run_onnxruntime(_graph(case, opset, mode), {**feeds, **tangents})["loss_tangent"]
    expected = _directional(case, opset, feeds, tangents)
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize(("case", "opset", "n", "k", "mode"), list(_params("hvp", MODES[1])))
def test_hvp(case, opset, n, k, mode):
    feeds = case.feeds(n, k)
    tangents = _tangents(feeds, 2)
    got = run_onnxruntime(_graph(case, opset, mode), {**feeds, **tangents})
    _check_shapes(got, feeds, "_grad_tangent")
    gradient = _graph(case, opset, "reverse")
    eps = 1e-3
    moved = [run_onnxruntime(gradient, _moved(feeds, tangents, s * eps)) for s in (1, -1)]
    for name in feeds:
        expected = (moved[0][f"{name}_grad"] - moved[1][f"{name}_grad"]) / (2 * eps)
        np.testing.assert_allclose(got[f"{name}_grad_tangent"], expected, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize(("case", "opset", "n", "k", "mode"), list(_params("seeds", MODES[2])))
def test_seeds(case, opset, n, k, mode):
    """``seeds=3`` in one run equals 3 single runs."""
    feeds = case.feeds(n, k)
    tangents = _tangents(feeds, 3, count=3)
    batched = run_onnxruntime(_graph(case, opset, f"{mode}_seeds"), {**feeds, **tangents})
    single = _graph(case, opset, mode)
    runs = [
        run_onnxruntime(single, {**feeds, **{t: v[i] for t, v in tangents.items()}})
        for i in range(3)
    ]
    for name, value in batched.items():
        np.testing.assert_allclose(value, np.stack([r[name] for r in runs]), rtol=1e-5, atol=1e-6)
