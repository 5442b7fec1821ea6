"""The ``ops`` sweep of :mod:`benchmarks.coverage_modes`: ``onnx_jvp`` (and ``onnx_hvp``) on
onnx's own operator test cases, wherever the reverse mode is judged ``ok`` there.

Each case is first judged by :func:`benchmarks.coverage_ops.check_case` (the reverse
gradient against float64 finite differences). Where it is ``ok``, the same float64 model
(or the case's own precision, where the reverse sweep fell back to it), the same oracle,
inputs, step and tolerance serve for the forward modes, along a random tangent ``v`` of all
differentiated inputs together:

    JVP:  y_tangent  ==  (y(x + eps v) - y(x - eps v)) / (2 eps)          per output entry
    HVP:  H v        ==  (G(x + eps v) - G(x - eps v)) / (2 eps)          per input entry

with ``G(x) = J(x)^T g`` the reverse gradient (checked against the outputs' differences by
the reverse sweep) for fixed random output gradients ``g``, and ``H`` the Hessian of the
loss ``sum_k <y_k, g_k>`` given to ``onnx_hvp``. Entry ``i`` agrees when
``|a_i - e_i| <= rtol (|a_i| + |e_i| + max|a| + max|e|) + 1e-6`` (or within the quotients'
rounding error, ``30 u max|y| / eps`` for outputs of unit roundoff ``u``: negligible in
float64, not where a case runs in its own float32). Where the one-sided
quotients along ``v`` disagree (a kink, as ties of a max) or the central quotients at steps
``eps`` and ``4 eps`` do (a jump), the point has no derivative along ``v``: the case is judged
at a jittered point nearby (1e-3 (1 + |x|), then 1e-2), as the reverse sweep does, and is
``not judged`` if none is differentiable.
"""

from __future__ import annotations

import numpy as np
from onnx import ModelProto, TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from benchmarks._float64_gradients import float64_gradient
from benchmarks.coverage_ops import (
    FLOATS,
    Oracle,
    Precision,
    _as_double,
    _jitter_keeping_shapes,
    _main_op,
    _opset,
    _ort_oracle,
    _seed,
    as_array,
    check_case,
    to_double,
)
from onnxgrad import onnx_derivative, onnx_hvp, onnx_jvp

ATOL = 1e-6
#: rounding error of a difference quotient, in units of the outputs' precision times max |y|
#: over the step (float32 outputs, where the float64 model does not run)
ROUNDING = 30


class NoDerivative(Exception):
    """No derivative along the tangent at the point (kink, jump, shape or finiteness change)."""


def check_ops_case(name: str, model: ModelProto, inputs: list, modes: set[str]) -> list:
    """``[(mode, status, detail)]`` for one onnx case: ``ok``, ``wrong``, ``failed``
    (error named) or ``not judged`` (with the reason: the reverse verdict, no oracle, no
    derivative even jittered)."""
    reverse = check_case(name, model, inputs)
    if reverse.status != "ok":
        why = f"reverse mode {reverse.status}"
        if reverse.status not in ("no float derivative",):
            why += f": {reverse.detail}"[:160]
        return [(mode, "not judged", why) for mode in sorted(modes)]
    double = not reverse.detail.startswith("in the case's precision")
    op_type, opset = _main_op(model), _opset(model)
    arrays = [as_array(v) for v in inputs]
    if double:
        model = to_double(model)
        arrays = [_as_double(v) for v in arrays]
    feeds = {i.name: v for i, v in zip(model.graph.input, arrays)}
    wrt = reverse.inputs
    oracle = Oracle(model, _ort_oracle(op_type, opset))
    use_ort = not isinstance(oracle.session, ReferenceEvaluator)
    precision = Precision.of(model, wrt)
    results = []
    for mode in sorted(modes):
        check = _check_jvp if mode == "jvp" else _check_hvp
        try:
            status, detail = check(model, feeds, wrt, oracle, use_ort, precision)
        except Exception as exc:  # named: which step raised what
            status, detail = "failed", _short(exc)
        if not double:
            detail = f"in the case's precision: {detail}"
        results.append((mode, status, detail))
    return results


