r"""Trained LoRA adapters served at run time, over the deployed model as it was.

onnxruntime (``RunOptions.add_active_adapter``) and onnxruntime-genai (``og.Adapters``,
``Generator.set_active_adapter``) switch adapters per request: the base model reads each
adapter matrix as a graph input that also has an initializer of the same name (its
default), and the runtime feeds an adapter file's tensors under those names.

:func:`runtime_adapter_model` writes that base from the model as deployed (its fused and
quantized operators kept) and the adapters of the
model :func:`onnxgrad.graph.lora.add_lora` made of it. Each adapted product
``y = x W`` (a ``MatMul`` or ``Gemm`` weight ``W``, or the ``K x N`` weight a ``MatMulNBits``,
``MatMulInteger``, ``DynamicQuantizeMatMul``, ``QLinearMatMul``, QDQ ``MatMul`` or
``(Cast(q) - z) s`` (or ``/ d``) dequantizes from its codes,
:mod:`onnxgrad.graph.deployed_products`; each product of a weight read twice) gets the branch

    y' = y + s (x A) B = x (W + s A B),

the form onnxruntime-genai's model builder gives a PEFT adapter. The defaults are the
adapters' values in the model given (``B = 0`` before training, so the base computes what
the deployed model did); a trained checkpoint's adapters, written as an ``.onnx_adapter`` by
:func:`onnxgrad.training.artifacts.onnx_adapter.save_onnx_adapter`, replace them when active.
"""

from __future__ import annotations

import numpy as np
from onnx import ModelProto, TensorProto, helper

from onnxgrad._onnx_utils import (
    FLOAT_TYPES,
    ModelLike,
    NameScope,
    all_names,
    default_opset,
    finalize_model,
    load_model,
)
from onnxgrad.graph.conv_branch import add_conv_branches, conv_readers, conv_shape, strided
from onnxgrad.graph.deployed_products import (
    add_branch,
    insert_after,
    one_adapter,
    share_first_products,
    weight_products,
)
from onnxgrad.graph.integer_branch import integer_first_products
from onnxgrad.graph.lora import lora_adapters, rewire, weight_update
from onnxgrad.graph.lora_choice import chosen_per_run, conv_branch_pays, crossover_rows
from onnxgrad.graph.lora_requantized import requantized_nbits_nodes, requantized_weight_nodes

#: How :func:`runtime_adapter_model` applies the fed adapters.
APPLY_MODES = ("auto", "branch", "weights")


