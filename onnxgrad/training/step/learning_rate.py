"""Learning-rate schedules and the weight updates they drive.

An optimizer object plays two parts:

* the **schedule**, evaluated in Python once per epoch at ``t``, the number of training
  samples seen so far (scikit-learn's ``SGDRegressor`` and ``MLPRegressor`` count time
  the same way): :meth:`BaseLearningRate.learning_rate_at`;
* the **update**: the authored graph of :mod:`onnxgrad.functions` holding its formula,
  inlined into the fused train step for each weight ``w`` with gradient ``g`` (or once for
  all the weights end to end, see :mod:`onnxgrad.training.step.train_step`) and the current
  learning rate ``lr``; it yields the new value and the new optimizer state (velocity,
  moments), all computed on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from onnxgrad._onnx_utils import np_dtype
from onnxgrad.training.step._builder import StepBuilder, inline_model
from onnxgrad.training.step._params import ParamsMixin

_SCHEDULES = ("constant", "optimal", "invscaling")


@dataclass(frozen=True)
class StateSpec:
    """One optimizer state tensor: its name suffix and initial value.

    A per-weight tensor has its weight's shape and element type; a ``shared`` one (one for
    the whole step) is a ``[1]`` tensor of element type ``elem_type`` (``None``: the weights').
    """

    suffix: str
    shared: bool = False
    initial: float = 0.0
    elem_type: int | None = None


class BaseLearningRate(ParamsMixin):
    """Common part of the optimizers: the current value and the schedule protocol.

    The update formulas are the authored graphs of :func:`onnxgrad.function_onnx_graph`
    (named by :attr:`function_name`), inlined into the train step.
    """

    #: the state each weight (or the whole step, ``shared=True``) carries between steps
    state_specs: tuple[StateSpec, ...] = ()
    #: the authored update graph
    function_name: str = ""

    def learning_rate_at(self, t: float) -> float:
        """The learning rate after ``t`` training samples."""
        raise NotImplementedError

    def check(self) -> None:
        """Raise ``ValueError`` naming the first invalid hyper-parameter."""

    def init_learning_rate(self) -> BaseLearningRate:
        """Check the parameters and reset :attr:`value` to the rate at ``t = 0``."""
        self.check()
        self.value = self.learning_rate_at(0)
        return self

    def update_learning_rate(self, t: float) -> BaseLearningRate:
        """Set :attr:`value` to the rate after ``t`` samples."""
        self.value = self.learning_rate_at(t)
        return self

    def loop(self, n: int = 1000):
        """The first ``n`` learning rates: at ``t = 0``, then after each of ``n - 1`` updates
        ``update_learning_rate(i)`` (``i = 1, 2...``), as the seeds' ``loop``."""
        self.init_learning_rate()
        for i in range(n):
            yield self.value
            self.update_learning_rate(i + 1)

    @staticmethod
    def select(class_name, **kwargs) -> BaseLearningRate:
        """The seeds' factory: an optimizer object (returned as is), a number (``eta0`` of
        :class:`LearningRateSGD`) or a name (``'SGD'``, ``'Nesterov'``, ``'SGDNesterov'``,
        ``'Momentum'``, ``'Adam'`` or a class name) built with ``kwargs``."""
        if isinstance(class_name, BaseLearningRate):
            return class_name
        if isinstance(class_name, (int, float, np.number)) and not isinstance(class_name, bool):
            return LearningRateSGD(eta0=float(class_name), **kwargs)
        classes = {cls.__name__: (cls, {}) for cls in _all_classes()}
        aliases = {"sgdnesterov": _BY_NAME["nesterov"], **_BY_NAME}
        key = class_name if class_name in classes else str(class_name).lower()
        if key not in classes and key not in aliases:
            raise ValueError(
                f"unknown learning rate {class_name!r}, expected one of "
                f"{[*LEARNING_RATE_NAMES, *classes]}"
            )
        cls, fixed = classes.get(key) or aliases[key]
        return cls(**{**fixed, **kwargs})

    def emit_shared(
        self, b: StepBuilder, lr: str, shared: dict[str, str], elem_type: int
    ) -> tuple[dict[str, str], dict[str, str]]:
        """Nodes computed once per step from the scalar learning rate ``lr`` and the shared
        state: ``(feeds of the update graph, new shared state)``."""
        raise NotImplementedError

    def emit_update(
        self,
        b: StepBuilder,
        weight: str,
        grad: str,
        state: dict[str, str],
        feeds: dict[str, str],
        elem_type: int,
    ) -> tuple[str, dict[str, str]]:
        """Inline the update graph for one weight; returns the new weight and new state.

        ``state`` maps this weight's state suffixes to names, ``feeds`` comes from
        :meth:`emit_shared`; every float tensor has the element type ``elem_type``.
        """
        from onnxgrad.functions import function_onnx_graph  # onnxscript: loaded when built

        graph = function_onnx_graph(
            self.function_name, target_opset=b.opset, dtype=np_dtype(elem_type)
        )
        outputs = inline_model(b, graph, {**feeds, **self._update_feeds(weight, grad, state)})
        return self._update_results(outputs)

    def _update_feeds(self, weight: str, grad: str, state: dict[str, str]) -> dict[str, str]:
        raise NotImplementedError

    def _update_results(self, outputs: dict[str, str]) -> tuple[str, dict[str, str]]:
        raise NotImplementedError


class LearningRateSGD(BaseLearningRate):
    """Stochastic gradient descent ``w <- w - lr g`` (graph ``axpy``) with scikit-learn's
    schedules.

    With ``t`` the number of samples seen:

    * ``'constant'``: ``lr = eta0``;
    * ``'invscaling'``: ``lr = eta0 / (t + 1) ** power_t``;
    * ``'optimal'``: scikit-learn's ``1 / (alpha (t0 + t))`` scaled to start at ``eta0``, as
      the seeds: ``lr = eta0 t0 / (t0 + t)``, with scikit-learn's ``t0 = 1 / (alpha eta_1)``
      (Léon Bottou's heuristic, ``eta_1 = typw / max(1, loss'(1, -typw))``, ``typw = sqrt(1
      / sqrt(alpha))``; ``loss'`` is negative there for every loss of scikit-learn, so
      ``eta_1 = typw``). With ``eta0 = typw`` (:meth:`sklearn_eta0`) it is scikit-learn's
      schedule exactly; any other ``eta0`` keeps its shape, so the rate never starts above
      what the user asked for.
    """

    function_name = "axpy"

    def __init__(
        self,
        eta0: float = 0.01,
        alpha: float = 0.0001,
        power_t: float = 0.25,
        learning_rate: str = "invscaling",
    ):
        self.eta0 = eta0
        self.alpha = alpha
        self.power_t = power_t
        self.learning_rate = learning_rate
        _check_schedule(learning_rate)  # a misspelt name fails here, as onnxcustom's did

    def check(self) -> None:
        _check_positive("eta0", self.eta0)
        _check_schedule(self.learning_rate)
        if self.learning_rate == "optimal":
            _check_positive("alpha", self.alpha)
        if self.learning_rate == "invscaling":
            _check_number("power_t", self.power_t)

    def learning_rate_at(self, t: float) -> float:
        if self.learning_rate == "constant":
            return float(self.eta0)
        if self.learning_rate == "invscaling":
            return float(self.eta0) / (t + 1) ** float(self.power_t)
        t0 = 1.0 / (self.alpha * self.sklearn_eta0(self.alpha))
        return float(self.eta0) * t0 / (t0 + t)

    @staticmethod
    def sklearn_eta0(alpha: float) -> float:
        """scikit-learn's first ``'optimal'`` rate ``typw = sqrt(1 / sqrt(alpha))``."""
        return math.sqrt(1.0 / math.sqrt(alpha))

    def emit_shared(self, b, lr, shared, elem_type):
        alpha = b.op("Neg", _as_vector(b, lr))
        return {"alpha": alpha}, {}

    def _update_feeds(self, weight, grad, state):
        return {"X1": grad, "X2": weight}

    def _update_results(self, outputs):
        return outputs["Y"], {}


def _check_schedule(name: str) -> None:
    if name not in _SCHEDULES:
        raise ValueError(
            f"unknown learning_rate schedule {name!r}, expected one of {list(_SCHEDULES)}"
        )


class LearningRateSGDNesterov(LearningRateSGD):
    """SGD with momentum, the schedules of :class:`LearningRateSGD` (scikit-learn's MLP).

    With velocity ``v`` (zeros at start) and momentum ``mu``::

        v <- mu v - lr g
        w <- w + mu v - lr g     (nesterov=True, graph axpyw2)
        w <- w + v               (nesterov=False, classical momentum, graph axpyw)

    The schedule is ``'constant'`` by default, as scikit-learn's MLP and the ``onnxgrad``
    command (the seeds' ``'invscaling'`` decayed ``eta0=1e-3`` to 6.4e-5 after 100 epochs
    of 600 rows); :class:`LearningRateSGD` keeps the seeds' ``'invscaling'``.
    """

    state_specs = (StateSpec("velocity"),)

    def __init__(
        self,
        eta0: float = 0.01,
        alpha: float = 0.0001,
        power_t: float = 0.25,
        learning_rate: str = "constant",
        momentum: float = 0.9,
        nesterov: bool = True,
    ):
        super().__init__(eta0=eta0, alpha=alpha, power_t=power_t, learning_rate=learning_rate)
        self.momentum = momentum
        self.nesterov = nesterov

    @property
    def function_name(self) -> str:
        return "axpyw2" if self.nesterov else "axpyw"

    def check(self) -> None:
        super().check()
        _check_number("momentum", self.momentum)
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")

    def emit_shared(self, b, lr, shared, elem_type):
        feeds, _ = super().emit_shared(b, lr, shared, elem_type)
        feeds["beta"] = b.const([self.momentum], elem_type, "momentum")
        return feeds, {}

    def _update_feeds(self, weight, grad, state):
        return {"X1": grad, "X2": weight, "G": state["velocity"]}

    def _update_results(self, outputs):
        return outputs["Y"], {"velocity": outputs["Z"]}


class LearningRateAdam(BaseLearningRate):
    """Adam (Kingma & Ba, graph ``adam``) with a constant base rate ``eta0``.

    With moments ``m``, ``v`` (zeros) and a step count ``k`` (0) shared by all weights::

        k <- k + 1
        m <- beta1 m + (1 - beta1) g
        v <- beta2 v + (1 - beta2) g^2
        w <- w - lr (m / (1 - beta1^k)) / (sqrt(v / (1 - beta2^k)) + epsilon)
    """

    state_specs = (
        StateSpec("m"),
        StateSpec("v"),
        StateSpec("step", shared=True, elem_type=TensorProto.INT64),
    )
    function_name = "adam"

    def __init__(
        self,
        eta0: float = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
    ):
        self.eta0 = eta0
        self.beta1 = beta1
        self.beta2 = beta2
        self.epsilon = epsilon

    def check(self) -> None:
        _check_positive("eta0", self.eta0)
        _check_positive("epsilon", self.epsilon)
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            _check_number(name, value)
            if not 0 <= value < 1:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")

    def learning_rate_at(self, t: float) -> float:
        return float(self.eta0)

    def emit_shared(self, b, lr, shared, elem_type):
        step = b.op("Add", shared["step"], b.const([1], TensorProto.INT64, "one"))
        feeds = {
            "alpha": _as_vector(b, lr),
            "beta1": b.const([self.beta1], elem_type, "beta1"),
            "beta2": b.const([self.beta2], elem_type, "beta2"),
            "epsilon": b.const([self.epsilon], elem_type, "epsilon"),
            "t": step,
        }
        return feeds, {"step": step}

    def _update_feeds(self, weight, grad, state):
        return {"X": weight, "G": grad, "M": state["m"], "V": state["v"]}

    def _update_results(self, outputs):
        return outputs["Y"], {"m": outputs["M_new"], "v": outputs["V_new"]}


def _all_classes() -> tuple[type[BaseLearningRate], ...]:
    return (LearningRateSGD, LearningRateSGDNesterov, LearningRateAdam)


def _as_vector(b: StepBuilder, scalar: str) -> str:
    """A rank-0 tensor reshaped to ``[1]``, the shape of the authored graphs' parameters."""
    return b.op("Reshape", scalar, b.const([1], TensorProto.INT64, "vector_shape"))


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not np.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")


def _check_positive(name: str, value) -> None:
    _check_number(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


#: optimizer name (lower case) -> its class and the parameters the name fixes
_BY_NAME = {
    "sgd": (LearningRateSGD, {}),
    "nesterov": (LearningRateSGDNesterov, {}),
    "momentum": (LearningRateSGDNesterov, {"nesterov": False}),
    "adam": (LearningRateAdam, {}),
}

#: the optimizer names :func:`learning_rate_from_name` accepts (in any case)
LEARNING_RATE_NAMES = tuple(_BY_NAME)


def learning_rate_from_name(
    name: str, eta0: float | None = None, schedule: str | None = None
) -> BaseLearningRate:
    """A fresh, checked optimizer ``'SGD'``, ``'Nesterov'``, ``'Momentum'`` (classical
    momentum) or ``'Adam'``, in any case, with its default hyper-parameters except:

    :param eta0: the base learning rate (default: the optimizer's, 0.01 for the SGD family,
        0.001 for Adam)
    :param schedule: the SGD family's schedule (default ``'invscaling'``, see
        :class:`LearningRateSGD`); Adam's rate is constant, ``'constant'`` is accepted
    """
    if not isinstance(name, str) or name.lower() not in _BY_NAME:
        raise ValueError(f"unknown optimizer {name!r}, expected one of {list(LEARNING_RATE_NAMES)}")
    cls, params = _BY_NAME[name.lower()]
    params = dict(params)
    if eta0 is not None:
        params["eta0"] = eta0
    if schedule is not None and cls is LearningRateAdam:
        if schedule != "constant":
            raise ValueError(f"Adam's learning rate is constant, it has no schedule {schedule!r}")
    elif schedule is not None:
        params["learning_rate"] = schedule
    optimizer = cls(**params)
    optimizer.check()
    return optimizer


def select_learning_rate(learning_rate) -> BaseLearningRate:
    """A fresh optimizer from the estimators' ``learning_rate`` parameter.

    A number is the initial rate ``eta0`` of :class:`LearningRateSGD`; a name of
    :data:`LEARNING_RATE_NAMES` (any case) selects the optimizer with its defaults
    (:func:`learning_rate_from_name`); an optimizer object is copied (the estimator never
    mutates its parameters).
    """
    if isinstance(learning_rate, BaseLearningRate):
        return type(learning_rate)(**learning_rate.get_params(deep=False))
    if isinstance(learning_rate, str):
        if learning_rate.lower() not in _BY_NAME:
            raise ValueError(
                f"unknown learning_rate {learning_rate!r}, expected a number, an optimizer "
                "object or one of 'SGD', 'Nesterov', 'Momentum', 'Adam'"
            )
        return learning_rate_from_name(learning_rate)
    if isinstance(learning_rate, (int, float, np.number)) and not isinstance(learning_rate, bool):
        return LearningRateSGD(eta0=float(learning_rate))
    raise TypeError(
        f"learning_rate must be a number, a name or an optimizer object, got {learning_rate!r}"
    )


__all__ = [
    "LEARNING_RATE_NAMES",
    "BaseLearningRate",
    "LearningRateAdam",
    "LearningRateSGD",
    "LearningRateSGDNesterov",
    "StateSpec",
    "learning_rate_from_name",
    "select_learning_rate",
]
