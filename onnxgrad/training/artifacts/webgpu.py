"""Training artifacts for onnxruntime-web's WebGPU execution provider, and the nodes of a
session that onnxruntime places on the CPU instead.

onnxruntime's WebGPU provider has no kernel for the control-flow operators (``Loop``,
``Scan``, ``If``): a node without a kernel runs on the CPU, with its whole body, and every
tensor crossing the border is copied between the GPU and the CPU. The tiled attention
(``recompute="attention"``) is made of ``Loop``s, so artifacts generated with
``target="webgpu"`` compute the attention untiled (plain ``MatMul``/``Softmax``, which
have kernels), every ``Sum`` (no WebGPU kernel: the backward's gradient accumulations)
becomes a chain of ``Add``s, and any control-flow node left is an error naming it.

Placement is read from the session's verbose log (``Node placements`` of
``VerifyEachNodeIsAssignedToAnEp``). A node placed on the CPU counts as a *fallback* when
it reads floating-point data; one whose inputs are all integers or booleans is a
*shape* computation (sizes, indices, the update gate's counters), kept on the CPU by
design (onnxruntime places shape subgraphs there, and int64 tensors are limited on
WebGPU); a node absent from the model was inserted by onnxruntime's own optimizer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import onnx
from onnx import ModelProto, TensorProto

TARGETS = ("cpu", "webgpu")
CONTROL_FLOW = frozenset({"Loop", "Scan", "If"})
FLOAT_TYPES = frozenset(
    {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
)
_PROVIDER = re.compile(r"(?:All nodes|Node\(s\)) placed on \[(\w+)\]\. Number of nodes: (\d+)")
_NODE = re.compile(r"VerifyEachNodeIsAssignedToAnEp\]\s+(\w+) \((.*)\)\s*$")
_SESSION = re.compile(r"onnxgrad-session: (\S+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def check_target(target: str) -> str:
    """``target`` if it is one of :data:`TARGETS`, else a ``ValueError``."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, not {target!r}")
    return target


def recompute_for(target: str, recompute):
    """The ``recompute`` option for ``target``: WebGPU computes the attention untiled
    (tiles are ``Loop``s, which it runs on the CPU)."""
    if target == "webgpu" and recompute == "attention":
        return None
    return recompute


def check_webgpu_model(model: ModelProto, role: str) -> None:
    """A ``ValueError`` naming the first control-flow node of ``model`` (``role``: which
    artifact), since WebGPU would run it and its body on the CPU."""
    for node in model.graph.node:
        if node.op_type in CONTROL_FLOW:
            raise ValueError(
                f"{role}: node {node.name!r} ({node.op_type}) has no WebGPU kernel and would "
                "run on the CPU; generate the artifacts with recompute=None for target='webgpu'"
            )


def sums_as_adds(graph: onnx.GraphProto) -> None:
    """Replace, in place and in order, every ``Sum(x1, ..., xn)`` of ``graph`` and of its
    subgraphs by ``Add(...Add(Add(x1, x2), x3)..., xn)`` (same broadcasting; one input:
    ``Identity``)."""
    taken = {o for node in graph.node for o in node.output} | {n.name for n in graph.node}
    nodes = []
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                sums_as_adds(attribute.g)
        nodes.extend(_add_chain(node, taken) if node.op_type == "Sum" else [node])
    del graph.node[:]
    graph.node.extend(nodes)


def _add_chain(node: onnx.NodeProto, taken: set[str]) -> list[onnx.NodeProto]:
    """The ``Add``s computing ``node`` (a ``Sum``), new names avoiding ``taken``."""
    inputs, output = list(node.input), node.output[0]
    if len(inputs) == 1:
        return [onnx.helper.make_node("Identity", inputs, [output], name=node.name)]
    chain, total = [], inputs[0]
    for i, term in enumerate(inputs[1:], start=1):
        last = i == len(inputs) - 1
        result = output if last else _fresh(f"{output}_add{i}", taken)
        name = _fresh(f"{node.name or output}_add{i}", taken)
        chain.append(onnx.helper.make_node("Add", [total, term], [result], name=name))
        total = result
    return chain


