r"""Trained LoRA adapters served at run time, over the deployed model as it was.

onnxruntime (``RunOptions.add_active_adapter``) and onnxruntime-genai (``og.Adapters``,
``Generator.set_active_adapter``) switch adapters per request: the base model reads each
adapter matrix as a graph input that also has an initializer of the same name (its
default), and the runtime feeds an adapter file's tensors under those names.

:func:`runtime_adapter_model` writes that base from the model as deployed (its fused and
quantized operators kept) and the adapters of the
model :func:`onnxgrad.graph.lora.add_lora` made of it. Each adapted product
``y = x W`` (a ``MatMul`` weight ``W`` of shape ``K x N``, or the ``K x N`` weight a
``MatMulNBits`` node dequantizes from its codes; each product of a weight read twice) gets the
branch

    y' = y + s (x A) B = x (W + s A B),

the form onnxruntime-genai's model builder gives a PEFT adapter. The defaults are the
adapters' values in the model given (``B = 0`` before training, so the base computes what
the deployed model did); a trained checkpoint's adapters, written as an ``.onnx_adapter`` by
:func:`onnxgrad.training.onnx_adapter.save_onnx_adapter`, replace them when active.
"""

from __future__ import annotations

import numpy as np
from onnx import ModelProto, TensorProto, helper, numpy_helper

from onnxgrad._onnx_utils import (
    ModelLike,
    NameScope,
    all_names,
    finalize_model,
    load_model,
    normalize_domain,
    np_dtype,
)
from onnxgrad.graph.lora import lora_adapters

#: ``(domain, op_type) -> index`` of the weight input whose product gets a branch.
BRANCHED_OPS = {("", "MatMul"): 1, ("com.microsoft", "MatMulNBits"): 1}


def runtime_adapter_model(deployed: ModelLike, adapted: ModelLike) -> ModelProto:
    """``deployed`` with a branch ``s (x A) B`` beside each product whose weight ``adapted``
    (``add_lora`` of ``deployed``) adapts; ``A`` and ``B`` are graph inputs defaulting to
    their values in ``adapted``. ``ValueError`` names an adapter whose weight ``deployed``
    does not read as a ``MatMul`` or ``MatMulNBits`` weight.

    onnx's checker is not run on the result: deployed models hold operators it refuses
    (onnxruntime's ``SimplifiedLayerNormalization`` in the default domain)."""
    model = load_model(deployed)
    adapted = load_model(adapted)
    adapters = lora_adapters(adapted)
    if not adapters:
        raise ValueError("the adapted model has no LoRA adapter (add_lora records them)")
    values = {init.name: init for init in adapted.graph.initializer}
    graph = model.graph
    names = NameScope(all_names(graph))
    node_names = NameScope(n.name for n in graph.node if n.name)
    readers = _weight_readers(model)
    taken = all_names(graph)
    new_nodes: dict[str, list] = {}
    for adapter in adapters:
        nodes = _readers_of(readers, adapter["weight"], model)
        clash = sorted({adapter["a"], adapter["b"]} & taken)
        if clash:
            raise ValueError(f"adapter of {adapter['weight']!r}: {clash} already name values")
        for key in ("a", "b"):
            _add_overridable(graph, values[adapter[key]])
        for node in nodes:
            new_nodes.setdefault(node.name, []).extend(
                _branch(graph, node, adapter, values, names, node_names)
            )
    ordered = []
    for node in graph.node:
        ordered.append(node)
        ordered.extend(new_nodes.get(node.name, []))
    del graph.node[:]
    graph.node.extend(ordered)
    return finalize_model(model, check=False)


def _weight_readers(model: ModelProto) -> dict[str, list]:
    """``{weight initializer: the MatMul/MatMulNBits nodes reading it}``, nodes named."""
    initializers = {init.name for init in model.graph.initializer}
    found: dict[str, list] = {}
    names = NameScope(n.name for n in model.graph.node if n.name)
    for node in model.graph.node:
        index = BRANCHED_OPS.get((normalize_domain(node.domain), node.op_type))
        if index is None or index >= len(node.input) or node.input[index] not in initializers:
            continue
        if not node.name:
            node.name = names.unique(f"{node.op_type}_{node.output[0]}")
        found.setdefault(node.input[index], []).append(node)
    return found


def _readers_of(readers: dict[str, list], weight: str, model: ModelProto) -> list:
    """The nodes whose products adapt ``weight`` (one branch each, sharing ``A`` and ``B``);
    ``ValueError`` naming the weight when there is none or it is a ``MatMul`` weight that is
    not a matrix."""
    nodes = readers.get(weight, [])
    if not nodes:
        raise ValueError(
            f"adapter of {weight!r}: the deployed model has no MatMul or MatMulNBits reading "
            "that weight"
        )
    dims = next(i.dims for i in model.graph.initializer if i.name == weight)
    if nodes[0].op_type == "MatMul" and len(dims) != 2:
        raise ValueError(f"adapter of {weight!r}: a MatMul weight of shape {list(dims)}, not 2-D")
    return nodes


def _add_overridable(graph, value: TensorProto) -> None:
    graph.initializer.append(value)
    graph.input.append(helper.make_tensor_value_info(value.name, value.data_type, list(value.dims)))


def _branch(graph, node, adapter, values, names: NameScope, node_names: NameScope) -> list:
    """The nodes of ``y + s (x A) B``, ``y`` the product ``node`` computes: its output is
    renamed, the sum takes its name (so its readers and a graph output get the sum)."""
    x, y = node.input[0], node.output[0]
    base = adapter["weight"]
    a, b = adapter["a"], adapter["b"]
    a_type = values[a].data_type
    nodes = []

    def add(op, inputs, **attrs):
        out = names.unique(f"{base}_runtime_lora_{op}")
        name = node_names.unique(f"{base}_runtime_lora_{op}")
        nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    x_type = _float_type(graph, node)
    if x_type != a_type:
        a, b = add("Cast", [a], to=x_type), add("Cast", [b], to=x_type)
    delta = add("MatMul", [add("MatMul", [x, a]), b])
    if adapter["scale"] != 1:
        scale = numpy_helper.from_array(np.asarray(adapter["scale"], dtype=np_dtype(x_type)))
        delta = add("Mul", [delta, add("Constant", [], value=scale)])
    product = names.unique(f"{y}_without_lora")
    node.output[0] = product
    add_name = node_names.unique(f"{base}_runtime_lora_Add")
    nodes.append(helper.make_node("Add", [product, delta], [y], name=add_name))
    return nodes


def _float_type(graph, node) -> int:
    """The element type of ``node``'s product: its weight's (``MatMul``), its scales'
    (``MatMulNBits``)."""
    index = 1 if node.op_type == "MatMul" else 2
    for init in graph.initializer:
        if init.name == node.input[index]:
            return init.data_type
    return TensorProto.FLOAT
