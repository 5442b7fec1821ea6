"""Operator coverage of the native gradients, measured on onnx's own operator test cases.

Every single-operator model of ``onnx.backend.test.case.node.collect_testcases()`` (the code
behind onnx's backend test data; the ``*_expanded`` variants left out) is differentiated by
``onnx_derivative(backend="onnx")`` with respect to each float input that the operator's
schema does not mark non-differentiable (STFT's signal and window and DFT's input too: the
schemas mark them so, but both are linear in each), when the operator has a float output.
The model is converted to float64 and the gradient checked along random directions ``v``:

    <x_grad, v>  ==  (f(x + eps v) - f(x - eps v)) / (2 eps),   f = sum_k <y_k, g_k>

with random output gradients ``g_k``. An input whose node's schema refuses float64 (as
CausalConvWithState or RotaryEmbedding) reaches it through a cast to its declared type, so
the model computes it in that type: the step and tolerance are then that type's (a float64
step of 1e-6 vanishes in float16 rounding), and the case's detail names the type.

Points without a derivative. Some test data sit where the function has none (a zero inside
an L1 norm, tied maxima of a pool, an all-zero row of x / ||x||). The harness detects it
from the objective alone: along a direction, the one-sided quotients ``(f(x + eps v) - f(x))
/ eps`` and ``(f(x) - f(x - eps v)) / eps`` disagree (a kink), or the central quotients at
steps ``eps`` and ``4 eps`` disagree (a jump or an infinite slope). It looks along the
random directions, and, before any "wrong" verdict, along the failing direction at two steps
and along every coordinate (64 at most): a case is "wrong" only where no such evidence
exists. At such a point there is no derivative to be right or wrong against: the case gets
the verdict of a jittered point nearby (1e-3 (1 + |x|) away, then 1e-2 if still not
differentiable). The gradient at the point itself is also compared, coordinate by
coordinate, with what finite differences can tell of the generalized derivative there: it
is confirmed where it equals the partial derivative, where it is a one-sided partial
derivative or between the two at a kink (a subgradient along that axis, as ReLU'(0) = 0),
or within the range of the partial derivatives at 8 random points within 1e-4 (1 + |x|) (a
sampled Clarke generalized gradient: where several kinks meet on one axis, as ties of a max
or bilinear samples on the pixel grid, the chain rule combines slopes of different sides);
at a jump any value is a convention. A coordinate with a two-sided partial derivative whose
gradient differs from it and from every partial sampled nearby makes the case ``wrong``
(where a jittered point can be judged at all: else the quotients are not trusted). Where
several kinks meet the sampled range may miss part of the generalized gradient, so a
coordinate at a kink outside it makes the case ``not confirmed``, not ``wrong``. So does a
random direction ``v`` with a kink (the one that showed it, and 8 more per input) along
which ``<gradient, v>`` lies outside the one-sided derivatives ``[min(f'(x; v), -f'(x; -v)),
max(...)]``, both taken with the absolute values of the output gradients (so that a max of
the outputs, as Relu, MaxPool or ReduceMax, stays convex): every generalized gradient of a
function convex or concave near the point lies there, not always for others (``|x1| - |x2|``
at 0 along ``(1, 1)``, bilinear sampling), hence not ``wrong``. These cases are listed apart
in the page with their evidence. Outcomes per case: ``ok``, ``not confirmed`` (ok at a
jittered point, not confirmed at the case's own point without a derivative), ``wrong`` (a
value or a shape differs, or NaN), ``missing`` (``NotImplementedError``: no rule), ``zero
gradient`` (not counted: the engine refuses a gradient that is zero everywhere, as for the
piecewise-constant Hardmax or the integer-valued Range), ``failed`` (the gradient graph
raised another error or did not run) and ``skipped`` (the oracle cannot judge: random
operators, models the evaluator cannot run in float64).

The oracle is onnx's reference evaluator, except where it departs from the spec: ``Erf``
rounds to float32 for doubles (replaced here by a float64 ``Erf``), ``LpNormalization``
drops the absolute value in the norm (replaced by the spec's ``(sum |x|^p)^(1/p)``),
``GridSample`` (and ``DeformConv``, which samples with it) rounds pixel coordinates to
float32 (replaced by float64), ``Upsample`` takes integer nearest scales only (replaced by
the spec's for any scales), ``GatherElements`` gathers from at most 64 entries along its
axis (replaced by ``np.take_along_axis``), ``MaxPool``'s Indices are wrong when strides and
dilations are 1, and Softmax/LogSoftmax/Hardmax before opset 13, BatchNormalization before
opset 14 and Scan before opset 9 (the reference cannot run its batched form)
(onnxruntime evaluates those, where it loads them).

    python benchmarks/coverage_ops.py [--ops Relu,Swish] [--markdown docs/coverage.md]
        [--baseline an-earlier-page.md] [--quantized-activations exact]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import ModelProto, TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from onnxgrad import onnx_derivative
from onnxgrad.derivative.autodiff.cleanup import NONDETERMINISTIC

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the float64 oracles of tests/
from tests.derivative.float64_reference import DeformConv, GridSample

#: operators whose outputs are random by definition (Dropout is random in training mode
#: only, which the two runs of each case detect): skipped whatever one draw gives
RANDOM_OPS = NONDETERMINISTIC - {"Dropout"}
FLOATS = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
#: element types numpy computes with (float8, float4, int4, int2... are left out)
PLAIN = FLOATS | {
    TensorProto.BOOL,
    TensorProto.INT8,
    TensorProto.INT16,
    TensorProto.INT32,
    TensorProto.INT64,
    TensorProto.UINT8,
    TensorProto.UINT16,
    TensorProto.UINT32,
    TensorProto.UINT64,
    TensorProto.STRING,
}
NON_DIFFERENTIABLE = onnx.defs.OpSchema.DifferentiationCategory.NonDifferentiable
#: inputs a schema marks non-differentiable though the operator is smooth in them (STFT is
#: linear in its signal and its window, DFT in its input): checked like the others
DIFFERENTIABLE_DESPITE_SCHEMA = {
    "STFT": frozenset({"signal", "window"}),
    "DFT": frozenset({"input"}),
}
STATUSES = ("ok", "not confirmed", "wrong", "missing", "failed", "skipped")
EPS = 1e-6
RTOL = 1e-4

#: Families for the summary: the rule module of each operator, or this table for the ones
#: the rule modules do not name (a family is a reading aid, not a measure).
FAMILY_OF = {
    **dict.fromkeys(["LSTM", "GRU", "RNN"], "recurrent"),
    **dict.fromkeys(["If", "Loop", "Scan", "SequenceMap"], "control_flow"),
    **dict.fromkeys(
        ["Attention", "RotaryEmbedding", "LinearAttention", "CausalConvWithState"], "attention"
    ),
    **dict.fromkeys(
        [
            "RMSNormalization",
            "GroupNormalization",
            "LRN",
            "LpNormalization",
            "MeanVarianceNormalization",
        ],
        "normalization",
    ),
    **dict.fromkeys(
        ["LpPool", "MaxUnpool", "RoiAlign", "MaxRoiPool", "GlobalLpPool", "Col2Im"], "pool"
    ),
    **dict.fromkeys(["DeformConv", "ConvInteger", "QLinearConv"], "conv"),
    **dict.fromkeys(["Swish", "SwiGLU", "Shrink"], "activations"),
    **dict.fromkeys(["Det", "CumProd", "TopK"], "linalg"),
    **dict.fromkeys(
        [
            "Compress",
            "ReverseSequence",
            "TensorScatter",
            "GridSample",
            "AffineGrid",
            "CenterCropPad",
            "Upsample",
            "Scatter",
        ],
        "indexing",
    ),
    **dict.fromkeys(
        ["DequantizeLinear", "QuantizeLinear", "DynamicQuantizeLinear"], "quantization"
    ),
}


@dataclass
class Outcome:
    case: str
    op_type: str
    opset: int
    status: str
    detail: str = ""
    inputs: list[str] = field(default_factory=list)
    #: why the function has no derivative at the test point, and what the gradient there
    #: was checked against ("" at a differentiable point)
    point: str = ""
    #: with ``--onnxruntime``, for an ok case: "agrees", or why its gradient graph does not
    #: run on onnxruntime or gives other values than on the reference evaluator
    runtime: str = ""


# -- the oracle --------------------------------------------------------------------------------
class Erf(OpRun):
    """``Erf`` in the input's precision (the reference one rounds to float32)."""

    op_domain = ""

    def _run(self, x):
        return (np.vectorize(math.erf, otypes=[x.dtype])(x),)


