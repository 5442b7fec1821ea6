"""Small helpers shared by every layer: loading, copying, finalising and naming.

Public functions accept an ``onnx.ModelProto`` or a path; they work on a copy and return
models whose IR version onnxruntime-training 1.19.2 accepts (``<= MAX_IR_VERSION``).

Shape inference and the checker serialise the model, which protobuf refuses past 2 GiB and
which copies every weight: :func:`weightless_view` gives them the graph with its big
initializers declared as inputs instead (same names, types and shapes, no data).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterable, Sequence

import numpy as np
import onnx
from onnx import ModelProto, TensorProto, helper

from onnxgrad._external_data import PACKED_TYPES, all_tensors, load_external_data
from onnxgrad._strict_inference import PIECE_NODES, check_in_pieces
from onnxgrad._untrusted import read_bounded

#: The highest IR version onnxruntime-training 1.19.2 loads.
MAX_IR_VERSION = 10
#: The highest default-domain opset onnxruntime-training 1.19.2 loads.
MAX_OPSET = 21
#: The lowest default-domain opset the loss, lowering and training graphs are written for.
MIN_OPSET = 13

ModelLike = ModelProto | str | os.PathLike

FLOAT_TYPES = frozenset(
    {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
)


def load_model(model: ModelLike) -> ModelProto:
    """Return a private copy of ``model`` (a ModelProto or the path of an .onnx file).

    Raises ``TypeError`` for anything else and ``ValueError`` naming the file when it is
    missing or not a valid ONNX model. A file's external data is read from its own folder;
    a ModelProto whose external data was not loaded is a ``ValueError`` naming the tensor.
    """
    if isinstance(model, ModelProto):
        check_external_data_loaded(model)
        copy = ModelProto()
        copy.CopyFrom(model)
        return copy
    if isinstance(model, (str, os.PathLike)):
        return _load_file(os.fspath(model))
    raise TypeError(f"expected an onnx.ModelProto or a path, got {type(model).__name__}")


def _load_file(path: str) -> ModelProto:
    """The model of the file ``path``, read once through a checked descriptor (a regular
    file, below protobuf's 2 GiB), its external data read by onnxgrad itself
    (:mod:`onnxgrad._external_data`: confined to the model's folder)."""
    if not os.path.exists(path):
        raise ValueError(f"model file {path!r} does not exist")
    return model_from_bytes(read_bounded(path, PROTOBUF_LIMIT, "model file"), path)


#: The largest message protobuf parses: models whose serialisation reaches it are saved
#: with external data (:func:`onnxgrad._files.save_model`).
PROTOBUF_LIMIT = 2**31 - 1


def model_from_bytes(
    data: bytes,
    path: str | os.PathLike,
    files: dict[str, bytes] | None = None,
    skipped: Iterable[str] = (),
) -> ModelProto:
    """The model serialised in ``data`` (read from ``path``), its external data read from
    the folder of ``path`` (from ``files``, by name, when given: bytes already read and
    verified) but that of the main-graph initializers ``skipped`` (left external, for a
    caller that replaces them); ``ValueError`` naming ``path`` when it is no ONNX model."""
    path = os.fspath(path)
    try:
        loaded = onnx.load_model_from_string(data)
    except Exception as exc:  # protobuf raises several types
        raise ValueError(f"{path!r} is not a valid ONNX model: {exc}") from exc
    if not loaded.HasField("graph"):
        raise ValueError(f"{path!r} is not a valid ONNX model: it has no graph")
    load_external_data(loaded, os.path.dirname(path) or os.curdir, path, files, skipped)
    return loaded


def check_external_data_loaded(model: ModelProto) -> None:
    """Refuse tensors whose data is still in an external file: resolving it against the
    current folder could silently read an unrelated file of the same name."""
    for tensor in all_tensors(model):
        if tensor.data_location == TensorProto.EXTERNAL:
            location = next((e.value for e in tensor.external_data if e.key == "location"), "?")
            raise ValueError(
                f"tensor {tensor.name!r} keeps its data in the external file {location!r}, "
                "which this ModelProto does not hold (loaded with load_external_data=False?): "
                "pass the model's path instead, or call "
                "onnx.external_data_helper.load_external_data_for_model(model, folder) with "
                "the model's folder first"
            )


def first_float_output(graph: onnx.GraphProto) -> onnx.ValueInfoProto | None:
    """The first output of ``graph`` with a float element type, ``None`` when none has."""
    return next((o for o in graph.output if o.type.tensor_type.elem_type in FLOAT_TYPES), None)


def default_opset(model: ModelProto) -> int:
    """The version of the default ONNX domain the model imports."""
    for op in model.opset_import:
        if op.domain in ("", "ai.onnx"):
            return op.version
    raise ValueError("the model does not import the default ONNX domain")


def finalize_model(model: ModelProto, check: bool = True, infer: bool = True) -> ModelProto:
    """Clamp the IR version to what onnxruntime-training accepts and validate the model.

    Below IR 4 every initializer must also be a graph input, which rewrites do not keep:
    such models are raised to the lowest IR version their opsets allow (at least 4).
    The check is ``check_model(full_check=True)``: the checker, then strict shape inference
    with type checks, so a result that passes here loads in onnxruntime. Both run on a
    weightless view (no weight is copied, models past protobuf's 2 GiB limit are checked
    too), in one call for a small model, one after the other past
    :data:`FULL_CHECK_NODES` (``full_check`` infers on a copy of the checker's model, both
    held at once: 0.5 KB a node more at the peak; :func:`check_strictly`). Past
    :data:`~onnxgrad._strict_inference.PIECE_NODES` nodes both run piece by piece
    (:mod:`onnxgrad._strict_inference`: the same checks, a bounded part of the graph held
    at a time). ``infer=False``: the checker only (the pieces still infer, to type what
    crosses them), for a model whose types follow from a graph the caller inferred strictly.
    """
    model.ir_version = supported_ir_version(model)
    if check:
        check_declared_shapes(model.graph)
        shell = weightless_shell(model) if len(model.graph.node) > PIECE_NODES else None
        if shell is None or not check_in_pieces(shell, model.graph.node):
            view = weightless_bytes(model, shell)
            if infer:
                check_strictly(view, len(model.graph.node))
            else:
                onnx.checker.check_model(view)
    return model


#: Models of at most this many nodes get onnx's checker and its strict inference in one call
#: (``check_model(full_check=True)``: the bytes parsed once, no inferred model serialised
#: back); it holds a copy of the checker's model at once, 0.5 KB a node (0.5 MB here), so
#: larger ones get the two one after the other.
FULL_CHECK_NODES = 1024


def check_strictly(view: bytes, nodes: int) -> None:
    """onnx's checker, then strict shape inference with type checks, of the serialised
    model ``view`` of ``nodes`` nodes: ``ValidationError`` or ``InferenceError``."""
    if nodes <= FULL_CHECK_NODES:
        onnx.checker.check_model(view, full_check=True)
        return
    onnx.checker.check_model(view)
    onnx.shape_inference.infer_shapes(view, check_type=True, strict_mode=True)


def check_declared_shapes(graph: onnx.GraphProto) -> None:
    """``ValueError`` naming an input or output of ``graph`` declared without a shape (an
    unknown rank, which onnxruntime accepts) that no inference filled: onnx's checker
    refuses such a model, and an unnamed checker message is all the user would get."""
    for kind, infos in (("input", graph.input), ("output", graph.output)):
        for info in infos:
            if info.type.HasField("tensor_type") and not info.type.tensor_type.HasField("shape"):
                raise ValueError(
                    f"the model's {kind} {info.name!r} declares no shape and its rank cannot be "
                    "inferred: onnx's checker refuses the result; declare the rank of the "
                    "model's inputs (e.g. [None, None] for a matrix of any size)"
                )


def checker_knows(model: ModelProto) -> bool:
    """Whether onnx's checker can judge ``model``: it refuses the operators onnxruntime's
    tools write in the default domain (``SimplifiedLayerNormalization``), which deployed
    files hold and a rewrite of them keeps."""
    return all(onnx.defs.has(n.op_type) for n in model.graph.node if not normalize_domain(n.domain))


@contextlib.contextmanager
def protobuf_failures_as_memory_errors():
    """Within the block (or the function it decorates), protobuf's ``EncodeError`` and
    ``DecodeError`` (what it raises when it cannot allocate a message, e.g. "Arena alloc
    failed", or when a message passes its 2 GiB limit) are a ``MemoryError`` saying so and
    naming the process's address-space limit, when there is one."""
    from google.protobuf.message import DecodeError, EncodeError

    try:
        yield
    except (DecodeError, EncodeError) as exc:
        raise MemoryError(
            f"protobuf could not hold a model ({exc}): the process ran out of memory"
            f"{_address_space_limit()} or a message passed protobuf's 2 GiB limit"
        ) from None


def _address_space_limit() -> str:
    try:
        import resource
    except ImportError:  # not POSIX
        return ""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return (
        ""
        if soft == resource.RLIM_INFINITY
        else f" (its address space is limited to {soft / 2**30:.3g} GiB)"
    )


@contextlib.contextmanager
def onnx_errors_as_value_errors():
    """Within the block (or the function it decorates), onnx's checker and inference errors
    are one-line ``ValueError`` (onnx's message names the operator and the node or value)."""
    try:
        yield
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        message = " ".join(str(exc).split())
        raise ValueError(f"onnx refuses the model: {message}") from None


def supported_ir_version(model: ModelProto) -> int:
    """The model's IR version clamped to ``[lowest, MAX_IR_VERSION]``, where ``lowest`` (at
    least 4) is the first IR version that allows the opsets the model imports: opsets beyond
    what onnxruntime-training loads (23 and later need IR 11) raise the IR above the clamp."""
    lowest = max(4, helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True))
    return max(min(model.ir_version or MAX_IR_VERSION, MAX_IR_VERSION), lowest)


def make_model_like(graph: onnx.GraphProto, template: ModelProto, **kwargs) -> ModelProto:
    """A model around ``graph`` with the opsets, IR version and metadata of ``template``."""
    model = helper.make_model(
        graph,
        opset_imports=list(template.opset_import),
        ir_version=supported_ir_version(template),
        producer_name=kwargs.pop("producer_name", template.producer_name or "onnxgrad"),
        **kwargs,
    )
    model.functions.extend(template.functions)
    if template.doc_string:
        model.doc_string = template.doc_string
    for prop in template.metadata_props:
        model.metadata_props.add().CopyFrom(prop)
    return model


def all_names(graph: onnx.GraphProto) -> set[str]:
    """Every value name in the graph and its subgraphs (inputs, initializers, node outputs)."""
    names = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    names |= {i.values.name for i in graph.sparse_initializer if i.values.name}
    names |= {o.name for o in graph.output}
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
        if node.attribute:  # most nodes have none, and no subgraph
            for sub in subgraphs(node):
                names |= all_names(sub)
    names.discard("")
    return names


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The subgraphs held by a node's attributes (If branches, Loop/Scan bodies)."""
    attributes = node.attribute
    if not attributes:  # most nodes: a third of the time of an empty loop
        return []
    found = []  # a plain loop: called for every node by most passes
    for attr in attributes:
        if attr.type == onnx.AttributeProto.GRAPH:
            found.append(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            found.extend(attr.graphs)
    return found


class NameScope:
    """Hands out names that do not collide with the ones already used in a graph."""

    def __init__(self, used: Iterable[str] = ()):
        self._used = set(used)
        #: the last suffix handed out for a base: the ones below it are all taken
        self._last: dict[str, int] = {}

    def reserve(self, name: str) -> None:
        self._used.add(name)

    def __contains__(self, name: str) -> bool:
        return name in self._used

    def unique(self, base: str) -> str:
        """``base`` itself if free, otherwise ``base_1``, ``base_2``... (names are never
        released, so the search resumes where the last one for ``base`` stopped)."""
        i = self._last.get(base, 0)
        name = f"{base}_{i}" if i else base
        while name in self._used:
            i += 1
            name = f"{base}_{i}"
        self._used.add(name)
        self._last[base] = i
        return name


@functools.cache  # a few element types, asked for every tensor a build reads or writes
def np_dtype(elem_type: int) -> np.dtype:
    """numpy dtype of an ONNX tensor element type."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def elem_type(dtype) -> int:
    """ONNX tensor element type of a numpy dtype."""
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def zeros_like_nodes(
    source: str, output: str, elem_type: int, values: NameScope, nodes: NameScope | None = None
) -> list[onnx.NodeProto]:
    """``Shape`` then ``ConstantOfShape(0)``: zeros of ``elem_type`` shaped like ``source``,
    written to ``output``; new value and node names come from ``values`` and ``nodes``."""
    nodes = values if nodes is None else nodes
    shape = values.unique(f"{output}_shape")
    zero = onnx.numpy_helper.from_array(np.zeros((1,), dtype=np_dtype(elem_type)))
    return [
        helper.make_node("Shape", [source], [shape], name=nodes.unique(f"{output}_Shape")),
        helper.make_node(
            "ConstantOfShape", [shape], [output], name=nodes.unique(f"{output}_Zeros"), value=zero
        ),
    ]


def normalize_domain(domain: str) -> str:
    """``''`` for the default ONNX domain, however it is spelled."""
    return "" if domain == "ai.onnx" else domain


def is_default_op(node: onnx.NodeProto, *op_types: str) -> bool:
    """Whether ``node`` is one of ``op_types`` of the default ONNX domain."""
    return node.op_type in op_types and not normalize_domain(node.domain)


def reduce_axes_are_input(op_type: str, opset: int) -> bool:
    """Whether ``op_type`` (a Reduce* op) takes its axes as an input at ``opset``: from 13
    for ReduceSum, from 18 for the others; an attribute before."""
    return opset >= (13 if op_type == "ReduceSum" else 18)


class MessageStore:
    """Nodes and value infos made one at a time, kept together in one message: a message
    standing alone has a protobuf arena of its own, about 1.6 KB for a small node that
    takes 0.4 KB among others, which tens of thousands of them multiply."""

    def __init__(self):
        self._graph = onnx.GraphProto()

    def keep(self, message: onnx.NodeProto | onnx.ValueInfoProto):
        """The stored copy of ``message`` (a NodeProto or a ValueInfoProto)."""
        is_node = isinstance(message, onnx.NodeProto)
        field = self._graph.node if is_node else self._graph.value_info
        field.append(message)
        return field[-1]


def copy_message(message):
    """A detached copy of a protobuf message."""
    copy = type(message)()
    copy.CopyFrom(message)
    return copy


def replace_repeated(field, values: Iterable) -> None:
    """Set a repeated message field to ``values`` (its own items, in any order and number,
    and messages from elsewhere), copying only what is not yet in the field.

    Protobuf frees nothing a message drops until the whole message goes, so a rewrite that
    copied every item (1.6 KB for a small node standing alone, 0.4 KB among others) would
    leave a stale copy of the whole list in the message's memory at each rewrite. Instead
    the items from elsewhere are appended (one copy each), the field is permuted into the
    order of ``values`` (``sort`` moves pointers; an item repeated in ``values`` is copied
    for its later places) and what is left over is cut off its end. Items taken out of the
    field stay readable, and a kept item is the message the caller holds, not a copy."""
    values = list(values)
    own = {id(item): item for item in field}  # holds the wrappers: ids stay theirs
    placed: list = []
    foreign: list[int] = []
    for position, value in enumerate(values):
        if id(value) in own:
            placed.append(own.pop(id(value)))
        else:
            placed.append(None)
            foreign.append(position)
    start = len(field)
    field.extend(values[position] for position in foreign)
    for offset, position in enumerate(foreign):
        placed[position] = field[start + offset]
    rank = {id(item): position for position, item in enumerate(placed)}
    field.sort(key=lambda item: rank.get(id(item), len(placed)))
    del field[len(placed) :]


def retain(field, keep: Sequence[bool]) -> None:
    """Keep the items of the repeated message ``field`` whose flag in ``keep`` is true, in
    order, without copying any (see :func:`replace_repeated`)."""
    replace_repeated(field, [item for item, kept in zip(field, keep, strict=True) if kept])


def real_inputs(model: ModelProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs a caller feeds: old exports also list initializers among them."""
    initializers = {init.name for init in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in initializers]


#: Initializers larger than this (in bytes) are left out of weightless views.
WEIGHTLESS_THRESHOLD = 4096


def weightless_view(model: ModelProto) -> ModelProto:
    """A copy of ``model`` whose big initializers are graph inputs of the same type and
    shape: shape inference and the checker give the same answers at a fraction of the
    cost, past protobuf's 2 GiB limit too. Small ones (shapes, axes) stay: inference reads
    their values. The main graph's nodes lose their ``metadata_props``, which neither
    reads (an exporter's notes: torch's stack traces are 95% of a dynamo export's node
    bytes, serialised and parsed again by every check)."""
    left_out = _light_weights(model)
    if left_out is not None:
        return _copied_view(model, left_out)
    view = header_only(model)
    for node in view.graph.node:
        if node.metadata_props:
            node.ClearField("metadata_props")
    _weightless_initializers(model.graph, view.graph)
    view.ir_version = supported_ir_version(model)
    return view


#: A model whose weights (the initializers a weightless view leaves out) hold at most this
#: many bytes in all gets its view as a whole copy less them: protobuf copies the model in
#: one call (a few us for a small one) where the view built field by field costs 40 us.
COPIED_VIEW_BYTES = 1 << 18


def _light_weights(model: ModelProto) -> list[int] | None:
    """The positions of the initializers a weightless view of ``model`` leaves out, where
    they hold at most :data:`COPIED_VIEW_BYTES` and none is external (its view is then
    best made by :func:`_copied_view`); ``None`` otherwise."""
    left_out, size = [], 0
    for index, init in enumerate(model.graph.initializer):
        nbytes = tensor_nbytes(init)
        if _is_external(init):
            return None
        if nbytes > WEIGHTLESS_THRESHOLD:
            left_out.append(index)
            size += nbytes
            if size > COPIED_VIEW_BYTES:
                return None
    return left_out


def _copied_view(model: ModelProto, big: list[int]) -> ModelProto:
    """:func:`weightless_view` of a light model (``big``: :func:`_light_weights`): a whole
    copy, the big initializers then moved to the inputs (the same message as the view
    built field by field: each repeated field's items in the same order)."""
    view = ModelProto()
    view.CopyFrom(model)
    graph = view.graph
    initializers = graph.initializer
    for index in reversed(big):
        del initializers[index]
    for node in graph.node:
        if node.metadata_props:
            node.ClearField("metadata_props")
    declared = {i.name for i in graph.input} if big else ()
    for index in big:
        init = model.graph.initializer[index]
        if init.name not in declared:
            _add_input_like(graph, init)
    view.ir_version = supported_ir_version(model)
    return view


def weightless_bytes(model: ModelProto, shell: ModelProto | None = None) -> bytes:
    """:func:`weightless_view` serialised, without a copy of the nodes (0.4 KB a node in
    memory, 40 bytes serialised; see :func:`model_bytes`): the view less its nodes
    (``shell``, when the caller has it), then a second ``graph`` field holding only the
    nodes, which a parser merges into the first. A light model of at most
    :data:`FULL_CHECK_NODES` nodes (:func:`_light_weights`) gets its copied view
    serialised."""
    left_out = _light_weights(model) if shell is None else None
    if left_out is not None and len(model.graph.node) <= FULL_CHECK_NODES:
        return _copied_view(model, left_out).SerializeToString()
    return model_bytes(weightless_shell(model) if shell is None else shell, model.graph.node)


def model_bytes(shell: ModelProto, nodes: Iterable[onnx.NodeProto], tail: bytes = b"") -> bytes:
    """``shell`` serialised with ``nodes`` after its graph's own, none copied but those with
    ``metadata_props``, one at a time, to leave these out (see :func:`weightless_view`): a
    second ``graph`` field holding only the nodes, which a parser merges into the first,
    then ``tail`` (other serialised fields of a graph: inputs, value infos)."""
    node_key = _field_key(onnx.GraphProto, "node")
    parts = []
    for node in nodes:
        if node.metadata_props:
            light = onnx.NodeProto()
            light.CopyFrom(node)
            light.ClearField("metadata_props")
            node = light
        payload = node.SerializeToString()
        parts += (node_key, _varint(len(payload)), payload)
    parts.append(tail)
    body = b"".join(parts)
    graph_key = _field_key(ModelProto, "graph")
    return b"".join((shell.SerializeToString(), graph_key, _varint(len(body)), body))


def value_info_bytes(field: str, name: str, value_type: bytes) -> bytes:
    """A ``ValueInfoProto`` of ``name`` and the serialised ``TypeProto`` ``value_type``,
    serialised as the item of the repeated field ``field`` of a graph (``input``,
    ``value_info``): the same bytes as the message built and serialised."""
    info = _length_delimited(_INFO_NAME, name.encode()) + _length_delimited(_INFO_TYPE, value_type)
    return _length_delimited(_field_key(onnx.GraphProto, field), info)


def weightless_shell(model: ModelProto) -> ModelProto:
    """:func:`weightless_view` without the nodes (no node copied)."""
    shell = ModelProto()
    for field, value in model.ListFields():
        if field.name != "graph":
            _copy_field(shell, field, value)
    for field, value in model.graph.ListFields():
        if field.name not in ("node", "initializer"):
            _copy_field(shell.graph, field, value)
    _weightless_initializers(model.graph, shell.graph)
    shell.ir_version = supported_ir_version(model)
    return shell


def _weightless_initializers(graph: onnx.GraphProto, view: onnx.GraphProto) -> None:
    """Into ``view``: the small initializers of ``graph``, and an input for each big one."""
    declared = {i.name for i in graph.input}
    for init in graph.initializer:
        if tensor_nbytes(init) <= WEIGHTLESS_THRESHOLD and not _is_external(init):
            view.initializer.add().CopyFrom(init)
        elif init.name not in declared:
            _add_input_like(view, init)


def _add_input_like(graph: onnx.GraphProto, init: TensorProto) -> None:
    """An input of ``graph`` of ``init``'s name, type and shape (make_tensor_value_info's
    fields, built in place)."""
    info = graph.input.add()
    info.name = init.name
    tensor = info.type.tensor_type
    tensor.elem_type = init.data_type
    shape = tensor.shape
    shape.SetInParent()
    for dim in init.dims:
        shape.dim.add().dim_value = dim


@functools.cache  # a few keys, asked for every value info serialised
def _field_key(message_type, field: str) -> bytes:
    """The key of a length-delimited field (wire type 2) of ``message_type``."""
    return _varint(message_type.DESCRIPTOR.fields_by_name[field].number << 3 | 2)


def _length_delimited(key: bytes, payload: bytes) -> bytes:
    return key + _varint(len(payload)) + payload


@functools.lru_cache(maxsize=4096)  # the sizes of nodes, asked for every node serialised
def _varint(value: int) -> bytes:
    """Protobuf's base-128 encoding of a non-negative integer."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_INFO_NAME = _field_key(onnx.ValueInfoProto, "name")
_INFO_TYPE = _field_key(onnx.ValueInfoProto, "type")


def serialized_size(model: ModelProto) -> int:
    """The size of ``model`` serialised, within a few bytes, computed one initializer at a
    time (protobuf's own ``ByteSize`` serialises the whole message to measure it: a
    model-sized allocation)."""
    size = header_only(model).ByteSize()
    for init in model.graph.initializer:
        length = tensor_serialized_size(init)
        size += 1 + _varint_size(length) + length  # the field's tag, length and message
    return size + 8  # the graph's length prefix may grow with its content


def tensor_serialized_size(tensor: TensorProto) -> int:
    """The serialised size of ``tensor``; raw data counted from its dims, ``prod(dims) *
    itemsize`` (``ByteSize`` serialises the whole tensor to measure it: a copy of its data)."""
    nbytes = tensor_nbytes(tensor)
    packed = tensor.data_type in PACKED_TYPES  # two or four to a byte
    if packed or not tensor.HasField("raw_data") or nbytes < _MEASURED_BELOW:
        return tensor.ByteSize()
    return tensor_header(tensor).ByteSize() + 1 + _varint_size(nbytes) + nbytes


def tensor_header(tensor: TensorProto) -> TensorProto:
    """A copy of ``tensor`` without its raw data (never read: reading a bytes field copies
    it)."""
    header = TensorProto()
    for field in TensorProto.DESCRIPTOR.fields:
        if field.name == "raw_data":
            continue
        value = getattr(tensor, field.name)
        if hasattr(value, "extend"):
            getattr(header, field.name).extend(value)
        elif tensor.HasField(field.name):
            if hasattr(value, "CopyFrom"):
                getattr(header, field.name).CopyFrom(value)
            else:
                setattr(header, field.name, value)
    return header


#: Tensors smaller than this are measured by protobuf itself.
_MEASURED_BELOW = 1 << 16


def _varint_size(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def without_initializers(model: ModelProto, names: Iterable[str] = ()) -> ModelProto:
    """A copy of ``model`` without the main-graph initializers ``names``, made without copying
    their data.

    Rewriting a message in place never frees what it drops (protobuf keeps it in the
    message's arena until the whole message goes): a model whose weights were removed in
    place still holds them. With ``names`` empty this is the compact copy of such a model.
    """
    dropped = set(names)
    copy = ModelProto()
    for field, value in model.ListFields():
        if field.name != "graph":
            _copy_field(copy, field, value)
    for field, value in model.graph.ListFields():
        if field.name != "initializer":
            _copy_field(copy.graph, field, value)
    copy.graph.initializer.extend(i for i in model.graph.initializer if i.name not in dropped)
    return copy


def header_only(model: ModelProto) -> ModelProto:
    """A copy of ``model`` without any main-graph initializer (none of their data copied)."""
    return without_initializers(model, (init.name for init in model.graph.initializer))


def _copy_field(target, field, value) -> None:
    if hasattr(value, "extend"):
        getattr(target, field.name).extend(value)
    elif hasattr(value, "CopyFrom"):
        getattr(target, field.name).CopyFrom(value)
    else:
        setattr(target, field.name, value)


def tensor_nbytes(tensor: TensorProto) -> int:
    """The size of a tensor's data (0 for strings and unknown types)."""
    if tensor.data_type in (TensorProto.STRING, TensorProto.UNDEFINED):
        return 0
    try:
        itemsize = np_dtype(tensor.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        return 0
    return math.prod(tensor.dims) * itemsize


def _is_external(tensor: TensorProto) -> bool:
    return tensor.data_location == TensorProto.EXTERNAL