def _check_jvp(model, feeds, wrt, oracle, use_ort, precision) -> tuple[str, str]:
    try:
        jvp = onnx_jvp(model, inputs=wrt)
    except Exception as exc:
        return "failed", f"build: {_short(exc)}"
    floats = [o.name for o in model.graph.output if o.type.tensor_type.elem_type in FLOATS]
    positions = [k for k, o in enumerate(model.graph.output) if o.name in floats]
    try:
        built = Oracle(jvp, use_ort)
    except Exception as exc:
        return "failed", f"load: {_short(exc)}"
    tangent_names = [f"{n}_tangent" for n in floats]
    outputs = [o.name for o in jvp.graph.output]

    def values(point):
        results = oracle.run(point)
        return [results[k] for k in positions]

    def derivative(point, tangents):
        given = {f"{n}_tangent": t.astype(point[n].dtype) for n, t in tangents.items()}
        got = dict(zip(outputs, built.run({**point, **given})))
        return [got[n] for n in tangent_names]

    return _along_tangent(values, derivative, feeds, wrt, oracle, precision, floats)


def _check_hvp(model, feeds, wrt, oracle, use_ort, precision) -> tuple[str, str]:
    """``ok (zero)`` where the HVP is 0 at the judged point and agrees (linear and
    piecewise-linear operators: their gradient depends on the inputs through comparisons
    only, or not at all). The differences are those of the reverse gradient, or of a numpy
    float64 one where the operator's function body rounds to float32
    (:mod:`benchmarks._float64_gradients`)."""
    rng = np.random.default_rng(3)
    outputs = oracle.run(feeds)
    seeds = [_seed(rng, out, info) for out, info in zip(outputs, model.graph.output)]
    try:
        gradient = onnx_derivative(model, weights=[], inputs=wrt, backend="onnx")
        hvp = onnx_hvp(_weighted_loss(model, seeds), inputs=wrt, loss="_loss")
    except Exception as exc:
        return "failed", f"build: {_short(exc)}"
    try:
        reverse, built = Oracle(gradient, use_ort), Oracle(hvp, use_ort)
    except Exception as exc:
        return "failed", f"load: {_short(exc)}"
    seed_feeds = {
        f"{o.name}_grad": s.astype(out.dtype)
        for o, s, out in zip(model.graph.output, seeds, outputs)
    }
    hvp_names = [o.name for o in hvp.graph.output]
    grad_names = [o.name for o in gradient.graph.output]
    zero = [False]  # whether the last HVP computed was 0

    in_float64 = float64_gradient(model)

    def values(point):
        if in_float64 is not None:  # the function body's float32 statistics left out
            got = in_float64(point, seeds)
            return [got[n] for n in wrt]
        got = dict(zip(grad_names, reverse.run({**point, **seed_feeds})))
        return [got[f"{n}_grad"] for n in wrt]

    def derivative(point, tangents):
        given = {f"{n}_tangent": t.astype(point[n].dtype) for n, t in tangents.items()}
        got = dict(zip(hvp_names, built.run({**point, **given})))
        result = [got[f"{n}_grad_tangent"] for n in wrt]
        zero[0] = not any(np.any(r) for r in result)
        return result

    labels = [f"{n}_grad" for n in wrt]
    status, detail = _along_tangent(values, derivative, feeds, wrt, oracle, precision, labels)
    if status == "ok" and zero[0]:
        return "ok (zero)", "the HVP is 0, and so are the differences of the gradient"
    return status, detail


def _weighted_loss(model: ModelProto, seeds: list) -> ModelProto:
    """``model`` with the scalar ``_loss = sum_k <y_k, g_k>`` as its only output, computed in
    float64 (each ``y_k`` cast first: LayerNormalization's statistics stay float32), every
    added value declared (shape inference may not type a function's outputs)."""
    result = ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    terms = []
    for k, (out, seed) in enumerate(zip(model.graph.output, seeds)):
        if out.type.tensor_type.elem_type not in FLOATS:
            continue
        names = [f"_loss_{part}{k}" for part in "cms"]
        weight = numpy_helper.from_array(seed.astype(np.float64), f"_loss_g{k}")
        graph.initializer.append(weight)
        graph.node.extend([
            helper.make_node("Cast", [out.name], [names[0]], to=TensorProto.DOUBLE),
            helper.make_node("Mul", [names[0], weight.name], [names[1]]),
            helper.make_node("ReduceSum", [names[1]], [names[2]], keepdims=0),
        ])  # fmt: skip
        graph.value_info.extend([
            helper.make_tensor_value_info(names[0], TensorProto.DOUBLE, seed.shape),
            helper.make_tensor_value_info(names[1], TensorProto.DOUBLE, seed.shape),
            helper.make_tensor_value_info(names[2], TensorProto.DOUBLE, []),
        ])  # fmt: skip
        terms.append(names[2])
    graph.node.append(helper.make_node("Sum", terms, ["_loss"]))
    graph.value_info.extend(graph.output)  # the former outputs keep their declared types
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("_loss", TensorProto.DOUBLE, []))
    return result