class Gelu(OpRun):
    """``Gelu`` in the input's precision (the reference one rounds erf to float32)."""

    op_domain = ""

    def _run(self, x, approximate="none"):
        if approximate == "tanh":
            inner = np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)
            return ((0.5 * x * (1 + np.tanh(inner))).astype(x.dtype),)
        erf = np.vectorize(math.erf, otypes=[x.dtype])(x / np.sqrt(2))
        return ((0.5 * x * (1 + erf)).astype(x.dtype),)


class LpNormalization(OpRun):
    """``x / ||x||_p`` with the spec's norm ``(sum |x|^p)^(1/p)`` (the reference one drops the
    absolute value: for ``p = 1`` it divides by the signed sum), 0 where the norm is 0."""

    op_domain = ""

    def _run(self, x, axis=-1, p=2):
        norm = np.sum(np.abs(x) ** p, axis=axis, keepdims=True) ** (1.0 / p)
        with np.errstate(invalid="ignore", divide="ignore"):
            return (np.where(norm == 0, 0, x / norm).astype(x.dtype),)


class Upsample(OpRun):
    """``Upsample`` (opsets 7 and 9) for any scales (the reference takes integer nearest
    scales only): output size ``floor(n s)``; output ``i`` reads ``i / s``, the nearest
    input below it (nearest) or interpolated between its two neighbours (linear), clamped
    to the last input."""

    op_domain = ""

    def _run(self, x, scales=None, mode="nearest"):
        y = x
        for axis, scale in enumerate(np.asarray(scales, dtype=np.float64)):
            n = x.shape[axis]
            position = np.minimum(np.arange(int(np.floor(n * scale))) / scale, n - 1)
            low = np.floor(position).astype(np.int64)
            if mode == "nearest":
                y = np.take(y, low, axis=axis)
                continue
            high = np.minimum(low + 1, n - 1)
            weight = (position - low).reshape([-1 if a == axis else 1 for a in range(x.ndim)])
            y = np.take(y, low, axis=axis) * (1 - weight) + np.take(y, high, axis=axis) * weight
        return (y.astype(x.dtype),)


class GatherElements(OpRun):
    """``GatherElements`` along any axis size (the reference one gathers with ``np.choose``,
    which takes at most 64 entries along the axis: a forward-mode MaxPool gathers along a
    flattened window of more)."""

    op_domain = ""

    def _run(self, data, indices, axis=0):
        indices = np.where(indices < 0, indices + data.shape[axis], indices)
        return (np.take_along_axis(data, indices, axis=axis),)


def _ort_oracle(op_type: str, opset: int) -> bool:
    """Cases the reference evaluator gets wrong and onnxruntime evaluates instead."""
    return (
        op_type == "MaxPool"
        or (op_type in ("Softmax", "LogSoftmax", "Hardmax") and opset < 13)
        or (op_type == "BatchNormalization" and opset < 14)
        or (op_type == "Scan" and opset < 9)
    )


class Oracle:
    """Runs a model in float64 on the chosen evaluator: ``run(feeds) -> list of arrays``."""

    def __init__(self, model: ModelProto, use_ort: bool):
        self.session = None
        self.input_names = {i.name for i in model.graph.input}
        if use_ort:
            with contextlib.suppress(Exception):
                import onnxruntime

                options = onnxruntime.SessionOptions()
                options.intra_op_num_threads = 1
                options.log_severity_level = 4
                self.session = onnxruntime.InferenceSession(
                    model.SerializeToString(), options, providers=["CPUExecutionProvider"]
                )
        if self.session is None:
            self.session = ReferenceEvaluator(
                model,
                new_ops=[
                    Erf,
                    Gelu,
                    LpNormalization,
                    GridSample,
                    DeformConv,
                    Upsample,
                    GatherElements,
                ],
            )

    def run(self, feeds: dict) -> list[np.ndarray]:
        """The outputs for ``feeds``, of which only the model's inputs are given (a gradient
        graph takes no gradient for an integer output, as MaxPool's indices)."""
        feeds = {name: value for name, value in feeds.items() if name in self.input_names}
        return [np.asarray(v) for v in self.session.run(None, feeds)]