def _fresh(name: str, taken: set[str]) -> str:
    """``name``, or ``name_2``, ``name_3``... whichever is not in ``taken`` (then taken)."""
    candidate, k = name, 2
    while candidate in taken:
        candidate, k = f"{name}_{k}", k + 1
    taken.add(candidate)
    return candidate


@dataclass
class Placement:
    """The CPU-placed nodes of one session, sorted: ``fallbacks`` (float data, the ones
    that count), ``shape`` (integer or boolean outputs, on the CPU by design) and
    ``inserted`` (not in the model: onnxruntime's optimizer made them); each ``(op, name)``."""

    fallbacks: list[tuple[str, str]] = field(default_factory=list)
    shape: list[tuple[str, str]] = field(default_factory=list)
    inserted: list[tuple[str, str]] = field(default_factory=list)
    on_gpu: int = 0


Placed = dict[str, tuple[int, list[tuple[str, str]]]]
"""``{provider: (number of nodes, [(op, name)])}``: the node list is empty when onnxruntime
placed every node on one provider (its log then gives only the number)."""


def parse_placements(lines: Iterable[str]) -> dict[str, Placed]:
    """``{session: Placed}`` from an onnxruntime verbose log; a session is named by the last
    ``onnxgrad-session: NAME`` line before its placements ('' if none)."""
    sessions: dict[str, Placed] = {}
    session, provider = "", None
    for line in (_ANSI.sub("", text) for text in lines):
        if found := _SESSION.search(line):
            session, provider = found.group(1), None
        elif found := _PROVIDER.search(line):
            provider = found.group(1)
            sessions.setdefault(session, {})[provider] = (int(found.group(2)), [])
        elif provider and (found := _NODE.search(line)):
            sessions[session][provider][1].append((found.group(1), found.group(2)))
        elif "Node placements" not in line:
            provider = None
    return sessions


def classify_placement(model: ModelProto, placed: Placed) -> Placement:
    """Sort the CPU nodes of one session of ``model`` (see :class:`Placement`): a node counts
    as a fallback when it reads floating-point data (a tensor of unknown type counts as
    float); one reading only integers or booleans (sizes, indices, counters) is a shape node."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    types, nodes = {}, {}
    for graph in _graphs(inferred.graph):
        types.update(_tensor_types(graph))
        nodes.update((n.name, n) for n in graph.node)
    result = Placement(
        on_gpu=sum(count for name, (count, _) in placed.items() if name != "CPUExecutionProvider")
    )
    for op, name in placed.get("CPUExecutionProvider", (0, []))[1]:
        node = nodes.get(name)
        if node is None:
            result.inserted.append((op, name))
        elif any(types.get(i, TensorProto.FLOAT) in FLOAT_TYPES for i in node.input if i):
            result.fallbacks.append((op, name))
        else:
            result.shape.append((op, name))
    return result


def _graphs(graph: onnx.GraphProto) -> Iterable[onnx.GraphProto]:
    """``graph`` and its subgraphs (a Loop's body: its nodes run where the Loop runs)."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attribute.g)


def _tensor_types(graph: onnx.GraphProto) -> dict[str, int]:
    """Element type of the tensors ``graph`` declares (initializers, inputs, outputs, values)."""
    types = {i.name: i.data_type for i in graph.initializer}
    for value in [*graph.value_info, *graph.input, *graph.output]:
        if value.type.HasField("tensor_type"):
            types[value.name] = value.type.tensor_type.elem_type
    return types


def report_lines(name: str, placement: Placement) -> Sequence[str]:
    """A short human report of one session's placement."""
    lines = [
        f"{name}: {len(placement.fallbacks)} fallback node(s) on the CPU, "
        f"{len(placement.shape)} shape node(s) on the CPU by design, "
        f"{len(placement.inserted)} inserted by onnxruntime, {placement.on_gpu} on the GPU"
    ]
    lines += [f"  fallback  {op:16s} {node}" for op, node in placement.fallbacks]
    lines += [f"  shape     {op:16s} {node}" for op, node in placement.shape]
    lines += [f"  inserted  {op:16s} {node}" for op, node in placement.inserted]
    return lines
