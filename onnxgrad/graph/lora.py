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

The model keeps the form it was deployed in (fused ``com.microsoft`` operators, float16,
integer products, QDQ, 4-bit): nothing is lowered. A quantized weight (the integer codes ``q``
of a ``MatMulNBits``, ``MatMulInteger``, ``DynamicQuantizeMatMul``, ``QLinearMatMul``,
QDQ ``MatMul`` or the same dequantized by ``(Cast(q) - z) s`` or ``/ d``, per block too,
:mod:`onnxgrad.graph.deployed_products`) stays frozen and gets a float
adapter beside its product (QLoRA):

    y' = y + s (x A) B = x (W + s A B),   W = (q - z) s_q  (K x N)

named after ``q`` (a reader of ``W^T`` gets ``s (x B^T) A^T``), placed so that
onnxruntime's fusions of the base still apply (a QDQ product's sum quantized again, a bias
folded first; branches reading one ``x`` share ``x [A_1 | A_2 | ...]``:
:mod:`onnxgrad.graph.deployed_products`). :func:`merge_lora` keeps those adapters beside the
untouched codes or, asked to, folds them and re-quantizes the base in its own format
(:mod:`onnxgrad.graph.requantize`); the merged model then has exactly the
deployed operators.

The adapters are listed in the model's metadata (key :data:`LORA_METADATA`, JSON).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import numpy as np
from onnx import ModelProto, TensorProto, helper, numpy_helper

from onnxgrad._onnx_utils import (
    FLOAT_TYPES,
    ModelLike,
    NameScope,
    all_names,
    checker_knows,
    default_opset,
    finalize_model,
    load_model,
    normalize_domain,
    np_dtype,
    subgraphs,
)
from onnxgrad.graph._scopes import iter_graphs
from onnxgrad.graph.deployed_products import (
    add_branch,
    insert_after,
    one_adapter,
    remove_branch,
    share_first_products,
    weight_products,
)
from onnxgrad.graph.integer_branch import integer_first_products
from onnxgrad.graph.requantize import requantize_products

LORA_METADATA = "onnxgrad.lora"
#: the operators whose weight input (index 1, or 0 and 1 for Gemm) can get an adapter
ADAPTED_OPS = {"MatMul": (1,), "Gemm": (0, 1), "Conv": (1,)}
#: fused onnxruntime operators whose float weight input can get an adapter
FUSED_ADAPTED_OPS = {("com.microsoft", "Attention"): (1,)}


def add_lora(
    model: ModelLike,
    weights: Sequence[str] | None = None,
    rank: int = 4,
    alpha: float | None = None,
    seed: int = 0,
) -> ModelProto:
    """A copy of ``model`` where each weight of ``weights`` gets a rank-``rank`` adapter
    (see the module docstring; ``alpha`` defaults to ``rank``, so ``s = 1``).

    By default the adapted weights are the learned layers: every float initializer of rank
    >= 2 that a MatMul (directly or through a Transpose), Gemm or Conv reads and that
    :func:`~onnxgrad.get_train_initializer` counts as a weight
    (:mod:`onnxgrad.graph.weight_roles`: not a DFT basis, a filterbank, a smoothing window,
    a fitted statistic...), and the integer codes of every quantized product. A weight named
    in ``weights`` is adapted whatever its role.

    The adapter initializers are named ``<W>_lora_A`` and ``<W>_lora_B``; train those only.
    Weights a file stores as ``Constant`` nodes (paddle2onnx's) are initializers first, same
    names (:func:`~onnxgrad.normalize.constants.promote_constant_weights`); those that get no
    adapter are ``Constant`` nodes again in the model returned, in the graph they were in (an
    ``If`` branch, a loop body).
    """
    from onnxgrad.normalize.constants import promote_constants, restore_constants  # a cycle

    roles = _parameter_roles(model) if weights is None else None  # before the copy below
    model = load_model(model)
    constants = promote_constants(model)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    scale = float(rank if alpha is None else alpha) / int(rank)
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    quantized = _quantized_products(model)
    targets = _adaptable_weights(model, initializers) | set(quantized)
    chosen = _chosen(model, weights, targets, initializers, set(quantized), roles)
    rng = np.random.default_rng(seed)
    names = NameScope(all_names(graph))
    node_names = NameScope(n.name for n in graph.node if n.name)
    new_nodes, adapters, branches, ranked = [], list(lora_adapters(model)), {}, []
    for weight in chosen:
        if weight in quantized:
            adapter = _beside(
                weight, quantized[weight], int(rank), scale, rng, names, node_names, graph
            )
            for node_name, nodes in adapter.pop("_branches").items():
                branches.setdefault(node_name, []).extend(nodes)
                ranked.append((nodes, int(rank)))
        else:
            nodes, adapter = _adapter(
                initializers[weight], int(rank), scale, rng, names, node_names, graph
            )
            new_nodes.extend(nodes)
            rewire(graph, weight, adapter["output"], skip=set(adapter["nodes"]))
        adapters.append(adapter)
    insert_after(graph, branches)
    shared = share_first_products(graph, ranked, default_opset(model), names, node_names)
    for adapter in adapters:
        adapter["nodes"] = _renamed(adapter["nodes"], shared)
    nodes = new_nodes + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    restore_constants(graph, {k: v for k, v in constants.items() if k not in chosen})
    _set_adapters(model, adapters)
    return finalize_model(model, check=checker_knows(model))


