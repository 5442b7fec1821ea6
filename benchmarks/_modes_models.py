"""The ``models`` sweep of :mod:`benchmarks.coverage_modes`: ``onnx_jvp`` and ``onnx_hvp`` on
the shipped models of tests/realmodels and the exports of tests/architectures.py, against
central differences in float64 (onnx's reference evaluator, tests/realmodels/reference.py):
of the model's outputs for the JVP, of the reverse gradient of ``sum |y|^2`` for the HVP.
Steps move every entry by ``STEP`` of its root-mean-square (ReLU kinks lie close)."""

from __future__ import annotations

import functools

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxgrad import DerivativeOptions, onnx_derivative, onnx_hvp, onnx_jvp
from onnxgrad.graph.initializers import get_train_initializer
from tests.realmodels.reference import Reference
from tests.realmodels.test_shipped_models import _direction, _session, _unrounded

STEP = 1e-7
RTOL = 2e-3
#: weights differentiated where a model has no float input (a few: HVP graphs stay small)
WEIGHTS = 3


def _close(got, expected, what: str) -> None:
    scale = float(np.abs(expected).max()) + 1e-8
    error = float(np.abs(np.asarray(got, np.float64) - expected).max())
    assert error <= RTOL * scale, f"{what}: max error {error:.3g}, scale {scale:.3g}"


def sample_weights(model: onnx.ModelProto, count: int = WEIGHTS) -> dict[str, np.ndarray]:
    """The first, middle and last trainable weights (float32) and their values."""
    trained = get_train_initializer(model)
    names = [n for n, (value, _) in trained.items() if value.dtype == np.float32]
    picks = sorted({names[i] for i in np.linspace(0, len(names) - 1, count).astype(int)})
    return {n: trained[n][0] for n in picks} if names else {}


def _run_along_tangents(built: onnx.ModelProto, feeds, inputs, weights, seed: int):
    """``built`` (a JVP or HVP graph) run by onnxruntime along random tangents of the inputs
    and weights: ``(their values, the tangents, {output: value})``."""
    rng = np.random.default_rng(seed)
    moved = {**{n: feeds[n] for n in inputs}, **weights}
    tangents = {n: _direction(rng, v) for n, v in moved.items()}
    tangent_feeds = {f"{n}_tangent": t.astype(np.float32) for n, t in tangents.items()}
    names = [o.name for o in built.graph.output]
    got = dict(zip(names, _session(built).run(None, {**feeds, **weights, **tangent_feeds})))
    return moved, tangents, got


def check_jvp(model: onnx.ModelProto, feeds: dict, inputs: list[str], weights: dict) -> None:
    """``onnx_jvp`` along random tangents equals central differences of the outputs (of a
    quantized file, with its activation rounding frozen at the point: the straight-through
    estimator's reference, as tests/realmodels checks the gradient)."""
    jvp = onnx_jvp(model, weights=list(weights), inputs=inputs)
    # not seed 0: the feeds' noise is drawn from seed 0 too, so that tangent would be the
    # input itself, along which a model that min-max normalises its input (slim) is constant
    moved, tangents, got = _run_along_tangents(jvp, feeds, inputs, weights, seed=2)
    reference = Reference(_unrounded(model, feeds))

    def shifted(sign):
        new = {n: moved[n].astype(np.float64) + sign * STEP * t for n, t in tangents.items()}
        return reference.run({**feeds, **{n: new[n] for n in inputs}}, {n: new[n] for n in weights})

    compared = 0
    for output, up, down in zip(model.graph.output, shifted(1.0), shifted(-1.0)):
        if f"{output.name}_tangent" in got:
            expected = (np.asarray(up, np.float64) - np.asarray(down, np.float64)) / (2 * STEP)
            _close(got[f"{output.name}_tangent"], expected, output.name)
            compared += 1
    assert compared, "no output has a tangent"


def check_hvp(model: onnx.ModelProto, feeds: dict, inputs: list[str], weights: dict) -> None:
    """``onnx_hvp`` of a weighted ``sum |y|^2`` equals central differences of its reverse
    gradient (of a quantized file, of the file with its rounding frozen at the point: the
    straight-through estimator differentiates rounding as the identity)."""
    loss = _loss_model(model)
    hvp = onnx_hvp(loss, weights=list(weights), inputs=inputs)
    moved, tangents, got = _run_along_tangents(hvp, feeds, inputs, weights, seed=1)
    frozen = _loss_model(_unrounded(model, feeds))
    gradient = onnx_derivative(
        frozen, weights=list(weights), inputs=inputs, options=DerivativeOptions.Loss
    )
    reference = Reference(gradient)
    grad_names = [o.name for o in gradient.graph.output]

    def shifted(sign):
        new = {n: moved[n].astype(np.float64) + sign * STEP * t for n, t in tangents.items()}
        return dict(zip(grad_names, reference.run({**feeds, **new}, {})))

    up, down = shifted(1.0), shifted(-1.0)
    for n in moved:
        expected = (up[f"{n}_grad"] - down[f"{n}_grad"]) / (2 * STEP)
        _close(got[f"{n}_grad_tangent"], expected, n)