def runtime_adapter_model(
    deployed: ModelLike,
    adapted: ModelLike,
    integer_branch: bool = False,
    apply: str = "branch",
    rows: int | None = None,
) -> ModelProto:
    """``deployed`` with a branch ``s (x A) B`` beside each product whose weight ``adapted``
    (``add_lora`` of ``deployed``) adapts; ``A`` and ``B`` are graph inputs defaulting to
    their values in ``adapted``. A float weight that other nodes read too (a convolution's
    kernel, an embedding tied to a head) is updated instead, ``W + s reshape(A B)`` before
    its readers; but a float32/float64 kernel only ``Conv`` nodes read gets, with ``"branch"``
    or ``"auto"``, ``Conv(x, W) + s branch(x)`` beside each (:mod:`onnxgrad.graph.conv_branch`:
    ``W`` stays a constant onnxruntime reorders into its blocked layout) where
    :func:`~onnxgrad.graph.lora_choice.conv_branch_pays` finds that faster (large dense
    convolutions; the update elsewhere). ``ValueError`` names an adapter whose weight
    ``deployed`` has neither as a float initializer nor as the weight of a product.

    ``integer_branch=True`` computes ``x A`` beside ``quantize_dynamic``'s products from the
    activation's int8 codes and ``A`` quantized per column at run time
    (:mod:`onnxgrad.graph.integer_branch`): faster, within the codes' rounding of the float
    branch.

    ``apply`` says how the fed adapters reach the products. ``"branch"`` (the default) adds
    ``s (x A) B`` beside each one: ``M r (K + N)`` more per run for ``M`` rows and an
    ``M x N`` sum, the cheaper one for few rows (decoding a token per run).
    ``"weights"`` updates the weights once per run instead, whatever ``M``: a float weight
    becomes ``W + s A B`` (``K N r``, cheaper once ``M > K N / (K + N)``: batches, a
    prompt), a QDQ, ``quantize_dynamic`` (``MatMulInteger``) or ``MatMulNBits`` weight is
    quantized again from ``W + s A B`` in the graph as
    ``merge_lora(..., quantized="requantize")`` does (:mod:`onnxgrad.graph.lora_requantized`:
    its codes, the deployed operators reading them). 4-bit QDQ, ``DynamicQuantizeMatMul`` and
    ``QLinearMatMul`` weights keep the branch either way. ``"auto"`` runs one or the other per
    run, in one ``If`` on the rows of an adapted product's activation
    (:mod:`onnxgrad.graph.lora_choice`): the weights above ``rows`` rows (``None``: the
    measured crossover of the adapted products, :func:`~onnxgrad.graph.lora_choice.crossover_rows`),
    the branch up to it. ``ValueError`` for another value or a negative ``rows``,
    ``TypeError`` for a non-string ``apply``.

    onnx's checker is not run on the result: deployed models hold operators it refuses
    (onnxruntime's ``SimplifiedLayerNormalization`` in the default domain)."""
    if not isinstance(integer_branch, bool):
        raise TypeError(f"integer_branch must be True or False, got {integer_branch!r}")
    if not isinstance(apply, str):
        raise TypeError(f"apply must be a string, one of {APPLY_MODES}, got {apply!r}")
    if apply not in APPLY_MODES:
        raise ValueError(f"apply must be one of {APPLY_MODES}, got {apply!r}")
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 0):
        raise ValueError(f"rows must be a non-negative integer or None, got {rows!r}")
    if rows is not None and apply != "auto":
        raise ValueError(f"rows is the threshold of apply='auto', not of apply={apply!r}")
    model = load_model(deployed)
    adapted = load_model(adapted)
    if apply == "auto":  # a Conv's choice is the same at any batch: made in both bodies
        built = [_built(model, adapted, integer_branch, mode, True) for mode in APPLY_MODES[1:]]
        activations, updates, branches = _choices(model, adapted)
        threshold = crossover_rows(updates, branches) if rows is None else rows
        return chosen_per_run(model, *built, activations, threshold)
    return _built(model, adapted, integer_branch, apply, apply == "branch")