def _along_tangent(values, derivative, feeds, wrt, oracle, precision, labels) -> tuple[str, str]:
    """Compare ``derivative(point, v)`` with central differences of ``values`` along a random
    tangent ``v``, at the point or, without a derivative there, at a jittered point."""
    rng = np.random.default_rng(0)
    original = [o.shape for o in oracle.run(feeds)]
    point, why = feeds, ""
    for attempt in range(3):
        tangents = {n: rng.standard_normal(point[n].shape) for n in wrt}
        try:
            got = derivative(point, tangents)
        except Exception as exc:
            return "failed", f"run: {_short(exc)}"
        try:
            verdict = _compare(values, got, point, tangents, precision, labels)
            prefix = f"judged at a jittered point ({why}): " if why else ""
            return verdict[0], prefix + verdict[1]
        except NoDerivative as exc:
            why = why or str(exc)
            point = _jitter_keeping_shapes(oracle, feeds, wrt, rng, 1e-3 * 10**attempt, original)
    return "not judged", f"no derivative along the tangent, even jittered ({why})"


def _compare(values, got, point, tangents, precision, labels) -> tuple[str, str]:
    eps, rtol = precision.eps, precision.rtol
    f0, plus, minus = (values(_moved(point, tangents, s * eps)) for s in (0, 1, -1))
    for label, a, y0, yp, ym in zip(labels, got, f0, plus, minus):
        if not (y0.shape == yp.shape == ym.shape):
            raise NoDerivative(f"the shape of {label} changes")
        unit = np.finfo(y0.dtype).eps if np.asarray(y0).dtype.kind == "f" else 0.0
        y0, yp, ym = (np.asarray(y, np.float64) for y in (y0, yp, ym))
        # the quotients' rounding error: negligible in float64, not in the case's float32
        noise = ROUNDING * unit * float(np.max(np.abs(y0), initial=0)) / eps
        if not all(np.all(np.isfinite(y)) for y in (y0, yp, ym)):
            raise NoDerivative(f"{label} is not finite")
        a = np.asarray(a, np.float64)
        if a.shape != y0.shape:
            return "wrong", f"tangent of {label} has shape {a.shape}, not {y0.shape}"
        if np.any(np.isnan(a)):
            return "wrong", f"tangent of {label} has NaN values"
        forward, backward, central = (yp - y0) / eps, (y0 - ym) / eps, (yp - ym) / (2 * eps)
        split = _differ(forward, backward, 10 * rtol, noise + 1e-5)
        k = labels.index(label)
        if split.any() and not _curvature(values, point, tangents, eps, k, y0, split, noise):
            raise NoDerivative(f"one-sided differences of {label} disagree along the tangent")
        bad = _outside(a, central, rtol) & (np.abs(a - central) > noise)
        if not bad.any():
            continue
        coarse = _central(values, point, tangents, 4 * eps, labels.index(label))
        if np.any(_differ(central, coarse, 10 * rtol, noise + 1e-5)):
            raise NoDerivative(f"the central differences of {label} do not converge")
        i = tuple(int(j) for j in np.argwhere(bad)[0])
        return "wrong", (
            f"{int(bad.sum())} of {bad.size} entries of the tangent of {label} differ, first "
            f"{label}{list(i)}: {a[i]:.6g}, finite differences {central[i]:.6g}"
        )
    return "ok", ""