#: float element types of the outputs summed into the loss (a float16 export's too)
_FLOAT_TYPES = {1: np.float32, 10: np.float16, 11: np.float64}


def _loss_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with ``sum_k sum(r_k * y_k^2)`` of its float outputs as its only output, its
    functions, opsets and IR version kept. ``r_k`` is a fixed random weight in [0.5, 1.5) per
    entry of the last axis (where its size is declared): a plain ``sum |y|^2`` is constant
    after a normalisation over that axis (T5's and Whisper's last RMS/LayerNorm), so its
    Hessian is zero up to float32 rounding and no check at all."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    rng = np.random.default_rng(7)
    floats = [o for o in graph.output if o.type.tensor_type.elem_type in _FLOAT_TYPES]
    terms = []
    for k, out in enumerate(floats):
        square = helper.make_node("Mul", [out.name, out.name], [f"_loss_sq{k}"])
        graph.node.append(square)
        value = square.output[0]
        dims = out.type.tensor_type.shape.dim
        if dims and dims[-1].dim_value:
            dtype = _FLOAT_TYPES[out.type.tensor_type.elem_type]
            weight = (0.5 + rng.random(dims[-1].dim_value)).astype(dtype)
            graph.initializer.append(numpy_helper.from_array(weight, f"_loss_r{k}"))
            graph.node.append(helper.make_node("Mul", [value, f"_loss_r{k}"], [f"_loss_w{k}"]))
            value = f"_loss_w{k}"
        graph.node.append(helper.make_node("ReduceSum", [value], [f"_loss_s{k}"], keepdims=0))
        graph.node.append(helper.make_node("Cast", [f"_loss_s{k}"], [f"_loss_d{k}"], to=11))
        terms.append(f"_loss_d{k}")
    graph.node.append(helper.make_node("Sum", terms, ["_loss"]))
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("_loss", onnx.TensorProto.DOUBLE, []))
    return result


def model_cases(names: list[str] | None):
    """``(name, model, feeds)`` of the shipped models and of the architectures' exports."""
    yield from _shipped(names)
    yield from _architectures(names)


def _shipped(names):
    from tests.realmodels.test_shipped_models import INPUTS, _feeds
    from tests.realmodels.wheels import WHEELS, cache_dir, wheel_models

    paths = {}
    for package, version in WHEELS.items():
        found = wheel_models(package, version)
        for path in found:
            paths.setdefault(path.name, path)  # the first wheel's, as tests/realmodels does
        paths.update({p.relative_to(cache_dir() / "extract").as_posix(): p for p in found})
    for name, shapes in INPUTS.items():
        if (names and name not in names) or name not in paths:
            continue
        model = onnx.load(str(paths[name]))
        yield name, model, _feeds(model, shapes, np.random.default_rng(0))


def _architectures(names):
    from tests import architectures

    for arch in architectures.ARCHITECTURES:
        if names and arch not in names:
            continue
        model = onnx.load(str(architectures.exported(arch)))
        yield arch, model, architectures.feeds(arch)


def model_outcomes(names, modes, judge) -> list:
    """JVP and HVP outcomes of every model (``judge`` from :mod:`benchmarks.coverage_modes`)."""
    from benchmarks.coverage_modes import _report

    outcomes = []
    for name, model, feeds in model_cases(names):
        inputs = [n for n, v in feeds.items() if v.dtype == np.float32]
        weights = {} if inputs else sample_weights(model)
        label = name if inputs else f"{name} (weights {', '.join(weights)})"
        for mode, check in (("jvp", check_jvp), ("hvp", check_hvp)):
            if mode in modes:
                run = functools.partial(check, model, feeds, inputs, weights)
                outcomes.append(_report(judge(label, mode, run, limit=600)))
                print(f"{mode} {label}: {outcomes[-1].status} {outcomes[-1].seconds:.1f} s",
                      flush=True)  # fmt: skip
    return outcomes