def _built(model, adapted, integer_branch: bool, apply: str, conv_branches: bool) -> ModelProto:
    """:func:`runtime_adapter_model` for ``apply`` ``"branch"`` or ``"weights"``, with a
    branch beside each ``Conv`` whose kernel only ``Conv`` nodes read where
    ``conv_branches`` and :func:`~onnxgrad.graph.lora_choice.conv_branch_pays` say so
    (:mod:`onnxgrad.graph.conv_branch`), its kernel updated otherwise."""
    model, adapted = load_model(model), load_model(adapted)
    adapters = lora_adapters(adapted)
    if not adapters:
        raise ValueError("the adapted model has no LoRA adapter (add_lora records them)")
    values = {init.name: init for init in adapted.graph.initializer}
    graph = model.graph
    products = weight_products(model)
    names = NameScope(all_names(graph))
    node_names = NameScope(n.name for n in graph.node if n.name)
    taken = all_names(graph)
    new_nodes: dict[str, list] = {}
    ranked, updates = [], []
    original = {node.name for node in graph.node}
    for adapter in adapters:
        clash = sorted({adapter["a"], adapter["b"]} & taken)
        if clash:
            raise ValueError(f"adapter of {adapter['weight']!r}: {clash} already name values")
        found = _products_of(products, adapter, values, graph)
        for key in ("a", "b"):
            _add_overridable(graph, values[adapter[key]])
        float_weight = _float_initializer(graph, adapter["weight"])
        if not found and conv_branches and _conv_branched(graph, float_weight, adapter, values):
            rank = _rank(values, adapter)
            added = add_conv_branches(graph, float_weight, adapter, rank, names, node_names)
            for name, nodes in added.items():
                new_nodes.setdefault(name, []).extend(nodes)
            continue
        if not found or (apply == "weights" and float_weight is not None):
            updates.append(_updated_weight(graph, float_weight, adapter, names, node_names))
            continue
        if apply == "weights" and _requantizable(found, graph, default_opset(model)):
            requantized = (
                requantized_nbits_nodes
                if found[0].kind == "MatMulNBits"
                else requantized_weight_nodes
            )
            rewired: dict[tuple, list[str]] = {}  # what each dequantization reads now
            for reader in dict.fromkeys(p.reader for p in found):
                node = next(n for n in graph.node if n.name == reader)
                key = _dequantization_key(node)
                if key in rewired:  # the same codes dequantized alike: quantized once
                    node.input[:] = rewired[key]
                    continue
                product = next(p for p in found if p.reader == reader)
                updates.append(requantized(model, product, adapter, names, node_names))
                rewired[key] = list(node.input)
            continue
        rank = _rank(values, adapter)
        for product in found:
            nodes = add_branch(
                graph, product, adapter["a"], adapter["b"], adapter["scale"], names, node_names
            )
            new_nodes.setdefault(product.node.name, []).extend(nodes)
            ranked.append((nodes, rank))
    insert_after(graph, new_nodes)
    _prepend(graph, [node for nodes in updates for node in nodes])
    share_first_products(graph, ranked, default_opset(model), names, node_names)
    if integer_branch:
        branch = {node.name for node in graph.node} - original
        integer_first_products(graph, branch, default_opset(model), names, node_names)
    return finalize_model(model, check=False)


def _choices(model: ModelProto, adapted: ModelProto):
    """What ``"branch"`` and ``"weights"`` do differently: ``(x, K)`` of each product
    branched in one and updated in the other, ``(K, N, r, storage)`` of each such weight
    (:data:`~onnxgrad.graph.lora_choice.UPDATE_COST`) and ``(K, N, r)`` of each product."""
    graph = model.graph
    products = weight_products(model)
    values = {init.name: init for init in adapted.graph.initializer}
    activations, updates, branches = [], [], []
    for adapter in lora_adapters(adapted):
        found = _products_of(products, adapter, values, graph)
        if not found:
            continue
        if _float_initializer(graph, adapter["weight"]) is not None:
            storage = "float"
        elif _requantizable(found, graph, default_opset(model)):
            storage = {"MatMulInteger": "int8", "MatMulNBits": "nbits"}.get(found[0].kind, "qdq")
        else:
            continue
        rank = int(values[adapter["a"]].dims[-1])
        (k, n) = found[0].shape
        updates.append((k, n, rank, storage))
        branches.extend((*p.shape, rank) for p in found)
        activations.extend((p.x, p.shape[0]) for p in found)
    return activations, updates, branches


