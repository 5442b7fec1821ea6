"""What a gradient rule sees: the forward node (:class:`NodeView`) and a builder of new
nodes (:class:`GradBuilder`) that knows types, shapes and the opset."""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping, MutableMapping, Sequence

import numpy as np
from onnx import (
    AttributeProto,
    FunctionProto,
    GraphProto,
    NodeProto,
    TensorProto,
    helper,
    numpy_helper,
)

from onnxgrad._onnx_utils import NameScope, np_dtype, reduce_axes_are_input
from onnxgrad.derivative.autodiff.rules._shape_helpers import reshape_to
from onnxgrad.derivative.autodiff.value_types import (
    UnknownTypeError,
    ValueType,
    constant_tensors,
    infer_subgraph_types,
)
from onnxgrad.graph._scopes import node_inputs


class NodeView:
    """Read-only view of a forward node: inputs (``''`` when omitted), outputs, attributes."""

    def __init__(self, proto: NodeProto, opset: int):
        self.proto = proto
        self.opset = opset
        self.op_type = proto.op_type
        self.domain = proto.domain
        self.name = proto.name
        self.inputs = list(proto.input)
        self.outputs = list(proto.output)
        self._attributes = {a.name: a for a in proto.attribute}
        self._captured: list[str] | None = None

    @property
    def captured(self) -> list[str]:
        """Outer-scope values its subgraphs read (If branches, Loop and Scan bodies), sorted;
        a rule receives ``needs`` and returns gradients for ``inputs + captured``."""
        if self._captured is None:
            self._captured = (
                sorted(node_inputs(self.proto) - set(self.inputs) - {""})
                if self._attributes  # no attribute, no subgraph
                else []
            )
        return self._captured

    def input(self, index: int) -> str | None:
        """Name of input ``index``, or ``None`` when it is absent or omitted."""
        if index < len(self.inputs) and self.inputs[index]:
            return self.inputs[index]
        return None

    def attr(self, name: str, default=None):
        """Python value of an attribute (strings decoded), or ``default``."""
        if name not in self._attributes:
            return default
        value = helper.get_attribute_value(self._attributes[name])
        if isinstance(value, bytes):
            return value.decode()
        if isinstance(value, list) and value and isinstance(value[0], bytes):
            return [v.decode() for v in value]
        return value

    def has_attr(self, name: str) -> bool:
        return name in self._attributes

    def __repr__(self) -> str:
        return f"{self.op_type}({', '.join(self.inputs)}) -> {', '.join(self.outputs)}"


def new_node(
    nodes,
    op_type: str,
    inputs: list[str],
    outputs: list[str],
    name: str,
    attrs: Mapping[str, object],
) -> NodeProto:
    """``helper.make_node(op_type, inputs, outputs, name=name, **attrs)`` (attributes of value
    ``None`` left out) made in place in the repeated field ``nodes`` (a message standing alone
    has a protobuf arena of its own, about 1.6 KB for a small node that takes 0.4 KB among
    others), at a fraction of its cost for plain ints, floats, strings and int lists."""
    node = nodes.add(op_type=op_type, input=inputs, output=outputs, name=name)
    for key in sorted(attrs):
        value = attrs[key]
        if value is not None:
            add_attribute(node.attribute, key, value)
    return node


def add_attribute(attributes, name: str, value) -> None:
    """``helper.make_attribute(name, value)`` added to ``attributes`` (a node's repeated
    field), made in place for ints, bools, floats, strings and int lists (a message made
    apart is copied when appended: twice the time)."""
    kind = type(value)
    if kind is int or kind is bool:
        attributes.add(name=name, type=AttributeProto.INT, i=int(value))
    elif kind is float:
        attributes.add(name=name, type=AttributeProto.FLOAT, f=value)
    elif kind is str:
        attributes.add(name=name, type=AttributeProto.STRING, s=value.encode())
    elif (kind is list or kind is tuple) and value and all(type(v) is int for v in value):
        attributes.add(name=name, type=AttributeProto.INTS, ints=value)
    else:
        attributes.append(helper.make_attribute(name, value))