def _chosen(
    model, weights, targets: set[str], initializers, quantized: set[str], roles
) -> list[str]:
    """The weights to adapt: ``weights`` checked, or every target without an adapter that
    is a quantized weight's codes or plays a parameter role (``roles``:
    :func:`_parameter_roles`)."""
    existing = lora_adapters(model)
    adapter_parts = {adapter[key] for adapter in existing for key in ("a", "b")}
    if weights is None:
        adapted = adapter_parts | {adapter["weight"] for adapter in existing}
        free = set(targets) - adapted
        fixed = sorted(free - quantized - _learned(free - quantized, *roles))
        chosen = sorted(free - set(fixed))
        if not chosen:
            raise ValueError(
                "the model has no MatMul, Gemm or Conv weight to adapt"
                + _read_in_bodies(model)
                + _fixed_transforms(fixed)
            )
        return chosen
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
    return chosen


def _parameter_roles(model: ModelLike) -> tuple[set[str], set[str]]:
    """The initializers of ``model`` normalised (:mod:`onnxgrad.normalize`) and those of them
    :func:`~onnxgrad.get_train_initializer` counts as weights
    (:mod:`onnxgrad.graph.weight_roles`). Read from the user's model before ``add_lora``
    makes its own copy, the normalised one gone by then: the weights are held once more at
    most, not twice."""
    from onnxgrad.graph.initializers import train_initializer_names
    from onnxgrad.normalize import normalized_model  # normalize imports graph

    normalized = normalized_model(model)
    held = {init.name for init in normalized.graph.initializer}
    return held, set(train_initializer_names(normalized))


def _learned(candidates: set[str], held: set[str], weights: set[str]) -> set[str]:
    """The float ``candidates`` counted as weights (``weights``), matched by initializer
    name; a candidate the normalised copy no longer ``held`` under its name (a lowering
    rewrote it) keeps its adapter."""
    return (candidates - held) | (candidates & weights)


def _fixed_transforms(fixed: list[str]) -> str:
    if not fixed:
        return ""
    return (
        f": its layer inputs {fixed} play no parameter role (fixed transforms: DFT bases, "
        "filterbanks, smoothing windows, fitted statistics, see get_train_initializer); "
        "name them in weights= to adapt them anyway"
    )


