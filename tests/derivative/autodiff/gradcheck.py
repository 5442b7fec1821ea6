"""Gradient checks of single ops (or tiny graphs) against central finite differences.

A case describes one node; :func:`check_case` builds the model, asks the native engine
for the gradient graph (``DerivativeOptions.Zero`` with random output gradients ``g``),
and compares it, evaluated by ``onnx.reference.ReferenceEvaluator`` in float64 (or
onnxruntime where the reference departs from the spec), with
``(f(x + eps e_j) - f(x - eps e_j)) / (2 eps)`` where ``f = sum_k <y_k, g_k>``.
The same case in float32 also runs through onnxruntime, to prove the emitted graph loads
and computes the same values there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import onnx
import onnxruntime
from onnx import ModelProto, TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import onnx_derivative
from tests.derivative.reference_conv import CONV_OPS

FLOATS = (np.float16, np.float32, np.float64)


@dataclass
class OpCase:
    """One parametrised entry of the rule table.

    ``inputs`` maps the node's input names to values, in order; ``None`` leaves that optional
    input out. Float inputs become graph inputs (differentiated unless ``wrt`` says
    otherwise); the others become initializers. ``graph`` replaces the single node by a
    function ``(inputs names, output names) -> list of nodes`` for multi-node cases.
    """

    op_type: str
    inputs: dict[str, np.ndarray | None]
    attrs: dict = field(default_factory=dict)
    opset: int = 18
    wrt: tuple[str, ...] | None = None
    constants: tuple[str, ...] = ()
    n_outputs: int = 1
    rtol: float = 1e-5
    atol: float = 1e-6
    eps: float = 1e-6
    id: str = ""
    domain: str = ""
    graph: Callable[[list[str], list[str]], list[onnx.NodeProto]] | None = None
    check_ort: bool = True
    #: also run with unknown input shapes (not below opset 13 for broadcasting ops: undoing
    #: an unknown broadcast needs ReduceSum's axes input)
    dynamic_shapes: bool = True
    #: the float64 oracle: ``"reference"`` (onnx's ReferenceEvaluator), ``"onnxruntime"``
    #: where the reference evaluator departs from the spec (Softmax before opset 13), or a
    #: callable ``model -> session``
    evaluator: str | Callable = "reference"
    ort_rtol: float = 2e-3
    ort_atol: float = 2e-3
    #: non-float inputs fed at run time as graph inputs (the others are initializers,
    #: constants to the rules), as an axis known at run time only
    fed: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.id:
            self.id = self.op_type

    @property
    def differentiated(self) -> list[str]:
        if self.wrt is not None:
            return list(self.wrt)
        return [
            n
            for n, v in self.inputs.items()
            if v is not None and n not in self.constants and v.dtype.type in FLOATS
        ]


def case_model(case: OpCase, dtype=np.float64, dynamic: bool = False) -> tuple[ModelProto, dict]:
    """The model of a case and its feeds, float inputs cast to ``dtype``.

    With ``dynamic=True`` every graph input has unknown dims (exercises dynamic shapes).
    """
    feeds, graph_inputs, initializers, node_inputs = {}, [], [], []
    for name, value in case.inputs.items():
        if value is None:
            node_inputs.append("")
            continue
        node_inputs.append(name)
        is_float = value.dtype.type in FLOATS
        value = value.astype(dtype) if is_float else value
        if (is_float and name not in case.constants) or name in case.fed:
            feeds[name] = value
            dims = [None] * value.ndim if dynamic else list(value.shape)
            elem = helper.np_dtype_to_tensor_dtype(value.dtype)
            graph_inputs.append(helper.make_tensor_value_info(name, elem, dims))
        else:
            initializers.append(numpy_helper.from_array(value, name=name))
    outputs = [f"y{k}" for k in range(case.n_outputs)]
    if case.graph is not None:
        nodes = case.graph(node_inputs, outputs)
    else:
        node = helper.make_node(
            case.op_type, node_inputs, outputs, domain=case.domain, **case.attrs
        )
        nodes = [node]
    out_infos = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outputs]
    graph = helper.make_graph(nodes, "case", graph_inputs, out_infos, initializers)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", case.opset)], ir_version=9
    )
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    types = {o.name: o.type for o in inferred.graph.output}
    for out in model.graph.output:
        out.type.CopyFrom(types[out.name])
    for node, typed in zip(model.graph.node, inferred.graph.node):
        node.CopyFrom(typed)  # subgraph (Scan/Loop body) inputs typed for onnxruntime
    onnx.checker.check_model(model, full_check=True)
    return model, feeds


def _weighted_sum(outputs: list[np.ndarray], weights: list[np.ndarray]) -> float:
    return float(sum(np.sum(o.astype(np.float64) * w) for o, w in zip(outputs, weights)))


def evaluator(model: ModelProto, kind: str = "reference"):
    """A session with ``run(None, feeds)``: onnx's reference evaluator, onnxruntime, or
    ``kind(model)`` for a callable."""
    if callable(kind):
        return kind(model)
    if kind == "reference":
        return ReferenceEvaluator(model, new_ops=CONV_OPS)
    options = onnxruntime.SessionOptions()
    # the extended fusions (FusedMatMul...) have float32 kernels only
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return onnxruntime.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def finite_differences(
    model: ModelProto,
    feeds: dict,
    name: str,
    out_grads: list[np.ndarray],
    eps: float,
    kind: str = "reference",
) -> np.ndarray:
    """Central differences of ``sum_k <y_k, g_k>`` with respect to input ``name``."""
    session = evaluator(model, kind)
    base = feeds[name]
    grad = np.zeros(base.shape, dtype=np.float64)
    for j in np.ndindex(base.shape):
        values = []
        for sign in (1.0, -1.0):
            shifted = base.copy()
            shifted[j] += sign * eps
            outputs = session.run(None, {**feeds, name: shifted})
            values.append(_weighted_sum(outputs, out_grads))
        grad[j] = (values[0] - values[1]) / (2 * eps)
    return grad


def gradient_feeds(case: OpCase, model: ModelProto, feeds: dict, seed: int = 0):
    """Random output gradients shaped like the outputs."""
    outputs = evaluator(model, case.evaluator).run(None, feeds)
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(np.shape(o)).astype(np.asarray(o).dtype) for o in outputs]


def check_case(case: OpCase, dynamic: bool = False) -> None:
    """Assert the native gradient of ``case`` equals finite differences (and runs in ORT)."""
    model, feeds = case_model(case, np.float64, dynamic)
    wrt = case.differentiated
    grad_model = onnx_derivative(model, weights=[], inputs=wrt, backend="onnx")
    assert {n.domain for n in grad_model.graph.node} <= {""}, "non-standard op emitted"
    out_grads = gradient_feeds(case, model, feeds)
    grad_feeds = {**feeds, **{f"y{k}_grad": g for k, g in enumerate(out_grads)}}
    got = dict(
        zip(
            [o.name for o in grad_model.graph.output],
            evaluator(grad_model, case.evaluator).run(None, grad_feeds),
        )
    )
    for name in wrt:
        expected = finite_differences(model, feeds, name, out_grads, case.eps, case.evaluator)
        np.testing.assert_allclose(
            got[f"{name}_grad"], expected, rtol=case.rtol, atol=case.atol,
            err_msg=f"{case.id}: gradient of {name!r} (dynamic={dynamic})",
        )  # fmt: skip
        assert got[f"{name}_grad"].shape == feeds[name].shape
    if case.check_ort and case.opset <= ort_opset():
        _check_ort(case, dynamic, got)


@functools.cache
def ort_opset() -> int:
    """The newest default-domain opset the installed onnxruntime loads (cases above it are
    checked by the reference evaluator only)."""
    supported = 0
    for opset in range(onnx.defs.onnx_opset_version(), 0, -1):
        node = helper.make_node("Identity", ["x"], ["y"])
        info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in "xy"]
        graph = helper.make_graph([node], "probe", info[:1], info[1:])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 8
        try:
            onnxruntime.InferenceSession(
                model.SerializeToString(), providers=["CPUExecutionProvider"]
            )
        except Exception:  # any refusal: the opset is too new
            continue
        supported = opset
        break
    return supported


def _check_ort(case: OpCase, dynamic: bool, reference: dict) -> None:
    """The float32 gradient graph runs in onnxruntime and agrees with the float64 one."""
    model, feeds = case_model(case, np.float32, dynamic)
    grad_model = onnx_derivative(model, weights=[], inputs=case.differentiated, backend="onnx")
    out_grads = [
        g.astype(np.float32) if g.dtype == np.float64 else g
        for g in gradient_feeds(case, model, feeds)
    ]
    grad_feeds = {**feeds, **{f"y{k}_grad": g for k, g in enumerate(out_grads)}}
    session = onnxruntime.InferenceSession(
        grad_model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in grad_model.graph.output]
    for name, value in zip(names, session.run(None, grad_feeds)):
        np.testing.assert_allclose(
            value, reference[name], rtol=case.ort_rtol, atol=case.ort_atol,
            err_msg=f"{case.id}: onnxruntime float32 gradient of {name!r}",
        )  # fmt: skip


def second_order(case: OpCase, **changes) -> OpCase:
    """The case whose graph is the native gradient graph of ``case``.

    Its inputs are those of ``case`` plus the output gradients (``z_grad``, or ``z<k>_grad``
    for several outputs; integer outputs get zero gradients, as constants), its outputs the
    gradients; checking it against finite differences checks the second derivatives
    (Hessian-vector products), and that every op the rule emits has a rule itself. The
    gradient graph is built once in float64, so onnxruntime's float32 run is skipped. Its
    opset is the gradient's (a model below opset 13 is raised to it by normalisation).
    """
    model, feeds = case_model(case, np.float64)
    names = ["z"] if case.n_outputs == 1 else [f"z{k}" for k in range(case.n_outputs)]
    for k, name in enumerate(names):
        _rename_value(model, f"y{k}", name)
    wrt = case.differentiated
    gradient = onnx_derivative(model, weights=[], inputs=wrt, backend="onnx")
    outputs = evaluator(model, case.evaluator).run(None, feeds)
    rng = np.random.default_rng(7)
    seeds = {
        f"{name}_grad": rng.standard_normal(np.shape(value))
        if np.asarray(value).dtype.type in FLOATS
        else np.zeros(np.shape(value), np.asarray(value).dtype)
        for name, value in zip(names, outputs)
    }
    float_seeds = tuple(n for n, v in seeds.items() if v.dtype.type in FLOATS)

    def graph(inputs, outputs):
        ends = [helper.make_node("Identity", [f"{x}_grad"], [y]) for x, y in zip(wrt, outputs)]
        return [*gradient.graph.node, *ends]

    return replace(
        case,
        inputs={**case.inputs, **seeds},
        wrt=None if case.wrt is None else (*case.wrt, *float_seeds),
        n_outputs=len(wrt),
        graph=graph,
        check_ort=False,
        opset=next(o.version for o in gradient.opset_import if o.domain in ("", "ai.onnx")),
        id=f"{case.id}-second-order",
        **changes,
    )


def _rename_value(model, old: str, new: str) -> None:
    for node in model.graph.node:
        node.output[:] = [new if o == old else o for o in node.output]
    for output in model.graph.output:
        if output.name == old:
            output.name = new


def squared_norm_loss(model: ModelProto) -> ModelProto:
    """``loss = sum_k |y_k|^2`` over the float outputs of ``model``, in float64, under names
    the model does not use (a case's graph may name a value ``loss``)."""
    floats = [
        o.name
        for o in model.graph.output
        if o.type.tensor_type.elem_type in (TensorProto.FLOAT, TensorProto.DOUBLE)
    ]
    taken = {v for node in model.graph.node for v in [*node.input, *node.output]}
    taken |= {v.name for v in [*model.graph.input, *model.graph.initializer]}

    def fresh(name: str) -> str:
        while name in taken:
            name = f"_{name}"
        taken.add(name)
        return name

    nodes, squares = [], []
    for name in floats:
        square, square64 = fresh(f"{name}_sq"), fresh(f"{name}_sq64")
        nodes.append(helper.make_node("ReduceSumSquare", [name], [square], keepdims=0))
        nodes.append(helper.make_node("Cast", [square], [square64], to=11))
        squares.append(square64)
    loss = fresh("loss")
    nodes.append(helper.make_node("Sum", squares, [loss]))
    graph = helper.make_graph(
        [*model.graph.node, *nodes],
        "loss",
        list(model.graph.input),
        [helper.make_tensor_value_info(loss, TensorProto.DOUBLE, [])],
        list(model.graph.initializer),
    )
    return helper.make_model(graph, opset_imports=list(model.opset_import))


def check_hvp(case: OpCase, kind=None, eps=None, rtol=1e-4, atol=1e-5, seed=3) -> None:
    """``onnx_hvp`` (forward-over-reverse) of :func:`squared_norm_loss` equals the central
    difference of the reverse gradient along the tangent, run by ``kind`` (the case's
    oracle by default); ``atol`` scales with the largest expected value."""
    from onnxgrad import DerivativeOptions, onnx_hvp

    kind = kind or case.evaluator
    eps = eps or case.eps
    model, feeds = case_model(case, np.float64)
    model = squared_norm_loss(model)
    wrt = case.differentiated
    hvp_model = onnx_hvp(model, inputs=wrt)
    assert {n.domain for n in hvp_model.graph.node} <= {""}, "non-standard op emitted"
    rng = np.random.default_rng(seed)
    direction = {n: np.asarray(rng.standard_normal(np.shape(feeds[n]))) for n in wrt}
    tangents = {f"{n}_tangent": v for n, v in direction.items()}
    names = [o.name for o in hvp_model.graph.output]
    hvp = dict(zip(names, evaluator(hvp_model, kind).run(None, {**feeds, **tangents})))
    gradient = onnx_derivative(model, weights=[], inputs=wrt, options=DerivativeOptions.Loss)
    session = evaluator(gradient, kind)
    grad_names = [o.name for o in gradient.graph.output]

    def grads(sign):
        moved = {n: np.asarray(feeds[n] + sign * eps * v) for n, v in direction.items()}
        return dict(zip(grad_names, session.run(None, {**feeds, **moved})))

    plus, minus = grads(1.0), grads(-1.0)
    for n in wrt:
        expected = (plus[f"{n}_grad"] - minus[f"{n}_grad"]) / (2 * eps)
        scale = max(1.0, float(np.max(np.abs(expected))))
        np.testing.assert_allclose(
            hvp[f"{n}_grad_tangent"], expected, rtol=rtol, atol=atol * scale,
            err_msg=f"{case.id}: {n}",
        )  # fmt: skip
