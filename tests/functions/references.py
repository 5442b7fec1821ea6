"""numpy references of every catalogue graph, and inputs to feed them.

Each :class:`Case` builds feeds for a graph (float type, optional sample weight) and computes
the expected outputs with numpy from the formulas of the specification, not from the graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Arrays = dict[str, np.ndarray]

WEIGHTED = (
    "square_error",
    "grad_square_error",
    "grad_loss_square_error",
    "grad_loss_absolute_error",
    "grad_loss_elastic_error",
    "grad_sigmoid_neg_log_loss_error",
)


@dataclass(frozen=True)
class Case:
    """One graph with options, the feeds it gets and its numpy reference."""

    name: str
    feeds: Callable[[np.random.Generator, np.dtype], Arrays]
    reference: Callable[..., Arrays]
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        suffix = ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.name}[{suffix}]" if suffix else self.name

    @property
    def weighted(self) -> bool:
        return self.name in WEIGHTED


def _one(value: float, dtype) -> np.ndarray:
    return np.array([value], dtype=dtype)


def _weight_like(rng: np.random.Generator, dtype, shape=(3, 4)) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def _regression_pair(rng: np.random.Generator, dtype, shape=(5, 2)) -> Arrays:
    """Expected X1 and predicted X2 at least 0.2 apart, away from the kinks of |d|."""
    expected = rng.standard_normal(shape)
    gap = rng.uniform(0.2, 1.0, shape) * rng.choice([-1.0, 1.0], shape)
    return {"X1": expected.astype(dtype), "X2": (expected + gap).astype(dtype)}


def _classification_pair(rng: np.random.Generator, dtype, shape=(5, 2)) -> Arrays:
    return {
        "X1": rng.integers(0, 2, shape).astype(np.int64),
        "X2": (2 * rng.standard_normal(shape)).astype(dtype),
    }


def sample_weight(rng: np.random.Generator, dtype, n: int = 5) -> np.ndarray:
    return rng.uniform(0.5, 2.0, n).astype(dtype)


def rows(w: np.ndarray | None, like: np.ndarray) -> np.ndarray | float:
    """Per-sample weights broadcast over the trailing dimensions of ``like``."""
    return 1.0 if w is None else w.reshape((-1,) + (1,) * (like.ndim - 1))


def square_loss(f: Arrays, w=None) -> Arrays:
    d = f["X1"] - f["X2"]
    return {"Y": np.sum(rows(w, d) * d**2), "Y_grad": -2 * rows(w, d) * d}


def absolute_loss(f: Arrays, w=None) -> Arrays:
    d = f["X1"] - f["X2"]
    return {"Y": np.sum(rows(w, d) * np.abs(d)), "Y_grad": -rows(w, d) * np.sign(d)}


def elastic_loss(f: Arrays, w=None, l1_weight=0.01, l2_weight=0.01) -> Arrays:
    d = f["X1"] - f["X2"]
    error = l1_weight * np.abs(d) + l2_weight * d**2
    grad = -(l1_weight * np.sign(d) + 2 * l2_weight * d)
    return {"Y": np.sum(rows(w, d) * error), "Y_grad": rows(w, d) * grad}


def sigmoid_log_loss(f: Arrays, w=None, eps=1e-5) -> Arrays:
    y = f["X1"].astype(np.float64)
    s = f["X2"].astype(np.float64)
    p = 1 / (1 + np.exp(-s))
    q = np.clip(p, eps, 1 - eps)
    error = -(y * np.log(q) + (1 - y) * np.log(1 - q))
    return {"Y": np.sum(rows(w, s) * error), "Y_grad": rows(w, s) * (p - y)}


def elastic_penalty(x: np.ndarray, l1: float, l2: float) -> float:
    return l1 * np.sum(np.abs(x)) + l2 * np.sum(x**2)


def adam_step(f: Arrays) -> Arrays:
    lr, b1, b2, eps = (f[k].item() for k in ("alpha", "beta1", "beta2", "epsilon"))
    t = f["t"].item()
    m = b1 * f["M"] + (1 - b1) * f["G"]
    v = b2 * f["V"] + (1 - b2) * f["G"] ** 2
    m_hat = m / (1 - b1**t)
    v_hat = v / (1 - b2**t)
    return {"Y": f["X"] - lr * m_hat / (np.sqrt(v_hat) + eps), "M_new": m, "V_new": v}


def _select(outputs: Arrays, *names: str) -> Arrays:
    return {name: outputs[name] for name in names}


def _adam_feeds(rng, dtype) -> Arrays:
    return {
        "X": _weight_like(rng, dtype),
        "G": _weight_like(rng, dtype),
        "M": 0.1 * _weight_like(rng, dtype),
        "V": rng.uniform(0.01, 0.1, (3, 4)).astype(dtype),
        "alpha": _one(0.01, dtype),
        "beta1": _one(0.9, dtype),
        "beta2": _one(0.999, dtype),
        "epsilon": _one(1e-8, dtype),
        "t": np.array([3], dtype=np.int64),
    }


def _momentum_feeds(rng, dtype) -> Arrays:
    return {
        "X1": _weight_like(rng, dtype),
        "X2": _weight_like(rng, dtype),
        "G": _weight_like(rng, dtype),
        "alpha": _one(-0.1, dtype),
        "beta": _one(0.9, dtype),
    }


def _n_penalty_feeds(rng, dtype) -> Arrays:
    # weights of different shapes: each weight input has dims of its own
    feeds = {f"W{i}": _weight_like(rng, dtype, (2 + i, 3)) for i in range(3)}
    return {"loss": np.array([[1.5]], dtype=dtype), **feeds}


def _n_penalty(f: Arrays, w=None) -> Arrays:
    total = sum(elastic_penalty(f[f"W{i}"], 0.2, 0.3) for i in range(3))
    return {"Y": (f["loss"] + total).reshape(-1)}


def _axpyw(f: Arrays, w=None) -> Arrays:
    z = f["beta"] * f["G"] + f["alpha"] * f["X1"]
    return {"Y": z + f["X2"], "Z": z}


def _axpyw2(f: Arrays, w=None) -> Arrays:
    z = f["beta"] * f["G"] + f["alpha"] * f["X1"]
    return {"Y": f["beta"] * z + f["alpha"] * f["X1"] + f["X2"], "Z": z}


CASES = [
    Case(
        "axpy",
        lambda rng, dt: {
            "X1": _weight_like(rng, dt),
            "X2": _weight_like(rng, dt),
            "alpha": _one(-0.3, dt),
        },
        lambda f, w=None: {"Y": f["alpha"] * f["X1"] + f["X2"]},
    ),
    Case("axpyw", _momentum_feeds, _axpyw),
    Case("axpyw2", _momentum_feeds, _axpyw2),
    Case("adam", _adam_feeds, lambda f, w=None: adam_step(f)),
    Case("copy", lambda rng, dt: {"X": _weight_like(rng, dt)}, lambda f, w=None: {"Y": f["X"]}),
    Case(
        "zero",
        lambda rng, dt: {"X": _weight_like(rng, dt)},
        lambda f, w=None: {"Y": np.zeros_like(f["X"])},
    ),
    Case(
        "square_error",
        _regression_pair,
        lambda f, w=None: _select(square_loss(f, w), "Y"),
    ),
    Case(
        "grad_square_error",
        _regression_pair,
        lambda f, w=None: _select(square_loss(f, w), "Y_grad"),
    ),
    Case("grad_loss_square_error", _regression_pair, square_loss),
    Case("grad_loss_absolute_error", _regression_pair, absolute_loss),
    Case("grad_loss_elastic_error", _regression_pair, elastic_loss),
    Case(
        "grad_loss_elastic_error",
        _regression_pair,
        lambda f, w=None: elastic_loss(f, w, l1_weight=0.3, l2_weight=0.7),
        {"l1_weight": 0.3, "l2_weight": 0.7},
    ),
    Case("grad_sigmoid_neg_log_loss_error", _classification_pair, sigmoid_log_loss),
    Case(
        "grad_sigmoid_neg_log_loss_error",
        _classification_pair,
        lambda f, w=None: sigmoid_log_loss(f, w, eps=1e-3),
        {"eps": 1e-3},
    ),
    Case(
        "grad_penalty_elastic_error",
        lambda rng, dt: {"X": _weight_like(rng, dt)},
        lambda f, w=None: {
            "Y": elastic_penalty(f["X"], 0.2, 0.3),
            "Y_grad": 0.2 * np.sign(f["X"]) + 2 * 0.3 * f["X"],
        },
        {"l1_weight": 0.2, "l2_weight": 0.3},
    ),
    Case(
        "grad_penalty_elastic_error",
        lambda rng, dt: {"X": _weight_like(rng, dt)},
        lambda f, w=None: {
            "Y": elastic_penalty(f["X"], 0.01, 0.01),
            "Y_grad": 0.01 * np.sign(f["X"]) + 0.02 * f["X"],
        },
    ),
    Case(
        "n_penalty_elastic_error",
        _n_penalty_feeds,
        _n_penalty,
        {"l1_weight": 0.2, "l2_weight": 0.3, "n_tensors": 3},
    ),
    Case(
        "update_penalty_elastic_error",
        lambda rng, dt: {"X": _weight_like(rng, dt)},
        lambda f, w=None: {"Y": f["X"] - 0.1 * np.sign(f["X"]) - 2 * 0.05 * f["X"]},
        {"l1": 0.1, "l2": 0.05},
    ),
    Case(
        "update_penalty_elastic_error",
        lambda rng, dt: {"X": _weight_like(rng, dt)},
        lambda f, w=None: {"Y": f["X"] - 1e-4 * np.sign(f["X"]) - 2e-4 * f["X"]},
    ),
    Case(
        "linear_regression",
        lambda rng, dt: {
            "X": _weight_like(rng, dt, (5, 3)),
            "A": _weight_like(rng, dt, (3, 2)),
            "B": _weight_like(rng, dt, (1, 2)),
        },
        lambda f, w=None: {"Y": f["X"] @ f["A"] + f["B"]},
    ),
]

GRADIENT_CASES = [c for c in CASES if c.name.startswith("grad_") and c.name != "grad_square_error"]