# -- models in float64 -------------------------------------------------------------------------
def to_double(model: ModelProto) -> ModelProto:
    """The model with every float element type (inputs, outputs, initializers, constants,
    ``to``/``dtype`` attributes) turned into float64 (see :func:`_cast_where_double_is_refused`
    for the inputs that must stay float32)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    types = {i.name: i.type.tensor_type.elem_type for i in graph.input}
    for info in [*graph.input, *graph.output, *graph.value_info]:
        tensor = info.type.tensor_type
        if tensor.elem_type in FLOATS:
            tensor.elem_type = TensorProto.DOUBLE
    for i, init in enumerate(graph.initializer):
        if init.data_type in FLOATS:
            array = numpy_helper.to_array(init).astype(np.float64)
            graph.initializer[i].CopyFrom(numpy_helper.from_array(array, init.name))
    for node in graph.node:
        for attr in node.attribute:
            if attr.name in ("to", "dtype") and attr.i in FLOATS:
                attr.i = TensorProto.DOUBLE
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in FLOATS:
                array = numpy_helper.to_array(attr.t).astype(np.float64)
                attr.t.CopyFrom(numpy_helper.from_array(array, attr.t.name))
    _cast_where_double_is_refused(model, types)
    return model


def _cast_where_double_is_refused(model: ModelProto, types: dict) -> None:
    """Graph inputs that a node's schema restricts to float32 (as Upsample's scales) stay
    float64 graph inputs but reach that node through a Cast to their original type."""
    graph = model.graph
    inputs = {i.name for i in graph.input}
    casts = {}
    for node, position, parameter, schema in _formal_parameters(model):
        name = node.input[position]
        if name not in inputs or types.get(name) not in FLOATS:
            continue
        constraints = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
        if "tensor(double)" in constraints.get(parameter.type_str, [parameter.type_str]):
            continue
        if name not in casts:
            casts[name] = f"{name}__as_declared"
            graph.node.insert(0, helper.make_node("Cast", [name], [casts[name]], to=types[name]))
        node.input[position] = casts[name]


def _formal_parameters(model: ModelProto):
    """``(node, position, formal parameter, schema)`` for each input of each node of the
    main graph whose schema is known (a variadic last parameter covers the rest)."""
    for node in list(model.graph.node):
        try:
            schema = onnx.defs.get_schema(node.op_type, _opset(model, node.domain), node.domain)
        except onnx.defs.SchemaError:
            continue
        formal = list(schema.inputs)
        for position in range(len(node.input) if formal else 0):
            yield node, position, formal[min(position, len(formal) - 1)], schema


def as_array(value) -> np.ndarray:
    if isinstance(value, TensorProto):
        return numpy_helper.to_array(value)
    return np.asarray(value)


def _as_double(value: np.ndarray) -> np.ndarray:
    if value.dtype.kind == "f" or value.dtype.name == "bfloat16":
        return value.astype(np.float64)
    return value


# -- one case ----------------------------------------------------------------------------------
def differentiable_inputs(model: ModelProto) -> list[str]:
    """Float graph inputs read by a node input that the schema does not mark
    non-differentiable, in a model with a float output."""
    graph = model.graph
    if not any(o.type.tensor_type.elem_type in FLOATS for o in graph.output):
        return []
    float_inputs = {i.name for i in graph.input if i.type.tensor_type.elem_type in FLOATS}
    chosen = {
        node.input[position]
        for node, position, parameter, _ in _formal_parameters(model)
        if node.input[position] in float_inputs
        and (
            parameter.differentiation_category != NON_DIFFERENTIABLE
            or parameter.name in DIFFERENTIABLE_DESPITE_SCHEMA.get(node.op_type, ())
        )
    }
    return [i.name for i in graph.input if i.name in chosen]


def _opset(model: ModelProto, domain: str = "") -> int:
    domain = "" if domain == "ai.onnx" else domain
    for entry in model.opset_import:
        if ("" if entry.domain == "ai.onnx" else entry.domain) == domain:
            return entry.version
    return 1


def _main_op(model: ModelProto) -> str:
    ops = [n.op_type for n in model.graph.node if n.op_type != "Constant"]
    return ops[0] if ops else "Constant"


def check_case(
    name: str, model: ModelProto, inputs: list, seed: int = 0, rounding: str = "straight_through"
) -> Outcome:
    """The outcome of one test case (see the module docstring); ``rounding``: the
    ``quantized_activations=`` the gradient is built with.

    The model runs in float64 where it can; where the float64 conversion does not build or
    run (float constants inside, type constraints), the test case's own precision is used
    with a looser tolerance.
    """
    op_type, opset = _main_op(model), _opset(model)
    outcome = Outcome(name, op_type, opset, "skipped")
    graph = model.graph
    if any(not i.type.HasField("tensor_type") for i in [*graph.input, *graph.output]):
        outcome.detail = "non-tensor inputs or outputs"
        return outcome
    if any(i.type.tensor_type.elem_type not in PLAIN for i in [*graph.input, *graph.output]):
        outcome.detail = "element types numpy does not compute with (float8, int4...)"
        return outcome
    wrt = differentiable_inputs(model)
    outcome.inputs = wrt
    if not wrt:
        outcome.status = "no float derivative"
        return outcome
    arrays = [as_array(v) for v in inputs]
    verdict = _judge(model, arrays, wrt, op_type, opset, seed, True, rounding)
    outcome.status, outcome.detail, outcome.point = verdict
    if outcome.status in ("failed", "skipped") and not outcome.detail.startswith("random"):
        status, detail, point = _judge(model, arrays, wrt, op_type, opset, seed, False, rounding)
        if status in ("ok", "not confirmed", "wrong", "missing"):
            outcome.status, outcome.detail = status, f"in the case's precision: {detail}"
            outcome.point = point
    return outcome


def _judge(model, arrays, wrt, op_type, opset, seed, double: bool, rounding: str) -> tuple:
    status, detail, *point = _judge_at_point(
        model, arrays, wrt, op_type, opset, seed, double, rounding
    )
    return status, detail, point[0] if point else ""


def _judge_at_point(model, arrays, wrt, op_type, opset, seed, double: bool, rounding) -> tuple:
    rng = np.random.default_rng(seed)
    if double:
        model = to_double(model)
        arrays = [_as_double(v) for v in arrays]
    feeds = {i.name: v for i, v in zip(model.graph.input, arrays)}
    if any(node.op_type in RANDOM_OPS for node in model.graph.node):
        return "skipped", "random outputs"
    try:
        oracle = Oracle(model, _ort_oracle(op_type, opset))
        outputs = oracle.run(feeds)
        again = oracle.run(feeds)
    except Exception as exc:
        return "skipped", f"the oracle cannot run the model: {_short(exc)}"
    if any(not np.array_equal(a, b, equal_nan=True) for a, b in zip(outputs, again)):
        return "skipped", "random outputs"
    seeds = [_seed(rng, out, info) for out, info in zip(outputs, model.graph.output)]
    try:
        gradient = onnx_derivative(
            model, weights=[], inputs=wrt, backend="onnx", quantized_activations=rounding
        )
    except NotImplementedError as exc:
        if "is not differentiable with respect to" in str(exc):
            return "zero gradient", _short(exc)
        return "missing", _short(exc)
    except Exception as exc:
        return "failed", f"build: {_short(exc)}"
    precision = Precision.of(model, wrt)
    status, detail, *point = _compare(model, gradient, feeds, seeds, wrt, oracle, rng, precision)
    if double and precision.narrowed:
        detail = f"in {precision.narrowed} (the schema refuses float64): {detail}"
    return (status, detail, *point)


@dataclass(frozen=True)
class Precision:
    """Finite-difference step and tolerance for the element type of the inputs."""

    eps: float
    rtol: float
    #: the narrower type a float64 model computes the inputs in ("" where it does not)
    narrowed: str = ""

    @staticmethod
    def of(model: ModelProto, wrt: list[str]) -> Precision:
        """The step and tolerance of the narrowest type the inputs are computed in: an input
        that reaches its node through a cast to its declared type (where the schema refuses
        float64, see :func:`_cast_where_double_is_refused`) is computed in that type, whose
        rounding swallows a float64 step (a float16 ``x + 1e-6 v`` is ``x``)."""
        types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
        narrowed = set()
        for node in model.graph.node:
            if node.op_type == "Cast" and node.output[0] == f"{node.input[0]}__as_declared":
                to = helper.get_attribute_value(node.attribute[0])
                if node.input[0] in wrt and types[node.input[0]] == TensorProto.DOUBLE:
                    narrowed.add(helper.tensor_dtype_to_np_dtype(to).name)
                types[node.input[0]] = to
        label = " and ".join(sorted(narrowed))
        if all(types[n] == TensorProto.DOUBLE for n in wrt):
            return Precision(EPS, RTOL)
        if all(types[n] in (TensorProto.DOUBLE, TensorProto.FLOAT) for n in wrt):
            return Precision(1e-3, 2e-2, label)
        return Precision(3e-2, 1e-1, label)


def _seed(rng, output: np.ndarray, info) -> np.ndarray:
    if info.type.tensor_type.elem_type in FLOATS:
        return rng.standard_normal(output.shape).astype(output.dtype)
    return np.zeros(output.shape, dtype=output.dtype)


class Kink(Exception):
    """The objective is not differentiable at the point (one-sided differences disagree,
    the output shape or finiteness changes); ``along``: ``(input, direction)`` where a
    random direction showed it."""

    def __init__(self, message: str, along: tuple | None = None):
        super().__init__(message)
        self.along = along


def _compare(model, gradient, feeds, seeds, wrt, oracle, rng, precision) -> tuple:
    """``(status, detail, point)``: the verdict at the test point, or, where the function has
    no derivative there, at a jittered point nearby, with ``point`` saying why and what the
    gradient at the test point is (:func:`_at_the_kink`)."""
    use_ort = not isinstance(oracle.session, ReferenceEvaluator)
    names = [o.name for o in model.graph.output]
    try:
        grad_oracle = Oracle(gradient, use_ort)
    except Exception as exc:
        return "failed", f"load: {_short(exc)}"
    shapes = None

    def objective(values, weights=seeds) -> float:
        outputs = oracle.run(values)
        if [o.shape for o in outputs] != shapes:
            raise Kink("the output shape changes")
        total = sum(
            float(np.sum(o.astype(np.float64) * s)) for o, s in zip(outputs, weights) if s.any()
        )
        if not math.isfinite(total):
            raise Kink("the outputs are not finite")
        return total

    def gradients(values, weights=seeds):
        grad_feeds = {
            **values,
            **{f"{n}_grad": s.astype(_dtype_of(model, n)) for n, s in zip(names, weights)},
        }
        results = grad_oracle.run(grad_feeds)
        return dict(zip([o.name for o in gradient.graph.output], results))

    def positive(values):
        """The objective and gradient with the output gradients' absolute values."""
        weights = [np.abs(s) for s in seeds]
        return (lambda v: objective(v, weights)), gradients(values, weights)

    point, at_point, why = "", "ok", ""
    original = [o.shape for o in oracle.run(feeds)]
    for attempt in range(3):
        shapes = [o.shape for o in oracle.run(feeds)]
        if shapes != original:  # the seeds were drawn for the original shapes
            return "skipped", "no jittered point nearby keeps the output shapes"
        try:
            got = gradients(feeds)
        except Exception as exc:
            return "failed", f"run: {_short(exc)}"
        try:
            status, detail = _directional_check(objective, got, feeds, wrt, rng, precision)
        except Kink as kink:
            if attempt == 0:
                try:
                    try:
                        along = positive(feeds)
                    except Exception:  # judged along the directions with the case's seeds
                        along = None
                    point, at_point, why = _at_the_kink(
                        objective, got, feeds, wrt, rng, precision, kink, along
                    )
                except Kink as again:
                    point = f"no derivative at the test point ({kink}; coordinatewise: {again})"
            feeds = _jitter_keeping_shapes(oracle, feeds, wrt, rng, 1e-3 * 10**attempt, original)
            continue
        if point:
            point += f"; judged at a jittered point nearby: {status}"
        if at_point == "wrong" or (at_point == "not confirmed" and status == "ok"):
            return at_point, f"at the test point (no derivative there): {why}", point
        return status, detail, point
    return "skipped", "not differentiable at the test point (kink or tie), even jittered"