class GraphEmitter:
    """The gradient nodes under construction, with unique names and known value types."""

    def __init__(
        self,
        scope: NameScope,
        types: MutableMapping[str, ValueType],
        opset: int,
        constants: Mapping[str, TensorProto] | None = None,
        node_names: NameScope | None = None,
        opsets: Mapping[str, int] | None = None,
        functions: Sequence[FunctionProto] = (),
    ):
        self.scope = scope
        self.node_names = node_names if node_names is not None else NameScope()
        self.types = types
        self.opset = opset
        #: every domain the model imports, and its local functions (for the function fallback)
        self.opsets = dict(opsets) if opsets else {"": opset}
        self.functions = tuple(functions)
        self.nodes: list[NodeProto] = []
        self._store = GraphProto()  # holds self.nodes
        self._constants: dict[tuple, str] = {}
        self._constant_tensors: MutableMapping[str, TensorProto] = dict(constants or {})
        self._constant_values: MutableMapping[str, np.ndarray] = {}
        #: ``(graph, emitter) -> engine`` for subgraphs, set by the engine that owns this
        #: emitter (the engine imports this module, not the other way round)
        self.subgraph_engine = None

    def child(self) -> GraphEmitter:
        """An emitter for a subgraph: its own nodes, the same value and node names, and its
        own layer of types and constants over this emitter's.

        A subgraph sees the values of its enclosing scopes, never those of a sibling (two If
        branches, or two bodies, may each define a Constant or an intermediate of the same
        name): what it records stays in its layer.
        """
        child = GraphEmitter(
            self.scope,
            ChainMap({}, self.types),
            self.opset,
            node_names=self.node_names,
            opsets=self.opsets,
            functions=self.functions,
        )
        child._constant_tensors = ChainMap({}, self._constant_tensors)
        child._constant_values = ChainMap({}, self._constant_values)
        child.subgraph_engine = self.subgraph_engine
        return child

    @property
    def constants(self) -> Mapping[str, TensorProto]:
        """The tensors of the values known to be constant (initializers, Constant outputs)."""
        return self._constant_tensors

    def add_constants(self, tensors: Mapping[str, TensorProto]) -> None:
        """Record the constants of a subgraph (its Constant outputs and initializers)."""
        for name, tensor in tensors.items():
            self._constant_tensors.setdefault(name, tensor)

    def constant_value(self, name: str) -> np.ndarray | None:
        """The value of a constant (a non-differentiated initializer or a Constant output)."""
        if name not in self._constant_values:
            tensor = self._constant_tensors.get(name)
            if tensor is None:
                return None
            self._constant_values[name] = numpy_helper.to_array(tensor)
        return self._constant_values[name]

    def emit(
        self, op_type: str, inputs: Sequence[str | None], n_outputs: int, prefix: str, attrs: dict
    ) -> list[str]:
        outputs = [self.scope.unique(f"{prefix}{op_type}_out{i}") for i in range(n_outputs)]
        name = self.node_names.unique(f"{prefix}{op_type}")
        clean_inputs = ["" if i is None else i for i in inputs]
        while clean_inputs and clean_inputs[-1] == "":
            clean_inputs.pop()
        self.nodes.append(new_node(self._store.node, op_type, clean_inputs, outputs, name, attrs))
        return outputs

    def constant(self, value: np.ndarray, prefix: str) -> str:
        """A ``Constant`` node (not an initializer, so the result is never taken for a weight)."""
        value = np.asarray(value, order="C")
        key = (value.dtype.str, value.shape, value.tobytes())
        if key in self._constants:
            return self._constants[key]
        name = self.scope.unique(f"{prefix}cst")
        tensor = numpy_helper.from_array(value, name=name)
        node_name = self.node_names.unique(f"{prefix}Constant")
        node = new_node(self._store.node, "Constant", [], [name], node_name, {"value": tensor})
        self.nodes.append(node)
        self.types[name] = ValueType(tensor.data_type, value.shape)
        self._constants[key] = name
        self._constant_values[name] = value
        return name