def _quantized_products(model: ModelProto) -> dict[str, list]:
    """``{integer codes: their products}`` for the quantized weights read only by
    recognised products (every reader of a QDQ weight, a requantized one too,
    :mod:`onnxgrad.graph.deployed_products`): one adapter gives each the same
    ``W + s A B``, a reader of the weight's other layout ``(W + s A B)^T``
    (:func:`~onnxgrad.graph.deployed_products.one_adapter`)."""
    products_of = weight_products(model)  # names the unnamed nodes
    readers: dict[str, set[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.name)
    found = {}
    for weight, products in products_of.items():
        adapted = one_adapter(products) if products[0].quantized else None
        if adapted and readers.get(weight, set()) <= {p.reader for p in products}:
            found[weight] = adapted
    return found


def _beside(weight, products, rank, scale, rng, names, node_names, graph) -> dict:
    """A float adapter ``A [K, r]``, ``B [r, N]`` of the quantized ``weight``, a branch
    ``s (x A) B`` beside each of its ``products``, and its record (``_branches``: the nodes
    to insert after each product's node)."""
    k, n = products[0].shape
    a = names.unique(f"{weight}_lora_A")
    b = names.unique(f"{weight}_lora_B")
    graph.initializer.extend(
        [
            numpy_helper.from_array(
                (rng.standard_normal((k, rank)) / np.sqrt(k)).astype(np.float32), name=a
            ),
            numpy_helper.from_array(np.zeros((rank, n), dtype=np.float32), name=b),
        ]
    )
    branches = {p.node.name: add_branch(graph, p, a, b, scale, names, node_names) for p in products}
    return {
        "weight": weight,
        "a": a,
        "b": b,
        "scale": scale,
        "shape": [k, n],
        "quantized": products[0].kind,
        "sums": [nodes[-1].name for nodes in branches.values()],
        "nodes": [node.name for nodes in branches.values() for node in nodes],
        "_branches": branches,
    }


def _renamed(nodes: list[str], replaced: dict[str, list[str]]) -> list[str]:
    """``nodes`` with each replaced name swapped for the names replacing it (once each)."""
    return list(dict.fromkeys(new for name in nodes for new in replaced.get(name, [name])))


def lora_adapters(model: ModelProto) -> list[dict]:
    """The adapters :func:`add_lora` recorded in ``model`` (``[]`` when none): dicts with
    the keys ``weight``, ``a``, ``b``, ``scale``, ``output`` and ``nodes``."""
    for prop in model.metadata_props:
        if prop.key == LORA_METADATA:
            return json.loads(prop.value)
    return []


#: What :func:`merge_lora` may do with the adapters of quantized weights.
QUANTIZED_MODES = ("keep", "requantize")


def merge_lora(
    model: ModelLike, quantized: str = "keep", integer_branch: bool = False
) -> ModelProto:
    """A copy of ``model`` whose adapters are folded into their weights,
    ``W <- W + s * reshape(A @ B, shape(W))`` (computed in float64), and removed.

    ``quantized`` says what becomes of the adapters of quantized weights: ``"keep"`` leaves
    them beside the untouched codes (the deployed operators and a small float branch
    ``s (x A) B``); ``"requantize"`` folds them too and quantizes ``W + s A B`` again in
    the base's format (same bits, blocks, axis, symmetric or not:
    :mod:`onnxgrad.graph.requantize`), each value within half a quantization step: the
    result has exactly the deployed model's operators.

    ``integer_branch=True`` computes the first product ``x A`` of a branch kept beside a
    ``quantize_dynamic`` product from the codes of ``x`` the base already computes and ``A``
    quantized per column (:mod:`onnxgrad.graph.integer_branch`): onnxruntime runs it with the
    base's integer kernel, and the outputs move by the rounding of ``x`` and ``A``."""
    if quantized not in QUANTIZED_MODES:
        raise ValueError(f"quantized must be 'keep' or 'requantize', got {quantized!r}")
    if not isinstance(integer_branch, bool):
        raise TypeError(f"integer_branch must be True or False, got {integer_branch!r}")
    model = load_model(model)
    adapters = lora_adapters(model)
    if not adapters:
        return model
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    outputs = {o.name for o in graph.output}
    folded = adapters if quantized == "requantize" else [a for a in adapters if "sums" not in a]
    requantized = []
    for adapter in folded:
        _check_adapter(adapter, initializers)
        a = numpy_helper.to_array(initializers[adapter["a"]]).astype(np.float64)
        b = numpy_helper.to_array(initializers[adapter["b"]]).astype(np.float64)
        update = adapter["scale"] * (a @ b)
        if "sums" in adapter:
            remove_branch(graph, adapter["nodes"], adapter["sums"])
            requantized.append((adapter["weight"], update))
        else:
            if adapter["output"] in outputs:
                raise ValueError(f"adapter output {adapter['output']!r} is a graph output")
            base = numpy_helper.to_array(initializers[adapter["weight"]])
            merged = base.astype(np.float64) + update.reshape(base.shape)
            initializers[adapter["weight"]].CopyFrom(
                numpy_helper.from_array(merged.astype(base.dtype), name=adapter["weight"])
            )
            removed = set(adapter["nodes"])
            kept = [n for n in graph.node if n.name not in removed]
            del graph.node[:]
            graph.node.extend(kept)
            rewire(graph, adapter["output"], adapter["weight"], skip=set())
        for name in (adapter["a"], adapter["b"]):
            graph.initializer.remove(initializers.pop(name))
    if requantized:
        requantize_products(model, requantized)
    kept = [a for a in adapters if a not in folded]
    if kept and integer_branch:
        _integer_branches(model, [a for a in kept if "sums" in a])
    _set_adapters(model, kept)
    return finalize_model(model, check=checker_knows(model))


def _integer_branches(model: ModelProto, adapters: list[dict]) -> None:
    """The first products of ``adapters``' branches beside int8 products, in integers
    (:mod:`onnxgrad.graph.integer_branch`); their records name the new nodes."""
    graph = model.graph
    candidates = {name for adapter in adapters for name in adapter["nodes"]}
    names = NameScope(all_names(graph))
    node_names = NameScope(n.name for n in graph.node if n.name)
    replaced = integer_first_products(graph, candidates, default_opset(model), names, node_names)
    for adapter in adapters:
        adapter["nodes"] = _renamed(adapter["nodes"], replaced)


def _check_adapter(adapter: object, initializers: dict) -> None:
    """``ValueError`` unless ``adapter`` (read from the model's metadata) names a weight ``W``
    and adapters ``A [rows, r]``, ``B [r, cols]`` with ``rows * cols`` the size of ``W``,
    checked on the declared dims before anything is computed."""
    keys = {"weight": str, "a": str, "b": str, "scale": (int, float)}
    beside = isinstance(adapter, dict) and "sums" in adapter
    keys.update({"sums": list, "shape": list} if beside else {"output": str})
    if not isinstance(adapter, dict) or not all(
        isinstance(adapter.get(k), t) and not isinstance(adapter.get(k), bool)
        for k, t in keys.items()
    ):
        raise ValueError(f"the model's LoRA metadata holds a malformed adapter: {adapter!r:.200}")
    if "value" in adapter:
        raise ValueError(
            f"adapter of {adapter['weight']!r} was added to a lowered copy of a quantized "
            "model by an earlier onnxgrad: call add_lora on the deployed model again"
        )
    for key in ("nodes", "sums") if beside else ("nodes",):
        if not isinstance(adapter.get(key), list) or not all(
            isinstance(n, str) for n in adapter[key]
        ):
            raise ValueError(f"adapter of {adapter['weight']!r}: {key!r} must be a list of names")
    if beside and not (
        len(adapter["shape"]) == 2 and all(type(d) is int and d > 0 for d in adapter["shape"])
    ):
        raise ValueError(f"adapter of {adapter['weight']!r}: 'shape' must be [K, N]")
    missing = [adapter[k] for k in ("weight", "a", "b") if adapter[k] not in initializers]
    if missing:
        raise ValueError(f"adapter of {adapter['weight']!r}: no initializer {missing}")
    weight, a, b = (list(initializers[adapter[k]].dims) for k in ("weight", "a", "b"))
    rows, cols = (weight[0], math.prod(weight[1:])) if weight else (0, 0)
    if beside:  # the update has the product's K x N shape
        rows, cols = adapter["shape"]
    if len(a) != 2 or len(b) != 2 or a[1] != b[0] or (a[0], b[1]) != (rows, cols):
        raise ValueError(
            f"adapter of {adapter['weight']!r} {weight}: A {adapter['a']!r} {a} @ B "
            f"{adapter['b']!r} {b} does not give a [{rows}, {cols}] update"
        )


def _adaptable_weights(model: ModelProto, initializers) -> set[str]:
    """The float initializers of rank >= 2 that an adapted op reads as its weight, directly
    or (a ``MatMul``'s) through a 2-D ``Transpose``: ``x W^T``, PyTorch's ``Linear``
    exported without folding the transpose."""
    transposed = {
        node.output[0]: node.input[0]
        for node in model.graph.node
        if node.op_type == "Transpose" and not normalize_domain(node.domain) and node.input
    }
    found = set()
    for node in model.graph.node:
        domain = normalize_domain(node.domain)
        indices = ADAPTED_OPS.get(node.op_type, ()) if not domain else ()
        for index in indices or FUSED_ADAPTED_OPS.get((domain, node.op_type), ()):
            name = node.input[index] if index < len(node.input) else ""
            if node.op_type == "MatMul" and not domain and name in transposed:
                name = transposed[name]
                if name in initializers and len(initializers[name].dims) != 2:
                    continue
            if name in initializers:
                init = initializers[name]
                if init.data_type in FLOAT_TYPES and len(init.dims) >= 2:
                    found.add(init.name)
    return found


def _read_in_bodies(model: ModelProto) -> str:
    """Why the main graph has no layer weight when the layers sit in ``If`` branches or
    ``Loop``/``Scan`` bodies (which add_lora does not rewrite): the nodes holding them."""
    holders = sorted(
        f"{node.op_type} {node.name!r}"
        for node in model.graph.node
        if any(
            inner.op_type in ADAPTED_OPS
            for graph in subgraphs(node)
            for body in iter_graphs(graph)
            for inner in body.node
        )
    )
    if not holders:
        return ""
    return (
        f" in its main graph: its layers are read inside the subgraphs of {', '.join(holders)}"
        " (If branches, Loop and Scan bodies), which add_lora does not adapt"
    )


def _check_target(name: str, initializers, targets: set[str]) -> None:
    if name not in initializers:
        raise ValueError(f"{name!r} is not an initializer of the model")
    if name not in targets:
        raise ValueError(
            f"initializer {name!r} is no float weight of rank >= 2 read by "
            f"{'/'.join(ADAPTED_OPS)}: it cannot get a low-rank adapter"
        )


def _adapter(init, rank, scale, rng, names, node_names, graph):
    """The nodes computing ``W + s reshape(A @ B)`` over the float initializer ``init`` and
    the adapter's record."""
    shape = tuple(init.dims)
    rows, cols = shape[0], int(np.prod(shape[1:], dtype=np.int64))
    dtype = _adapter_dtype(init)
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
    nodes, output = weight_update(init, a, b, scale, names, node_names)
    record = {
        "weight": init.name,
        "a": a,
        "b": b,
        "scale": scale,
        "output": output,
        "nodes": [n.name for n in nodes],
    }
    return nodes, record


def _adapter_dtype(init) -> np.dtype:
    """The adapters' type: float32 over a float16 or bfloat16 weight, else the weight's."""
    if init.data_type in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
        return np.dtype(np.float32)
    return np_dtype(init.data_type)


def weight_update(init, a: str, b: str, scale: float, names, node_names):
    """The nodes computing ``W + s reshape(A @ B, shape(W))`` over the float initializer
    ``init`` from the adapters named ``a`` and ``b`` (cast to ``W``'s type over a float16 or
    bfloat16 ``W``), and the name of that sum."""
    shape = tuple(init.dims)
    dtype = _adapter_dtype(init)
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
    if dtype != np_dtype(init.data_type):
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
    nodes.append(node("Add", [init.name, delta], output))
    return nodes, output


def rewire(graph, old: str, new: str, skip: set[str]) -> None:
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


__all__ = [
    "LORA_METADATA",
    "add_lora",
    "lora_adapters",
    "merge_lora",
    "rewire",
    "weight_update",
]
