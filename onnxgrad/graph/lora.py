"""Low-rank adapters (LoRA): fine-tune a few parameters of a large weight, merge them back.

:func:`add_lora` replaces every use of a weight ``W`` (``d0 x d1 x ...``, read by
``MatMul``, ``Gemm`` or ``Conv``) with

    W_lora = W + s * reshape(A @ B, shape(W)),   A: d0 x r,  B: r x (d1 * d2 * ...)

``s = alpha / r``; ``A`` starts random (``N(0, 1/d0)``), ``B`` at zero, so the adapted model
computes exactly what the original did until ``A`` and ``B`` are trained, ``W`` frozen. Over a
float16 or bfloat16 ``W`` they are float32 master weights (the product cast to ``W``'s type),
else of ``W``'s type. One
formula covers a ``MatMul`` weight (``K x N``), a ``Gemm`` one (transposed or not) and a
convolution kernel (``C_out x C_in/g x k1 x k2``). :func:`merge_lora` folds trained adapters
into ``W`` and removes them: the result has the original graph and the adapted outputs.

Quantized weights (``MatMulNBits``, ``QLinearMatMul``, QDQ) get float adapters over their
frozen dequantized value (QLoRA, :mod:`onnxgrad.graph.qlora`); :func:`merge_lora` keeps
those adapters separate or, asked to, folds them and re-quantizes the base in its own
format (:mod:`onnxgrad.graph.requantize`).

The adapters are listed in the model's metadata (key :data:`LORA_METADATA`, JSON).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import numpy as np
from onnx import ModelProto, TensorProto, helper, numpy_helper

from onnxgrad._model_checks import check_structure
from onnxgrad._onnx_utils import (
    FLOAT_TYPES,
    ModelLike,
    NameScope,
    all_names,
    finalize_model,
    load_model,
    np_dtype,
    subgraphs,
)
from onnxgrad.graph.qlora import dequantized_weights, lowered_if_quantized
from onnxgrad.graph.requantize import quantized_formats, requantize

LORA_METADATA = "onnxgrad.lora"
#: the operators whose weight input (index 1, or 0 and 1 for Gemm) can get an adapter
ADAPTED_OPS = {"MatMul": (1,), "Gemm": (0, 1), "Conv": (1,)}


def add_lora(
    model: ModelLike,
    weights: Sequence[str] | None = None,
    rank: int = 4,
    alpha: float | None = None,
    seed: int = 0,
) -> ModelProto:
    """A copy of ``model`` where each weight of ``weights`` (default: every float
    initializer of rank >= 2 that a MatMul, Gemm or Conv reads) gets a rank-``rank`` adapter
    (see the module docstring; ``alpha`` defaults to ``rank``, so ``s = 1``).

    The adapter initializers are named ``<W>_lora_A`` and ``<W>_lora_B``; train those only.
    """
    model = load_model(model)
    formats = quantized_formats(model)
    model = lowered_if_quantized(model)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    scale = float(rank if alpha is None else alpha) / int(rank)
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    targets = _adaptable_weights(model, initializers)
    quantized = dequantized_weights(model)
    targets |= set(quantized)
    existing = lora_adapters(model)
    adapter_parts = {adapter[key] for adapter in existing for key in ("a", "b")}
    if weights is None:
        adapted = adapter_parts | {adapter["weight"] for adapter in existing}
        chosen = sorted(set(targets) - adapted)
        if not chosen:
            raise ValueError("the model has no MatMul, Gemm or Conv weight to adapt")
    else:
        if isinstance(weights, str):
            raise TypeError(f"weights must be a list of names, not the string {weights!r}")
        chosen = list(weights)
        parts = sorted(set(chosen) & adapter_parts)
        if parts:
            raise ValueError(f"{parts} are adapters of an earlier add_lora, not weights to adapt")
        again = sorted(set(chosen) & {a["weight"] for a in existing})
        if again:
            raise ValueError(f"weights {again} already have an adapter")
        for name in chosen:
            _check_target(name, initializers, targets)
    rng = np.random.default_rng(seed)
    names = NameScope(all_names(graph))
    node_names = NameScope(n.name for n in graph.node if n.name)
    new_nodes, adapters = [], list(existing)
    for weight in chosen:
        base = initializers[weight]
        read = weight
        if weight in quantized:
            read, shape, elem = quantized[weight]
            base = TensorProto(name=weight, dims=shape, data_type=elem)
        nodes, adapter = _adapter(base, int(rank), scale, rng, names, node_names, graph, read)
        if weight in formats:
            adapter["quantized"] = formats[weight]
        new_nodes.extend(nodes)
        adapters.append(adapter)
        _rewire(graph, read, adapter["output"], skip=set(adapter["nodes"]))
    nodes = new_nodes + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    if quantized:
        check_structure(model)  # an adapter of a dequantized value follows its producer
    _set_adapters(model, adapters)
    return finalize_model(model)


def lora_adapters(model: ModelProto) -> list[dict]:
    """The adapters :func:`add_lora` recorded in ``model`` (``[]`` when none): dicts with
    the keys ``weight``, ``a``, ``b``, ``scale``, ``output`` and ``nodes``."""
    for prop in model.metadata_props:
        if prop.key == LORA_METADATA:
            return json.loads(prop.value)
    return []


def merge_lora(model: ModelLike, quantized: str = "keep") -> ModelProto:
    """A copy of ``model`` whose adapters are folded into their weights,
    ``W <- W + s * reshape(A @ B, shape(W))`` (computed in float64), and removed.

    ``quantized`` says what becomes of the adapters of quantized weights: ``"keep"`` leaves
    them as they are, over the untouched quantized base (a small adapter beside the
    original codes); ``"requantize"`` folds them too and quantizes ``W + s A B`` again in
    the base's format (same bits, blocks, axis, symmetric or not:
    :mod:`onnxgrad.graph.requantize`), each value within half a quantization step."""
    if quantized not in ("keep", "requantize"):
        raise ValueError(f"quantized must be 'keep' or 'requantize', got {quantized!r}")
    model = load_model(model)
    adapters = lora_adapters(model)
    if not adapters:
        return model
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    outputs = {o.name for o in graph.output}
    folded = adapters if quantized == "requantize" else [a for a in adapters if "value" not in a]
    requantized = []
    for adapter in folded:
        _check_adapter(adapter, initializers)
        if adapter["output"] in outputs:
            raise ValueError(f"adapter output {adapter['output']!r} is a graph output")
        a = numpy_helper.to_array(initializers[adapter["a"]]).astype(np.float64)
        b = numpy_helper.to_array(initializers[adapter["b"]]).astype(np.float64)
        update = adapter["scale"] * (a @ b)
        if "value" in adapter:
            requantized.append((adapter, update))
        else:
            base = numpy_helper.to_array(initializers[adapter["weight"]])
            merged = base.astype(np.float64) + update.reshape(base.shape)
            initializers[adapter["weight"]].CopyFrom(
                numpy_helper.from_array(merged.astype(base.dtype), name=adapter["weight"])
            )
        removed = set(adapter["nodes"])
        kept = [n for n in graph.node if n.name not in removed]
        del graph.node[:]
        graph.node.extend(kept)
        _rewire(graph, adapter["output"], adapter.get("value", adapter["weight"]), skip=set())
        for name in (adapter["a"], adapter["b"]):
            graph.initializer.remove(initializers.pop(name))
    if requantized:
        requantize(model, requantized)
    _set_adapters(model, [a for a in adapters if a not in folded])
    return finalize_model(model)


def _check_adapter(adapter: object, initializers: dict) -> None:
    """``ValueError`` unless ``adapter`` (read from the model's metadata) names a weight ``W``
    and adapters ``A [rows, r]``, ``B [r, cols]`` with ``rows * cols`` the size of ``W``,
    checked on the declared dims before anything is computed."""
    keys = {"weight": str, "a": str, "b": str, "output": str, "scale": (int, float)}
    if not isinstance(adapter, dict) or not all(
        isinstance(adapter.get(k), t) and not isinstance(adapter.get(k), bool)
        for k, t in keys.items()
    ):
        raise ValueError(f"the model's LoRA metadata holds a malformed adapter: {adapter!r:.200}")
    if not isinstance(adapter.get("value", ""), str):
        raise ValueError(f"adapter of {adapter['weight']!r}: 'value' must be a name")
    nodes = adapter.get("nodes")
    if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
        raise ValueError(f"adapter of {adapter['weight']!r}: 'nodes' must be a list of names")
    missing = [adapter[k] for k in ("weight", "a", "b") if adapter[k] not in initializers]
    if missing:
        raise ValueError(f"adapter of {adapter['weight']!r}: no initializer {missing}")
    weight, a, b = (list(initializers[adapter[k]].dims) for k in ("weight", "a", "b"))
    rows, cols = (weight[0], math.prod(weight[1:])) if weight else (0, 0)
    if "value" in adapter and len(a) == 2:  # the update has the dequantized value's shape
        rows, cols = a[0], b[-1] if b else 0
    if len(a) != 2 or len(b) != 2 or a[1] != b[0] or (a[0], b[1]) != (rows, cols):
        raise ValueError(
            f"adapter of {adapter['weight']!r} {weight}: A {adapter['a']!r} {a} @ B "
            f"{adapter['b']!r} {b} does not give a [{rows}, {cols}] update"
        )


def _adaptable_weights(model: ModelProto, initializers) -> set[str]:
    found = set()
    for node in model.graph.node:
        for index in ADAPTED_OPS.get(node.op_type, ()) if node.domain in ("", "ai.onnx") else ():
            if index < len(node.input) and node.input[index] in initializers:
                init = initializers[node.input[index]]
                if init.data_type in FLOAT_TYPES and len(init.dims) >= 2:
                    found.add(init.name)
    return found


def _check_target(name: str, initializers, targets: set[str]) -> None:
    if name not in initializers:
        raise ValueError(f"{name!r} is not an initializer of the model")
    if name not in targets:
        raise ValueError(
            f"initializer {name!r} is no float weight of rank >= 2 read by "
            f"{'/'.join(ADAPTED_OPS)}: it cannot get a low-rank adapter"
        )


def _adapter(init, rank, scale, rng, names, node_names, graph, read=None):
    """The nodes computing ``W + s reshape(A @ B)`` and the adapter's record; ``W`` is
    ``read`` (a dequantized value) when given, else the initializer ``init``."""
    shape = tuple(init.dims)
    rows, cols = shape[0], int(np.prod(shape[1:], dtype=np.int64))
    dtype = np_dtype(init.data_type)
    half = init.data_type in (TensorProto.FLOAT16, TensorProto.BFLOAT16)
    if half:
        dtype = np.dtype(np.float32)
    a = names.unique(f"{init.name}_lora_A")
    b = names.unique(f"{init.name}_lora_B")
    graph.initializer.extend(
        [
            numpy_helper.from_array(
                (rng.standard_normal((rows, rank)) / np.sqrt(rows)).astype(dtype), name=a
            ),
            numpy_helper.from_array(np.zeros((rank, cols), dtype=dtype), name=b),
        ]
    )
    value = {k: names.unique(f"{init.name}_lora_{k}") for k in ("AB", "scale", "delta", "shape")}
    output = names.unique(f"{init.name}_lora")

    def node(op, inputs, out, **attrs):
        return helper.make_node(
            op, inputs, [out], name=node_names.unique(f"{init.name}_lora_{op}"), **attrs
        )

    nodes = [
        node("MatMul", [a, b], value["AB"]),
        node(
            "Constant",
            [],
            value["scale"],
            value=numpy_helper.from_array(np.array(scale, dtype=dtype)),
        ),
        node("Mul", [value["AB"], value["scale"]], value["delta"]),
    ]
    delta = value["delta"]
    if half:
        narrowed = names.unique(f"{init.name}_lora_cast")
        nodes.append(node("Cast", [delta], narrowed, to=init.data_type))
        delta = narrowed
    if len(shape) != 2:
        nodes.append(
            node(
                "Constant",
                [],
                value["shape"],
                value=numpy_helper.from_array(np.array(shape, dtype=np.int64)),
            )
        )
        reshaped = names.unique(f"{init.name}_lora_reshaped")
        nodes.append(node("Reshape", [delta, value["shape"]], reshaped))
        delta = reshaped
    nodes.append(node("Add", [read or init.name, delta], output))
    record = {
        "weight": init.name,
        **({"value": read} if read and read != init.name else {}),
        "a": a,
        "b": b,
        "scale": scale,
        "output": output,
        "nodes": [n.name for n in nodes],
    }
    return nodes, record


def _rewire(graph, old: str, new: str, skip: set[str]) -> None:
    """Make every node of ``graph`` (but ``skip``) read ``new`` instead of ``old``."""
    for node in graph.node:
        if node.name in skip:
            continue
        if any(old in _names_used(g) for g in subgraphs(node)):
            raise ValueError(f"weight {old!r} is read inside a subgraph of node {node.name!r}")
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new


def _names_used(graph) -> set[str]:
    used = {name for node in graph.node for name in node.input}
    for node in graph.node:
        for sub in subgraphs(node):
            used |= _names_used(sub)
    return used


def _set_adapters(model: ModelProto, adapters: list[dict]) -> None:
    kept = [p for p in model.metadata_props if p.key != LORA_METADATA]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    if adapters:
        model.metadata_props.add(key=LORA_METADATA, value=json.dumps(adapters))


__all__ = ["LORA_METADATA", "add_lora", "lora_adapters", "merge_lora"]