def _dtype_of(model: ModelProto, output: str):
    info = next(o for o in model.graph.output if o.name == output)
    return helper.tensor_dtype_to_np_dtype(info.type.tensor_type.elem_type)


def _differences(objective, feeds, name, direction, eps) -> tuple[float, float, float]:
    """Forward, backward and central difference quotients of the objective at ``feeds``
    along ``direction`` of input ``name``."""
    base = feeds[name]
    f0 = objective(feeds)
    plus = objective({**feeds, name: (base + eps * direction).astype(base.dtype)})
    minus = objective({**feeds, name: (base - eps * direction).astype(base.dtype)})
    return (plus - f0) / eps, (f0 - minus) / eps, (plus - minus) / (2 * eps)


def _kink_in(objective, feeds, name, direction, precision, quotients=None) -> str:
    """Why the objective has no derivative along ``direction`` ("" if the quotients say it
    has one): the one-sided derivatives differ (a kink), or the central quotients do not
    converge as the step shrinks (a jump or an infinite slope)."""
    eps, rtol = precision.eps, precision.rtol
    forward, backward, central = quotients or _differences(objective, feeds, name, direction, eps)
    if abs(forward - backward) > 10 * rtol * (abs(forward) + abs(backward)) + 1e-5:
        return f"one-sided derivatives {backward:.6g} (left) and {forward:.6g} (right)"
    coarse = _differences(objective, feeds, name, direction, 4 * eps)[2]
    if abs(central - coarse) > 10 * rtol * (abs(central) + abs(coarse)) + 1e-5:
        return (
            f"the difference quotients do not converge ({central:.6g} at step {eps:g}, "
            f"{coarse:.6g} at step {4 * eps:g}): a jump or an infinite slope"
        )
    return ""


