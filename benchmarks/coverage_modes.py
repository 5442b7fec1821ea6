"""Forward mode and Hessian-vector products wherever the reverse mode passes (issue 33).

Three sweeps, each against an independent float64 reference, never against onnxgrad:

- ``rules``: every first-order case of the rule table (tests/derivative/autodiff): ``onnx_jvp``
  against central differences of the outputs along a random tangent
  (tests/derivative/test_forward_rules.py's check), ``onnx_hvp`` of ``sum |y|^2`` against
  central differences of the reverse gradient along the tangent (gradcheck's ``check_hvp``;
  the reverse gradient itself is checked against finite differences of the outputs by
  tests/derivative/autodiff/test_rules.py). Cases whose second derivative cannot be measured
  this way (tests/derivative/autodiff/test_closure.py's ``NOT_CHECKED``, with its reasons)
  are counted apart.
- ``models``: the shipped models of tests/realmodels (wheels cached under
  ~/.cache/onnxgrad-models): ``onnx_jvp`` with respect to every float input against central
  differences of the original model in float64 (onnx's reference evaluator), and
  ``onnx_hvp`` of ``sum |y|^2`` against central differences of its reverse gradient.
- ``seeds``: on a sample of rule cases, ``seeds=k`` in one run equals ``k`` single runs.
- ``ops``: onnx's own operator test cases (benchmarks/coverage_ops.py), wherever the reverse
  mode is judged ``ok`` there: ``onnx_jvp`` against central differences of the outputs and
  ``onnx_hvp`` of ``sum_k <y_k, g_k>`` against central differences of the reverse gradient,
  along a random tangent, with that sweep's oracle, float64 model, step and tolerance
  (benchmarks/_modes_ops.py).

    python benchmarks/coverage_modes.py rules [--ops Softmax,Conv] [--markdown out.md]
    python benchmarks/coverage_modes.py models [--names a.onnx,b.onnx]
    python benchmarks/coverage_modes.py seeds
    python benchmarks/coverage_modes.py ops [--ops Relu,Conv] [--modes jvp] [--jobs 2] [--first]

``--transposed`` judges the fallback: every JVP (and the JVP inside every HVP) is built by the
transposition of the reverse graph (onnxgrad/derivative/forward.py), the tangent pass refused
wherever it would have taken the graph (``ops``' worker processes are forked, patched).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Outcome:
    """One check: ``status`` is ``ok``, ``ok (zero)`` (agrees, and is 0: the ops sweep),
    ``wrong`` (built and ran, disagrees with the reference), ``failed`` (raised), ``not
    judged`` (no reference) or ``timeout``."""

    name: str
    mode: str
    status: str
    detail: str = ""
    seconds: float = 0.0


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def judge(name: str, mode: str, check: Callable[[], None], limit: int = 120) -> Outcome:
    """Run ``check`` (raises ``AssertionError`` when wrong) under a time limit."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit)
    start = time.perf_counter()
    try:
        check()
        status, detail = "ok", ""
    except AssertionError as exc:
        status, detail = "wrong", _short(exc)
    except _Timeout:
        status, detail = "timeout", f"over {limit} s"
    except Exception as exc:
        status, detail = "failed", f"{type(exc).__name__}: {_short(exc)}"
    finally:
        signal.alarm(0)
    return Outcome(name, mode, status, detail, time.perf_counter() - start)


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + "..."


#: cases whose HVP the float64 oracle cannot check (onnx's reference evaluator returns
#: LayerNormalization's statistics in float64, not the float32 of the specification): judged by
#: a test against numpy instead, ``(module, function)``
JUDGED_APART = {
    "LayerNormalization-statistics-outputs": (
        "tests.derivative.test_hvp_models",
        "test_layer_normalization_statistics_against_numpy_differences",
    ),
}


#: cases of ``NOT_CHECKED`` whose HVP is judged all the same: reverse-over-reverse refuses to
#: differentiate a gradient that depends on nothing, ``onnx_hvp`` gives its zero Hessian
HVP_JUDGED = {"Pow-zero-exponent"}


@contextlib.contextmanager
def transposition_only():
    """``onnx_jvp`` and ``onnx_hvp`` by transposition only, inside the block: the tangent pass
    refuses every graph, as it does one with an operator it has no rule for."""
    from onnxgrad.derivative import forward
    from onnxgrad.derivative.autodiff.tangent import NoTangentRule

    def refuse(*args, **kwargs):
        raise NoTangentRule("the transposition is judged (coverage_modes --transposed)")

    original, forward.tangent_jvp = forward.tangent_jvp, refuse
    try:
        yield
    finally:
        forward.tangent_jvp = original