def _curvature(values, point, tangents, eps, k, y0, split, noise) -> bool:
    """Whether one-sided quotients that disagree (the entries ``split``) do so by the
    curvature term only: along the tangent, ``forward - backward = eps f'' + O(eps^2)``, a
    quarter of it at step ``eps / 4``, where a kink at the point keeps the jump of ``f'``
    at any step (an entry whose ``f'`` is small beside its ``f''``, as one of LpPool's
    98304 gradient entries, 1.8e-4 beside 11)."""
    gaps = [_one_sided_gap(values, point, tangents, step, k, y0) for step in (eps, eps / 4)]
    return bool(np.all(np.abs(gaps[1][split]) <= 0.5 * np.abs(gaps[0][split]) + 4 * noise))


def _one_sided_gap(values, point, tangents, step, k, y0) -> np.ndarray:
    """``forward - backward`` quotients of output ``k`` at ``step`` (``y0``: at the point)."""
    plus = np.asarray(values(_moved(point, tangents, step))[k], np.float64)
    minus = np.asarray(values(_moved(point, tangents, -step))[k], np.float64)
    return (plus - 2 * y0 + minus) / step


def _differ(a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> np.ndarray:
    return np.abs(a - b) > rtol * (np.abs(a) + np.abs(b)) + atol


def _outside(actual: np.ndarray, expected: np.ndarray, rtol: float) -> np.ndarray:
    floor = float(np.max(np.abs(actual), initial=0) + np.max(np.abs(expected), initial=0))
    return np.abs(actual - expected) > rtol * (np.abs(actual) + np.abs(expected) + floor) + ATOL


def _central(values, point, tangents, eps, k) -> np.ndarray:
    plus = np.asarray(values(_moved(point, tangents, eps))[k], np.float64)
    minus = np.asarray(values(_moved(point, tangents, -eps))[k], np.float64)
    return (plus - minus) / (2 * eps)


def _moved(point: dict, tangents: dict, step: float) -> dict:
    return {
        **point,
        **{n: (point[n] + step * t).astype(point[n].dtype) for n, t in tangents.items()},
    }


def _short(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}"


# -- the sweep ---------------------------------------------------------------------------------
_CASES: list = []
LIMIT_S = 180


def _one(index: int) -> list[tuple[str, str, str, str]]:
    """``[(case, mode, status, detail)]`` of case ``index`` under a time limit."""
    import signal
    import warnings

    name, model, inputs = _CASES[index]

    def expired(signum, frame):
        raise TimeoutError(f"over {LIMIT_S} s")

    signal.signal(signal.SIGALRM, expired)
    signal.alarm(LIMIT_S)
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            results = check_ops_case(name, model, inputs, _one.modes)
    except Exception as exc:  # a harness error (or the limit) must not hide the other cases
        results = [(mode, "failed", _short(exc)) for mode in sorted(_one.modes)]
    finally:
        signal.alarm(0)
    return [(name, *r) for r in results]


def _first_judged(indices: list[int]) -> list[tuple[str, str, str, str]]:
    """The results of the first of ``indices`` (one operator's cases) that the reverse mode
    judges ok, or of the last one."""
    results = []
    for index in indices:
        results = _one(index)
        if not all(r[3].startswith("reverse mode") for r in results):
            break
    return results


def ops_results(ops: set[str] | None, modes: set[str], jobs: int = 1, first_only: bool = False):
    """Yields ``(case, mode, status, detail)`` for onnx's cases of ``ops`` (all by default;
    ``first_only``: per operator type, the first case the reverse mode judges ok), in ``jobs``
    processes."""
    import multiprocessing

    from benchmarks.coverage_ops import collect_cases

    _CASES[:] = list(collect_cases(ops))
    _one.modes = modes
    groups: dict[str, list[int]] = {}
    for index, (_, model, _) in enumerate(_CASES):
        groups.setdefault(_main_op(model), []).append(index)
    units = list(groups.values()) if first_only else [[i] for i in range(len(_CASES))]
    work = _first_judged if first_only else _all_of
    if jobs <= 1:
        for unit in units:
            yield from work(unit)
        return
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        for results in pool.imap_unordered(work, units):
            yield from results


def _all_of(indices: list[int]) -> list[tuple[str, str, str, str]]:
    return [r for index in indices for r in _one(index)]