def _directional_check(objective, got, feeds, wrt, rng, precision):
    """``("ok" | "wrong", detail)`` along two random directions per input; raises
    :class:`Kink` where the objective shows it has no derivative at the point: before a
    "wrong" verdict, along the failing direction (two step sizes) and every coordinate."""
    eps, rtol = precision.eps, precision.rtol
    for name in wrt:
        grad = np.asarray(got[f"{name}_grad"]).astype(np.float64)
        base = feeds[name]
        if grad.shape != base.shape:
            return "wrong", f"gradient of {name!r} has shape {grad.shape}, not {base.shape}"
        if np.any(np.isnan(grad)):
            return "wrong", f"gradient of {name!r} has NaN values"
        if not np.all(np.isfinite(grad)):
            raise Kink("infinite derivative")
        for _ in range(2):
            direction = rng.standard_normal(base.shape)
            quotients = _differences(objective, feeds, name, direction, eps)
            forward, backward, expected = quotients
            actual = float(np.sum(grad * direction))
            scale = abs(expected) + abs(actual) + float(np.sum(np.abs(grad * direction)))
            if abs(forward - backward) > 10 * rtol * (abs(forward) + abs(backward)) + 1e-5:
                raise Kink(
                    f"along a random direction of {name!r}: one-sided derivatives "
                    f"{backward:.6g} (left) and {forward:.6g} (right)",
                    (name, direction),
                )
            if abs(actual - expected) > rtol * scale + 1e-6:
                reason = _kink_in(objective, feeds, name, direction, precision, quotients)
                if reason:
                    raise Kink(f"along a random direction of {name!r}: {reason}", (name, direction))
                for j in _coordinates(base.shape, rng):
                    reason = _kink_in(objective, feeds, name, _unit(base.shape, j), precision)
                    if reason:
                        raise Kink(f"along {name}[{', '.join(map(str, j))}]: {reason}")
                return "wrong", (
                    f"d/d{name} along a random direction: {actual:.6g}, finite differences "
                    f"{expected:.6g}"
                )
    return "ok", ""


MAX_COORDINATES = 64


def _coordinates(shape, rng) -> list[tuple[int, ...]]:
    """Every index of ``shape``, or a random sample of :data:`MAX_COORDINATES` of them."""
    indices = list(np.ndindex(shape))
    if len(indices) > MAX_COORDINATES:
        chosen = rng.choice(len(indices), MAX_COORDINATES, replace=False)
        indices = [indices[k] for k in sorted(chosen)]
    return indices


def _unit(shape, index) -> np.ndarray:
    e = np.zeros(shape)
    e[index] = 1.0
    return e


def _at_the_kink(
    objective, got, feeds, wrt, rng, precision, kink, positive=None
) -> tuple[str, str, str]:
    """The evidence that the objective has no derivative at the test point, and whether the
    gradient there is confirmed as a generalized derivative, coordinate by coordinate: equal
    to the partial derivative where one exists; at a kink equal to one of the one-sided
    partial derivatives or between the two (a subgradient along that axis: ReLU'(0) = 0,
    the tie rule of Max); else within the range of the partial derivatives at random points
    nearby (the Clarke generalized gradient, sampled: where several kinks meet on one axis,
    as a tie of a max or bilinear samples on the pixel grid, the chain rule may combine
    one-sided slopes of different sides). At a jump or an infinite slope no value is right
    or wrong (the rule's value is a convention, as for x / ||x|| at x = 0).

    A coordinate with a two-sided partial derivative whose gradient disagrees with it and
    with every partial derivative sampled nearby is "wrong". A coordinate at a kink outside
    its range is "not confirmed" (the sampled range may miss part of the generalized
    gradient), and so is a random direction ``v`` with a kink (the one that showed the kink,
    and :data:`KINK_DIRECTIONS` more per input) along which ``<g, v>`` is outside the
    one-sided derivatives ``[min(f'(x; v), -f'(x; -v)), max(...)]``: where the function is
    convex or concave near the point every generalized gradient is inside, not always for
    others (``|x1| - |x2|`` at 0 along ``(1, 1)``). ``positive``, ``(objective, gradient)``
    with the absolute values of the output gradients, serves for the directions when given:
    a max (Relu, MaxPool, ReduceMax...) weighed by positive output gradients stays convex,
    a sum of them with mixed signs would not.

    Returns ``(summary, "ok" | "not confirmed" | "wrong", the first reason)``."""
    eps, rtol = precision.eps, precision.rtol
    counts = collections.Counter()
    reasons: dict[str, str] = {}
    for name in wrt:
        grad = np.asarray(got[f"{name}_grad"]).astype(np.float64)
        for j in _coordinates(feeds[name].shape, rng):
            e = _unit(feeds[name].shape, j)
            forward, backward, central = _differences(objective, feeds, name, e, eps)
            value = float(grad[j])
            where = f"{name}[{', '.join(map(str, j))}]"
            tol = rtol * (abs(forward) + abs(backward) + abs(value)) + 1e-5
            if abs(forward - backward) > 10 * rtol * (abs(forward) + abs(backward)) + 1e-5:
                if _one_sided_diverge(objective, feeds, name, e, precision, forward, backward):
                    counts["jump"] += 1
                    continue
                kind, low, high = "kink", min(forward, backward), max(forward, backward)
            elif _kink_in(objective, feeds, name, e, precision, (forward, backward, central)):
                counts["jump"] += 1
                continue
            else:
                kind, low, high = "smooth", central, central
            if low - tol <= value <= high + tol:
                counts[kind] += 1
                continue
            nearby = _nearby_partials(objective, feeds, wrt, name, e, rng, eps)
            low, high = min([low, *nearby]), max([high, *nearby])
            if low - tol <= value <= high + tol:
                counts[f"{kind} nearby"] += 1
                continue
            verdict = "wrong" if kind == "smooth" else "unconfirmed"
            counts[verdict] += 1
            reasons.setdefault(verdict, (
                f"at {where} the gradient {value:.6g} is outside the partial derivatives on "
                f"either side ({backward:.6g}, {forward:.6g}) and at {len(nearby)} points "
                f"nearby (range [{low:.6g}, {high:.6g}])"
            ))  # fmt: skip
    along_objective, along_got = positive or (objective, got)
    kinked, outside_count, outside = _directions_at_the_kink(
        along_objective, along_got, feeds, wrt, rng, precision, kink
    )
    if outside:
        reasons.setdefault("unconfirmed", outside)
    checked = sum(counts.values())
    summary = (
        f"no derivative at the test point ({kink}); of {checked} coordinates, "
        f"{counts['kink']} at a kink where the gradient is a one-sided partial derivative or "
        f"between the two, {counts['kink nearby'] + counts['smooth nearby']} where it is within "
        f"the partial derivatives at points nearby, {counts['jump']} at a jump or infinite "
        f"slope (any value is a convention), {counts['smooth']} where it equals the partial "
        f"derivative"
    )
    if counts["wrong"]:
        summary += (
            f", {counts['wrong']} where it is wrong: it differs from a two-sided partial "
            f"derivative and from all those sampled nearby ({reasons['wrong']})"
        )
    if counts["unconfirmed"]:
        summary += (
            f", {counts['unconfirmed']} where the gradient is not confirmed as a generalized "
            f"derivative (at a kink, outside the one-sided and nearby partial derivatives)"
        )
    summary += f"; of {kinked} random directions with a kink (positive output gradients), " + (
        f"{outside_count} where the gradient is not confirmed as a generalized derivative "
        f"(first: {outside})"
        if outside
        else "none where <gradient, direction> is outside the one-sided derivatives"
    )
    if counts["wrong"]:
        return summary, "wrong", reasons["wrong"]
    if "unconfirmed" in reasons:
        return summary, "not confirmed", reasons["unconfirmed"]
    return summary, "ok", ""