def rule_outcomes(ops: set[str] | None, modes: set[str]) -> list[Outcome]:
    """JVP and HVP on every first-order case of the rule table."""
    from tests.derivative.autodiff.gradcheck import check_hvp
    from tests.derivative.autodiff.test_closure import (
        FIRST_ORDER,
        NOT_CHECKED,
        ON_ONNXRUNTIME,
        UNIT_STEP,
    )
    from tests.derivative.test_forward_rules import test_jvp_against_finite_differences

    outcomes = []
    for case in FIRST_ORDER:
        if ops and case.op_type not in ops:
            continue
        if "jvp" in modes:
            outcomes.append(
                _report(
                    judge(case.id, "jvp", lambda c=case: test_jvp_against_finite_differences(c))
                )
            )
        if "hvp" not in modes:
            continue
        if case.id in JUDGED_APART:
            check = getattr(
                importlib.import_module(JUDGED_APART[case.id][0]), JUDGED_APART[case.id][1]
            )
            outcomes.append(_report(judge(case.id, "hvp", check)))
            continue
        if case.id in NOT_CHECKED and case.id not in HVP_JUDGED:
            outcomes.append(_report(Outcome(case.id, "hvp", "not judged", NOT_CHECKED[case.id])))
            continue
        kind = "onnxruntime" if case.id in ON_ONNXRUNTIME else case.evaluator
        kind = _exact_reference if kind == "reference" else kind
        eps = 1.0 if case.op_type in UNIT_STEP else case.eps
        outcomes.append(
            _report(judge(case.id, "hvp", lambda c=case, k=kind, e=eps: check_hvp(c, k, e)))
        )
    return outcomes


def _exact_reference(model):
    """onnx's reference evaluator with an exact ``GatherElements`` along any axis size (the
    transposition of a grouped Conv's or a reflect Pad's gradient gathers along more than 64
    entries, which onnx's ``np.choose`` refuses; see
    :class:`benchmarks.coverage_ops.GatherElements`)."""
    from onnx.reference import ReferenceEvaluator

    from benchmarks.coverage_ops import GatherElements

    return ReferenceEvaluator(model, new_ops=[GatherElements])


def op_outcomes(ops: set[str] | None, modes: set[str], args) -> list[Outcome]:
    """JVP and HVP on onnx's operator cases (:mod:`benchmarks._modes_ops`)."""
    from benchmarks._modes_ops import ops_results

    results = ops_results(ops, modes, args.jobs, args.first)
    return [_report(Outcome(*result)) for result in results]


def _agrees(outcome: Outcome) -> bool:
    return outcome.status in ("ok", "ok (zero)")


def _report(outcome: Outcome) -> Outcome:
    if not _agrees(outcome):
        print(f"{outcome.mode} {outcome.name}: {outcome.status} {outcome.detail}", flush=True)
    return outcome


def summary(outcomes: list[Outcome]) -> str:
    lines = []
    for mode in sorted({o.mode for o in outcomes}):
        counts = collections.Counter(o.status for o in outcomes if o.mode == mode)
        total = sum(counts.values())
        judged = total - counts["not judged"]
        agree = counts["ok"] + counts["ok (zero)"]
        parts = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        lines.append(f"{mode}: {agree}/{judged} judged agree ({parts})")
    return "\n".join(lines)


def markdown(outcomes: list[Outcome]) -> str:
    lines = [summary(outcomes), "", "| mode | case | status | detail |", "|---|---|---|---|"]
    for o in outcomes:
        if not _agrees(o):
            lines.append(f"| {o.mode} | {o.name} | {o.status} | {o.detail} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", choices=["rules", "models", "seeds", "ops"])
    parser.add_argument("--ops", help="rules: comma-separated operator types (default: all)")
    parser.add_argument("--modes", default="jvp,hvp", help="comma-separated: jvp, hvp")
    parser.add_argument("--names", help="models: comma-separated file names (default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="ops: processes (default 1)")
    parser.add_argument(
        "--first", action="store_true", help="ops: the first case of each operator type only"
    )
    parser.add_argument("--markdown", help="write the summary and the failures here")
    parser.add_argument(
        "--transposed", action="store_true", help="forward mode by the transposition only"
    )
    args = parser.parse_args(argv)
    with transposition_only() if args.transposed else contextlib.nullcontext():
        outcomes = _outcomes(args)
    print(summary(outcomes))
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(markdown(outcomes))
    return 0


def _outcomes(args) -> list[Outcome]:
    modes = set(args.modes.split(","))
    if args.sweep == "rules":
        outcomes = rule_outcomes(set(args.ops.split(",")) if args.ops else None, modes)
    elif args.sweep == "ops":
        outcomes = op_outcomes(set(args.ops.split(",")) if args.ops else None, modes, args)
    elif args.sweep == "models":
        from benchmarks._modes_models import model_outcomes

        outcomes = model_outcomes(args.names.split(",") if args.names else None, modes, judge)
    else:
        from benchmarks._modes_seeds import seed_outcomes

        outcomes = seed_outcomes(judge)
    return outcomes


if __name__ == "__main__":
    sys.exit(main())