class GradBuilder:
    """Emits the gradient nodes of one forward node under the ``<node>_Grad/`` prefix.

    Opset-aware helpers hide the attribute-to-input moves of Reduce*/Squeeze/Unsqueeze/Split.
    """

    def __init__(self, emitter: GraphEmitter, prefix: str):
        self._emitter = emitter
        self.prefix = prefix
        self.opset = emitter.opset

    # -- emission ---------------------------------------------------------------------------
    def op(self, op_type: str, *inputs: str | None, outputs: int = 1, **attrs):
        """Emit one default-domain node; returns its output name (a list if ``outputs > 1``)."""
        names = self._emitter.emit(op_type, inputs, outputs, self.prefix, attrs)
        return names[0] if outputs == 1 else names

    def const(self, value, like: str | None = None, dtype=None) -> str:
        """A constant tensor, with the element type of value ``like`` or ``dtype``."""
        if like is not None:
            dtype = np_dtype(self.dtype(like))
        array = np.asarray(value, dtype=dtype)
        return self._emitter.constant(array, self.prefix)

    def constant_value(self, name: str) -> np.ndarray | None:
        """The value of ``name`` if it is a constant (never a differentiated input)."""
        return self._emitter.constant_value(name)

    @property
    def names(self) -> NameScope:
        """The value names of the whole model (for nodes built outside :meth:`op`)."""
        return self._emitter.scope

    @property
    def node_names(self) -> NameScope:
        """The node names of the whole model."""
        return self._emitter.node_names

    def unique_name(self, base: str) -> str:
        """A value name free in the whole model, under this node's prefix."""
        return self._emitter.scope.unique(f"{self.prefix}{base}")

    def unique_node_name(self, base: str) -> str:
        """A node name free in the whole model, under this node's prefix."""
        return self._emitter.node_names.unique(f"{self.prefix}{base}")

    def differentiate_subgraph(
        self, graph: GraphProto, sources: Sequence[str], seeds: dict[str, str]
    ) -> tuple[list[NodeProto], dict[str, str | None]]:
        """Backward nodes of a subgraph: ``{source: gradient}`` for outer-scope ``sources``
        given gradients ``seeds`` of its outputs (outer-scope names too)."""
        emitter = self._emitter.child()
        emitter.add_constants(constant_tensors(graph, ()))
        infer_subgraph_types(graph, emitter.types, self.opset, emitter.constants)
        engine = self._emitter.subgraph_engine(graph, emitter)
        gradients = engine.gradients(sources, seeds)
        return engine.emitted_nodes, gradients

    def declare(self, name: str, value: ValueType) -> None:
        """Record the type of a value built outside :meth:`op` (a subgraph's input)."""
        self._emitter.types[name] = value

    def emit_nodes(self, nodes: Sequence[NodeProto]) -> None:
        """Append nodes built elsewhere (their value and node names taken from :attr:`names`
        and :attr:`node_names`)."""
        self._emitter.nodes.extend(nodes)

    def ints(self, values: Sequence[int] | int) -> str:
        """An int64 constant (axes, shapes, indices): 1-D for a sequence, 0-D for an int."""
        return self._emitter.constant(np.asarray(values, dtype=np.int64), self.prefix)

    # -- types ------------------------------------------------------------------------------
    def has_type(self, name: str) -> bool:
        """Whether ``name`` is a tensor of known type (not an optional, a sequence, or a
        value shape inference could not type)."""
        return name in self._emitter.types

    def value_type(self, name: str) -> ValueType:
        if name not in self._emitter.types:
            raise UnknownTypeError(name, self._emitter.types)
        return self._emitter.types[name]

    def dtype(self, name: str) -> int:
        """ONNX element type of a forward value (or of a gradient: same as its value)."""
        return self.value_type(name).elem_type

    def shape(self, name: str) -> tuple[int | str | None, ...] | None:
        """Shape (ints, symbolic names, ``None`` unknown) or ``None`` when the rank is unknown."""
        value = self._emitter.types.get(name)
        return None if value is None else value.shape

    def rank(self, name: str) -> int | None:
        shape = self.shape(name)
        return None if shape is None else len(shape)

    def static_shape(self, name: str) -> tuple[int, ...] | None:
        """The shape if every dimension is known, else ``None``."""
        shape = self.shape(name)
        if shape is None or not all(isinstance(d, int) for d in shape):
            return None
        return tuple(shape)

    # -- opset-aware helpers ----------------------------------------------------------------
    def shape_of(self, x: str) -> str:
        return self.op("Shape", x)

    def zeros_like(self, x: str) -> str:
        return self.op("ConstantOfShape", self.shape_of(x), value=self._scalar_tensor(0, x))

    def ones_like(self, x: str) -> str:
        return self.op("ConstantOfShape", self.shape_of(x), value=self._scalar_tensor(1, x))

    def _scalar_tensor(self, value, like: str) -> TensorProto:
        return numpy_helper.from_array(np.array([value], dtype=np_dtype(self.dtype(like))))

    def reduce(self, op_type: str, x: str, axes: Sequence[int] | str | None, keepdims: bool):
        """``Reduce*`` over ``axes`` (a list, the name of an int64 tensor, or None for all)."""
        if axes is None:
            return self.op(op_type, x, keepdims=int(keepdims))
        if reduce_axes_are_input(op_type, self.opset):
            axes_input = axes if isinstance(axes, str) else self.ints(list(axes))
            return self.op(op_type, x, axes_input, keepdims=int(keepdims))
        if isinstance(axes, str):
            raise NotImplementedError(
                f"{op_type} with dynamic axes needs a newer opset than {self.opset}"
            )
        return self.op(op_type, x, axes=list(axes), keepdims=int(keepdims))

    def reduce_sum(self, x: str, axes: Sequence[int] | str | None, keepdims: bool = True) -> str:
        return self.reduce("ReduceSum", x, axes, keepdims)

    def unsqueeze(self, x: str, axes: Sequence[int] | str) -> str:
        if self.opset >= 13:
            return self.op("Unsqueeze", x, axes if isinstance(axes, str) else self.ints(axes))
        return self.op("Unsqueeze", x, axes=list(axes))

    def squeeze(self, x: str, axes: Sequence[int] | str) -> str:
        if self.opset >= 13:
            return self.op("Squeeze", x, axes if isinstance(axes, str) else self.ints(axes))
        return self.op("Squeeze", x, axes=list(axes))

    def add(self, a: str, b: str) -> str:
        return self.op("Add", a, b)

    def mul(self, a: str, b: str) -> str:
        return self.op("Mul", a, b)

    def neg(self, a: str) -> str:
        return self.op("Neg", a)

    def mask(self, condition: str, g: str) -> str:
        """``g`` where ``condition`` holds, 0 elsewhere, as ``g * Cast(condition)``: the same
        values as ``Where(condition, g, 0)`` for finite ``g``, and several times faster in
        onnxruntime, whose ``Where`` kernel is slow."""
        return self.mul(g, self.op("Cast", condition, to=self.dtype(g)))

    def unbroadcast(self, grad: str, target: str, grad_shape: tuple | None) -> str:
        """Sum ``grad`` (of static shape ``grad_shape``, possibly unknown) down to the shape
        of ``target``, undoing numpy-style broadcasting with standard ops only."""
        return unbroadcast(self, grad, target, grad_shape)