KINK_DIRECTIONS = 8


def _directions_at_the_kink(
    objective, got, feeds, wrt, rng, precision, kink
) -> tuple[int, int, str]:
    """How many directions (``kink.along`` and :data:`KINK_DIRECTIONS` random ones per
    input) show a kink, along how many of those ``<g, v>`` is outside the one-sided
    derivatives, and the first of them ("" if none)."""
    eps, rtol = precision.eps, precision.rtol
    directions = [kink.along] if getattr(kink, "along", None) else []
    for name in wrt:
        directions += [
            (name, rng.standard_normal(feeds[name].shape)) for _ in range(KINK_DIRECTIONS)
        ]
    kinked, count, outside = 0, 0, ""
    for name, direction in directions:
        grad = np.asarray(got[f"{name}_grad"]).astype(np.float64)
        try:
            forward, backward, _ = _differences(objective, feeds, name, direction, eps)
        except Kink:
            continue
        if abs(forward - backward) <= 10 * rtol * (abs(forward) + abs(backward)) + 1e-5:
            continue
        if _one_sided_diverge(objective, feeds, name, direction, precision, forward, backward):
            continue
        kinked += 1
        actual = float(np.sum(grad * direction))
        scale = abs(forward) + abs(backward) + abs(actual) + float(np.sum(np.abs(grad * direction)))
        low, high = min(forward, backward), max(forward, backward)
        if low - rtol * scale - 1e-5 <= actual <= high + rtol * scale + 1e-5:
            continue
        count += 1
        outside = outside or (
            f"along a random direction of {name!r} <gradient, direction> is {actual:.6g}, "
            f"outside the one-sided derivatives [{low:.6g}, {high:.6g}]"
        )
    return kinked, count, outside


def _one_sided_diverge(objective, feeds, name, e, precision, forward, backward) -> bool:
    """Whether a one-sided quotient changes with the step (a jump: it grows as 1/eps),
    rather than staying a one-sided derivative (a kink)."""
    coarse_forward, coarse_backward, _ = _differences(objective, feeds, name, e, 4 * precision.eps)
    tol = 10 * precision.rtol
    return any(
        abs(fine - coarse) > tol * (abs(fine) + abs(coarse)) + 1e-5
        for fine, coarse in ((forward, coarse_forward), (backward, coarse_backward))
    )


def _nearby_partials(objective, feeds, wrt, name, e, rng, eps, count=8, scale=1e-4):
    """Central partial derivatives along ``e`` at ``count`` random points within
    ``scale (1 + |x|)`` of the test point (those where the output shape changes are left
    out)."""
    partials = []
    for _ in range(count):
        moved = _jitter(feeds, wrt, rng, scale)
        try:
            partials.append(_differences(objective, moved, name, e, eps)[2])
        except Kink:
            continue
    return partials


def _jitter_keeping_shapes(oracle, feeds, wrt, rng, scale: float, shapes, tries: int = 20):
    """A jittered point (:func:`_jitter`) where the outputs keep ``shapes`` (sizes that
    depend on an input, as Upsample's on its scales), or ``feeds`` itself if 20 draws
    change them."""
    for _ in range(tries):
        jittered = _jitter(feeds, wrt, rng, scale)
        with contextlib.suppress(Exception):
            if [o.shape for o in oracle.run(jittered)] == shapes:
                return jittered
    return feeds


def _jitter(feeds, wrt, rng, scale: float):
    """The point moved by ``scale (1 + |x|)`` times Gaussian noise (the harness tries 1e-3,
    then 1e-2: near a singularity, as a zero row of x / ||x||, a small move leaves the
    difference quotients too curved to judge)."""
    jittered = dict(feeds)
    for name in wrt:
        value = feeds[name]
        noise = scale * (1 + np.abs(value)) * rng.standard_normal(value.shape)
        jittered[name] = (value + noise).astype(value.dtype)
    return jittered


def _short(exc: Exception, limit: int = 160) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}"


# -- the whole suite ---------------------------------------------------------------------------
def collect_cases(ops: set[str] | None = None):
    """``(name, model, inputs)`` of onnx's non-expanded node test cases."""
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        cases = collect_testcases(None)
    for case in cases:
        if case.kind != "node" or "_expanded" in case.name or not case.data_sets:
            continue
        if ops is not None and _main_op(case.model) not in ops:
            continue
        if not any(o.domain in ("", "ai.onnx") for o in case.model.opset_import):
            continue
        yield case.name, case.model, list(case.data_sets[0][0])


def run(
    ops: set[str] | None = None,
    progress=None,
    onnxruntime: bool = False,
    rounding: str = "straight_through",
) -> list[Outcome]:
    """The outcomes of onnx's cases of ``ops`` (all by default), gradients built with
    ``quantized_activations=rounding``."""
    outcomes = []
    for name, model, inputs in collect_cases(ops):
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            try:
                outcome = check_case(name, model, inputs, rounding=rounding)
                if onnxruntime and outcome.status in ("ok", "not confirmed"):
                    outcome.runtime = on_onnxruntime(model, inputs, outcome.inputs)
            except Exception as exc:  # a harness error must not hide the other cases
                outcome = Outcome(name, _main_op(model), _opset(model), "failed", _short(exc))
        outcomes.append(outcome)
        if progress is not None:
            progress(outcome)
    return outcomes