def _products_of(products: dict, adapter: dict, values: dict, graph) -> list:
    """The products adapting ``adapter``'s weight (one branch each, sharing ``A`` and
    ``B``), or ``[]`` for a float initializer of ``graph`` that a node other than a product
    reads (a convolution's kernel, an embedding tied to a head): it is updated before all
    its readers (:func:`_updated_weight`). ``ValueError`` naming the weight when it is
    neither or ``A B`` does not have its shape."""
    weight = adapter["weight"]
    found = products.get(weight, [])
    if found and found[0].quantized:  # a reader of the other layout reads (A B)^T
        found = one_adapter(found) or found
    rows, cols = values[adapter["a"]].dims[0], values[adapter["b"]].dims[-1]
    init = next((i for i in graph.initializer if i.name == weight), None)
    readers = {node.name for node in graph.node if weight in node.input}
    if init is not None and init.data_type in FLOAT_TYPES and readers - {p.reader for p in found}:
        dims = list(init.dims)
        if not dims or (rows, cols) != (dims[0], int(np.prod(dims[1:], dtype=np.int64))):
            raise ValueError(f"adapter of {weight!r}: A B is [{rows}, {cols}], W is {dims}")
        return []
    if not found:
        raise ValueError(
            f"adapter of {weight!r}: the deployed model reads that weight in no MatMul, Gemm, "
            "MatMulNBits, MatMulInteger, DynamicQuantizeMatMul, QLinearMatMul, QDQ MatMul "
            "or Gemm (or one dequantized by Cast and Mul or Div), and has no float initializer of "
            "that name"
        )
    for product in found:
        k, n = product.shape
        if (rows, cols) != ((n, k) if product.transposed else (k, n)):
            raise ValueError(
                f"adapter of {weight!r}: A B is [{rows}, {cols}], the product "
                f"{product.node.name!r} reads a weight of shape [{k}, {n}]"
            )
    return found


def _updated_weight(graph, init, adapter: dict, names, node_names) -> list:
    """``W + s reshape(A B, shape(W))`` from the fed ``A`` and ``B``, read instead of ``W``
    by every node (``K N r`` per run whatever the batch: a convolution's kernel, which no
    ``x A`` branch computes without a convolution of its own)."""
    nodes, output = weight_update(
        init, adapter["a"], adapter["b"], adapter["scale"], names, node_names
    )
    rewire(graph, init.name, output, skip=set())
    return nodes


def _rank(values: dict, adapter: dict) -> int:
    return int(values[adapter["a"]].dims[-1])


def _conv_branched(graph, init, adapter: dict, values: dict) -> bool:
    """Whether the float kernel ``init`` gets a branch beside each ``Conv`` reading it: only
    ``Conv`` nodes read it, and the branch costs less than the kernel's update does."""
    readers = conv_readers(graph, init.name) if init is not None else None
    if readers is None:
        return False
    rank = _rank(values, adapter)
    return all(conv_branch_pays(*conv_shape(init, conv), rank, strided(conv)) for conv in readers)


def _requantizable(found: list, graph, opset: int) -> bool:
    """Whether ``apply="weights"`` quantizes these products' weight again per run: 8-bit
    QDQ codes, and the codes of ``quantize_dynamic``'s ``MatMulInteger`` or of a
    ``MatMulNBits`` (without ``g_idx``, opset 13 or later) that no other node reads (4-bit
    QDQ codes keep the branch)."""
    codes = next(i for i in graph.initializer if i.name == found[0].weight)
    if codes.data_type not in (TensorProto.INT8, TensorProto.UINT8):
        return False
    if all(p.kind == "DequantizeLinear" for p in found):
        return True
    readers = [n for n in graph.node if found[0].weight in n.input]
    if len(found) != 1 or len(readers) != 1:
        return False
    if found[0].kind == "MatMulNBits":
        return opset >= 13 and (len(readers[0].input) < 5 or not readers[0].input[4])
    return found[0].kind == "MatMulInteger"


def _dequantization_key(node) -> tuple:
    """What a weight's reader computes from its inputs: ``DequantizeLinear`` nodes with the
    same inputs and attributes read the same values (a tied weight, a table read twice)."""
    if node.op_type != "DequantizeLinear":
        return (node.name,)
    return (*node.input, *(a.SerializeToString() for a in node.attribute))


def _float_initializer(graph, name: str) -> TensorProto | None:
    return next(
        (i for i in graph.initializer if i.name == name and i.data_type in FLOAT_TYPES), None
    )


def _prepend(graph, nodes: list) -> None:
    kept = list(graph.node)
    del graph.node[:]
    graph.node.extend([*nodes, *kept])


def _add_overridable(graph, value: TensorProto) -> None:
    graph.initializer.append(value)
    graph.input.append(helper.make_tensor_value_info(value.name, value.data_type, list(value.dims)))
