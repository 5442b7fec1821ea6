"""The catalogue of authored graphs: what each graph takes, returns and accepts as options.

A graph is registered with :func:`register` beside its builder. The builder receives a
:class:`BuildContext` (opset, element type, whether a sample weight is requested) and the
validated options, and returns the ``onnx.ModelProto`` of an onnxscript function. Inputs and
outputs are declared here, as :class:`Port` objects, because onnxscript functions are typed
per element type and the catalogue serves float32 and float64 from one source.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxscript

Dim = int | str | None

#: Name of the sample-weight input inside the builders; renamed to ``weight_name``.
WEIGHT = "weight"


@dataclass(frozen=True)
class Port:
    """A graph input or output.

    ``shape`` holds the declared dimensions (``None`` for an output whose shape onnx shape
    inference finds); ``like`` names an earlier input whose declared shape this port shares;
    ``integer`` makes the element type int64 instead of the requested float type.
    """

    name: str
    shape: tuple[Dim, ...] | None = None
    like: str | None = None
    integer: bool = False


def tensor(name: str, *dims: Dim, integer: bool = False) -> Port:
    """An input or output with the given dimensions."""
    return Port(name, tuple(dims), integer=integer)


def scalar(name: str) -> Port:
    """A hyper-parameter input of shape ``[1]``."""
    return Port(name, (1,))


def like(name: str, source: str) -> Port:
    """An input or output declared with the shape of input ``source``.

    An input follows ``source`` unless ``input_shapes`` gives its own shape.
    """
    return Port(name, like=source)


def inferred(name: str) -> Port:
    """An output whose shape comes from onnx shape inference."""
    return Port(name)


@dataclass(frozen=True)
class Param:
    """A keyword option of a graph: its default and the function validating a value."""

    default: Any
    check: Callable[[str, Any], Any]


@dataclass(frozen=True)
class BuildContext:
    """What a builder needs to emit a concrete graph."""

    opset: int
    dtype: np.dtype
    weighted: bool = False

    @property
    def op(self) -> onnxscript.values.Opset:
        """The onnxscript opset module of :attr:`opset` (``onnxscript.opset18``...)."""
        return getattr(onnxscript, f"opset{self.opset}")

    @property
    def elem_type(self) -> int:
        return onnx.helper.np_dtype_to_tensor_dtype(self.dtype)

    def constant(self, value: float) -> np.ndarray:
        """A rank-0 array of the requested float type (so it broadcasts without reshaping)."""
        return np.array(value, dtype=self.dtype)


Builder = Callable[..., onnx.ModelProto]
Ports = Sequence[Port] | Callable[[Mapping[str, Any]], Sequence[Port]]


@dataclass(frozen=True)
class GraphSpec:
    """One entry of the catalogue."""

    name: str
    build: Builder
    inputs: Ports
    outputs: Ports
    params: Mapping[str, Param] = field(default_factory=dict)
    weighted: bool = False
    min_opset: int = 13
    #: ``weight_name`` is accepted and ignored (a graph with no per-sample term)
    ignores_weight: bool = False

    @property
    def description(self) -> str:
        """The first line of the builder's docstring."""
        return (self.build.__doc__ or "").strip().splitlines()[0]

    def input_ports(self, params: Mapping[str, Any], weighted: bool) -> list[Port]:
        ports = list(self.inputs(params) if callable(self.inputs) else self.inputs)
        if weighted:
            ports.append(tensor(WEIGHT, "N"))
        return ports

    def output_ports(self, params: Mapping[str, Any]) -> list[Port]:
        return list(self.outputs(params) if callable(self.outputs) else self.outputs)


CATALOGUE: dict[str, GraphSpec] = {}


def register(
    name: str,
    *,
    inputs: Ports,
    outputs: Ports,
    params: Mapping[str, Param] | None = None,
    weighted: bool = False,
    min_opset: int = 13,
    ignores_weight: bool = False,
) -> Callable[[Builder], Builder]:
    """Add the decorated builder to :data:`CATALOGUE` under ``name``.

    ``weighted`` says the graph accepts a per-sample weight (``weight_name``); the builder then
    finds ``ctx.weighted`` set and must take a last input named :data:`WEIGHT`;
    ``ignores_weight`` accepts ``weight_name`` and builds the graph without it. Several names
    may share one builder and keep different outputs.
    """

    def decorate(build: Builder) -> Builder:
        if name in CATALOGUE:
            raise RuntimeError(f"graph {name!r} is registered twice")
        CATALOGUE[name] = GraphSpec(
            name, build, inputs, outputs, dict(params or {}), weighted, min_opset, ignores_weight
        )
        return build

    return decorate


def non_negative(name: str, value: Any) -> float:
    """A finite real number >= 0."""
    number = _real(name, value)
    if number < 0:
        raise ValueError(f"option {name!r} must be >= 0, got {value!r}")
    return number


def positive_int(name: str, value: Any) -> int:
    """An integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"option {name!r} must be an integer, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"option {name!r} must be >= 1, got {value!r}")
    return int(value)


def clip_epsilon(name: str, value: Any) -> float:
    """A real number in the open interval (0, 0.5), used to clip probabilities."""
    number = _real(name, value)
    if not 0 < number < 0.5:
        raise ValueError(f"option {name!r} must lie in (0, 0.5), got {value!r}")
    return number


def optional_shape(name: str, value: Any) -> tuple[Dim, ...] | None:
    """``None`` or a sequence of dimensions (int >= 0, symbolic name or None)."""
    return None if value is None else check_shape(name, value)


def check_shape(name: str, value: Any) -> tuple[Dim, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"shape of {name!r} must be a sequence of dimensions, got {value!r}")
    for dim in value:
        valid_int = isinstance(dim, (int, np.integer)) and not isinstance(dim, bool) and dim >= 0
        if not (dim is None or valid_int or (isinstance(dim, str) and dim)):
            raise ValueError(
                f"shape of {name!r} has an invalid dimension {dim!r}: "
                "use an int >= 0, a symbolic name or None"
            )
    return tuple(int(d) if isinstance(d, (int, np.integer)) else d for d in value)


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"option {name!r} must be a real number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"option {name!r} must be finite, got {value!r}")
    return float(value)