_VERB = {
    "agrees": "agree",
    "agrees, where the model itself does not run": "agree where the model itself does not run",
    "model not run": "whose model onnxruntime does not run",
    "model not run alike": "whose model onnxruntime computes otherwise",
}


def on_onnxruntime(model: ModelProto, inputs: list, wrt: list[str]) -> str:
    """Whether the gradient graph of the case as given (its own element types) runs on the
    installed onnxruntime and gives the reference evaluator's values there (rtol 1e-3, 1e-2
    for 16-bit floats): "agrees", or what differs, fails or cannot load. Where the model
    itself does not run there (an operator or element type the runtime lacks) or computes
    other outputs (random operators, runtimes that disagree), the gradient is not compared:
    "model not run" / "model not run alike"."""
    import onnxruntime

    arrays = [as_array(v) for v in inputs]
    feeds = {i.name: v for i, v in zip(model.graph.input, arrays)}
    rng = np.random.default_rng(1)
    try:
        gradient = onnx_derivative(model, weights=[], inputs=wrt, backend="onnx")
        outputs = Oracle(model, _ort_oracle(_main_op(model), _opset(model))).run(feeds)
        for info, value in zip(model.graph.output, outputs):
            feeds[f"{info.name}_grad"] = _seed(rng, value, info)
        expected = Oracle(gradient, False).run(feeds)
    except Exception as exc:
        return f"not checked: the case's precision does not build or run ({_short(exc, 80)})"
    forward_feeds = {i.name: feeds[i.name] for i in model.graph.input}
    try:
        forward = _ort_session(onnxruntime, model).run(None, forward_feeds)
    except Exception as exc:
        forward, problem = (
            None,
            f"model not run: the model itself does not run there ({_short(exc, 100)})",
        )
    if forward is not None and not _close(forward, outputs):
        return "model not run alike: its outputs already differ from the reference's"
    try:
        gradient_feeds = {i.name: feeds[i.name] for i in gradient.graph.input}
        got = _ort_session(onnxruntime, gradient).run(None, gradient_feeds)
    except Exception as exc:
        return problem if forward is None else f"fails: {_short(exc, 120)}"
    if not _close(got, expected):
        return problem if forward is None else "differs from the reference evaluator"
    return "agrees" if forward is not None else "agrees, where the model itself does not run"


def _ort_session(onnxruntime, model: ModelProto):
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4
    return onnxruntime.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _close(values: list, references: list) -> bool:
    """Equal within 1e-3 (1e-2 for 16-bit floats), NaN equal to NaN."""
    for value, reference in zip(values, references):
        value, reference = np.asarray(value), np.asarray(reference)
        tolerance = 1e-2 if value.dtype.itemsize == 2 and value.dtype.kind == "f" else 1e-3
        if value.dtype.kind not in "fc":
            if not np.array_equal(value, reference):
                return False
            continue
        value, reference = value.astype(np.float64), reference.astype(np.float64)
        if value.shape != reference.shape or not np.allclose(
            value, reference, rtol=tolerance, atol=tolerance, equal_nan=True
        ):
            return False
    return True


def family(op_type: str) -> str:
    from onnxgrad.derivative.autodiff.registry import registered_rules

    modules = {r.op_type: r.function.__module__.rsplit(".", 1)[-1] for r in registered_rules()}
    return modules.get(op_type) or FAMILY_OF.get(op_type, "other")


def summarize(outcomes: list[Outcome]) -> dict:
    """Counts per operator type, family and opset, and the totals (cases with a float
    derivative only)."""
    counted = [o for o in outcomes if o.status in STATUSES]
    by_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    by_family: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    by_opset: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for o in counted:
        by_op[o.op_type][o.status] += 1
        by_family[family(o.op_type)][o.status] += 1
        by_opset[o.opset][o.status] += 1
    total = collections.Counter(o.status for o in counted)
    return {"op": by_op, "family": by_family, "opset": by_opset, "total": total}


def _row(label: str, counts: collections.Counter) -> str:
    judged = sum(counts[s] for s in STATUSES if s != "skipped")
    share = f"{100 * counts['ok'] / judged:.0f}%" if judged else "-"
    cells = " | ".join(str(counts[s]) for s in STATUSES)
    return f"| {label} | {cells} | {share} |"


def _table(title: str, groups: dict) -> list[str]:
    lines = [f"| {title} | " + " | ".join(STATUSES) + " | ok share |"]
    lines.append("|" + "---|" * (len(STATUSES) + 2))
    lines += [_row(str(key), groups[key]) for key in sorted(groups)]
    return lines


def page(outcomes: list[Outcome], baseline: str | None = None) -> str:
    """``docs/coverage.md``: how it was measured, the tables, and the totals and families of
    an earlier run (``baseline``, a page this function wrote) for comparison."""
    import onnx as onnx_module

    from onnxgrad._runtime import import_onnxruntime

    versions = f"onnx {onnx_module.__version__}"
    with contextlib.suppress(Exception):
        versions += f", onnxruntime {import_onnxruntime().__version__}"
    lines = [
        "# Gradient coverage of the ONNX operators",
        "",
        "The native backend's gradients on onnx's own operator test cases, checked against "
        "float64 finite differences along random directions (" + versions + "). Regenerate "
        "with `python benchmarks/coverage_ops.py --onnxruntime --markdown docs/coverage.md` "
        "(about two minutes on one core; `--onnxruntime` also runs every ok or not "
        "confirmed gradient on "
        "onnxruntime); the method and the oracle are described in that script's docstring. "
        "`skipped` cases are not judged (random operators, element types numpy lacks, "
        "sequences and optionals, points where the function is not differentiable even "
        "jittered). Where a case's own data sit at a point without a derivative, the case is "
        "judged at a jittered point nearby and listed at the end with the evidence.",
        "",
    ]
    if baseline:
        lines += [
            "## Before",
            "",
            "(the page this one replaces)",
            "",
            *_baseline_summary(baseline),
            "",
            "## Now",
            "",
        ]
    return "\n".join(lines) + "\n" + markdown(outcomes)  # a blank line before the totals


def _baseline_summary(path: str) -> list[str]:
    text = Path(path).read_text().splitlines()
    if "## Now" in text:
        text = text[text.index("## Now") :]
    start = next(i for i, line in enumerate(text) if line.startswith("**Total**"))
    end = next(i for i, line in enumerate(text) if line.startswith("### Per opset"))
    return [line.replace("### ", "#### ") for line in text[start:end]]