def unbroadcast(b: GradBuilder, grad: str, target: str, grad_shape: tuple | None) -> str:
    """Reduce a broadcast gradient to ``target``'s shape.

    Leading axes that ``target`` lacks are summed away; then every axis where ``target`` has
    size 1 is summed with ``keepdims=1`` (a no-op where the gradient has size 1 too). When
    every axis can be decided from the shapes (known sizes, equal symbolic names) the axes
    are constants; otherwise they are computed with ``Shape``/``Equal``/``NonZero``, and the
    sum is expanded to ``Shape(target)``: a no-op on the values (the sum has that shape), but
    onnxruntime 1.19 sums an empty tensor over an empty list of axes into ones, ``(0, 3) ->
    (1, 1)``, whose zeros the Expand spreads back to ``(0, 3)`` (the target is empty there:
    no axis summed means the target's sizes are the gradient's). It copies the gradient
    where no axis is summed (+90 us on 8x128x256 floats, 1 thread).
    """
    target_shape = b.shape(target)
    axes = _static_reduction_axes(grad_shape, target_shape)
    if axes is None:
        return _dynamic_unbroadcast(b, grad, target, grad_shape, target_shape)
    if not axes:
        return grad
    lead = len(grad_shape) - len(target_shape)
    if axes == list(range(lead)):
        return b.reduce_sum(grad, axes, keepdims=False)
    reduced = b.reduce_sum(grad, axes, keepdims=True)
    if lead == 0:
        return reduced
    if all(isinstance(d, int) for d in target_shape):
        return b.op("Reshape", reduced, b.ints(list(target_shape)))
    return reshape_to(b, reduced, b.shape_of(target))


def _static_reduction_axes(grad_shape: tuple | None, target_shape: tuple | None):
    """The axes to sum, or ``None`` when the shapes cannot decide it."""
    if grad_shape is None or target_shape is None or len(grad_shape) < len(target_shape):
        return None
    lead = len(grad_shape) - len(target_shape)
    axes = list(range(lead))
    for i, dim in enumerate(target_shape):
        other = grad_shape[lead + i]
        if dim == 1:
            if other != 1:
                axes.append(lead + i)
        elif dim is None or (dim != other and not isinstance(dim, int)):
            return None
    return axes


def _dynamic_unbroadcast(b, grad, target, grad_shape, target_shape) -> str:
    if b.opset < 13:
        raise NotImplementedError(
            f"undoing the broadcast of {target!r} with unknown shapes needs opset >= 13 "
            f"(ReduceSum with an axes input), the model has opset {b.opset}"
        )
    if grad_shape is not None and target_shape is not None:
        lead = len(grad_shape) - len(target_shape)
        if lead > 0:
            grad = b.reduce_sum(grad, list(range(lead)), keepdims=False)
    else:
        rank_gap = b.op("Sub", b.op("Size", b.shape_of(grad)), b.op("Size", b.shape_of(target)))
        lead_axes = b.op("Range", b.ints(0), rank_gap, b.ints(1))
        grad = b.op("ReduceSum", grad, lead_axes, keepdims=0, noop_with_empty_axes=1)
    target_dims = b.shape_of(target)
    ones = b.op("Equal", target_dims, b.ints(1))
    axes = b.op("Reshape", b.op("NonZero", ones), b.ints([-1]))
    summed = b.op("ReduceSum", grad, axes, keepdims=1, noop_with_empty_axes=1)
    return b.op("Expand", summed, target_dims)