def markdown(outcomes: list[Outcome], header: str = "") -> str:
    summary = summarize(outcomes)
    total = summary["total"]
    judged = sum(total[s] for s in STATUSES if s != "skipped")
    ops = summary["op"]
    full = sum(1 for c in ops.values() if c["ok"] and c["ok"] == sum(c.values()) - c["skipped"])
    partly = sum(1 for c in ops.values() if c["ok"])
    with_judged = sum(1 for c in ops.values() if sum(c.values()) > c["skipped"])
    kinks = sorted((o for o in outcomes if o.point), key=lambda o: o.case)
    lines = [header] if header else []
    lines += [
        f"**Total**: {total['ok']} of {judged} judged cases agree with float64 finite differences "
        f"({100 * total['ok'] / max(judged, 1):.1f}%); {total['not confirmed']} not confirmed "
        f"(agree at a jittered point, but at the case's own point without a derivative the "
        f"gradient is not confirmed as a generalized derivative), {total['wrong']} wrong, "
        f"{total['missing']} missing, {total['failed']} failed, {total['skipped']} skipped. "
        f"Operator types: {len(ops)}, {with_judged} with judged cases, of which {full} fully "
        f"covered and {partly} at least partly. "
        f"{len(kinks)} judged cases have test data where the function has no derivative "
        f"(listed below with the evidence; judged at a jittered point nearby and at the point "
        f"itself): {sum(o.status == 'not confirmed' for o in kinks)} not confirmed there, "
        f"{sum(o.status == 'wrong' and o.detail.startswith('at the test point') for o in kinks)} "
        f"wrong there (see the list).",
        "",
        "### Per family",
        "",
        *_table("family", summary["family"]),
        "",
        "### Per opset of the test model",
        "",
        *_table("opset", summary["opset"]),
        "",
        "### Per operator type",
        "",
        *_table("operator", ops),
        "",
        "### Cases not ok",
        "",
        "| case | status | detail |",
        "|---|---|---|",
    ]
    for o in sorted(outcomes, key=lambda o: (o.status, o.case)):
        if o.status in STATUSES and o.status != "ok":
            detail = o.detail.replace("|", "\\|")
            lines.append(f"| {o.case} | {o.status} | {detail} |")
    checked = [o for o in outcomes if o.runtime]
    if checked:
        import onnxruntime

        counts = collections.Counter(o.runtime.split(":")[0] for o in checked)
        compared = sum(
            counts[k] for k in ("agrees", "differs from the reference evaluator", "fails")
        )
        lines += [
            "",
            f"### On onnxruntime {onnxruntime.__version__}",
            "",
            f"The gradient graphs of the {len(checked)} ok and not confirmed cases, in each "
            f"case's own element "
            f"types, run on onnxruntime (CPU) and compared with the reference evaluator where "
            f"onnxruntime runs the model itself alike ({compared} cases), and where it does not "
            f"run it, when the gradient runs: "
            + ", ".join(f"{n} {_VERB.get(k, k)}" for k, n in sorted(counts.items()))
            + ".",
            "",
            "| case | on onnxruntime |",
            "|---|---|",
            *(
                f"| {o.case} | {o.runtime.replace('|', chr(92) + '|')} |"
                for o in sorted(checked, key=lambda o: o.case)
                if o.runtime != "agrees"
            ),
        ]
    lines += [
        "",
        "### Test points without a derivative",
        "",
        "The function has no derivative at the case's own data. The evidence comes from "
        "the objective alone: along a direction the one-sided difference quotients disagree "
        "(a kink), or the central quotients at steps eps and 4 eps disagree (a jump or an "
        "infinite slope). The harness looks for it along its random directions and, before "
        "any 'wrong' verdict, along the failing direction and every coordinate (64 at "
        "most), so a case is 'wrong' only where the function shows a derivative. At such a "
        "point there is no derivative to compare with: the case is judged at a jittered point "
        "nearby, and the gradient at the point itself is compared with what finite "
        "differences tell of the generalized derivative there, coordinate by coordinate: "
        "equal to the partial derivative where one exists; at a kink equal to a one-sided "
        "partial derivative or between the two (a subgradient along that axis, as "
        "ReLU'(0) = 0); else within the range of the partial derivatives at 8 random points "
        "within 1e-4 (1 + |x|) (a sampled Clarke generalized gradient, for axes where several "
        "kinks meet, as ties of a max or bilinear samples on the pixel grid, whose chain rule "
        "combines slopes of different sides); at a jump any value is a convention. It is "
        "also compared along random directions v with a kink (the one that showed it and 8 "
        "more per input), with the absolute values of the output gradients (a max of the "
        "outputs, as Relu, MaxPool or ReduceMax, then stays convex): <gradient, v> between "
        "the one-sided derivatives along v, where every generalized gradient of a function "
        "convex or concave near the point lies. "
        "The 'status' column: 'wrong' where a coordinate with a two-sided partial "
        "derivative disagrees with it and with all those sampled nearby (where a jittered "
        "point can be judged at all: else the quotients nearby are not trusted), or where the "
        "jittered point is wrong; 'not confirmed' where a coordinate at a kink is outside "
        "its range or <gradient, v> is outside the one-sided derivatives along a direction "
        "(the sampled range may miss part of the generalized gradient, and a function "
        "neither convex nor concave, as |x1| - |x2| at 0 along (1, 1), can have a "
        "generalized gradient outside them); else the jittered point's verdict.",
        "",
        "| case | status | evidence and checks |",
        "|---|---|---|",
        *(f"| {o.case} | {o.status} | {o.point.replace('|', chr(92) + '|')} |" for o in kinks),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", help="comma-separated operator types (default: all)")
    parser.add_argument("--markdown", help="write the tables to this Markdown file")
    parser.add_argument("--baseline", help="an earlier page, whose totals are shown first")
    parser.add_argument("--verbose", action="store_true", help="print every case")
    parser.add_argument(
        "--onnxruntime",
        action="store_true",
        help="also run the gradient graph of every ok (or not confirmed) case on onnxruntime",
    )
    parser.add_argument(
        "--quantized-activations",
        default="straight_through",
        choices=("straight_through", "exact"),
        help="how rounded activations are differentiated (onnx_derivative's option)",
    )
    args = parser.parse_args(argv)
    ops = set(args.ops.split(",")) if args.ops else None
    start = time.perf_counter()

    def progress(o: Outcome) -> None:
        if args.verbose or o.status not in ("ok", "no float derivative", "skipped"):
            print(f"{o.status:8} {o.case} {o.detail}", flush=True)

    outcomes = run(ops, progress, args.onnxruntime, args.quantized_activations)
    text = markdown(outcomes)
    print(text)
    print(f"{len(outcomes)} cases in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if args.markdown:
        Path(args.markdown).write_text(page(outcomes, args.baseline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
