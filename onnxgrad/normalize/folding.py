"""Integer expressions of constants folded into ``Constant`` nodes.

Exporters compute pads, shapes and axes at run time from constants (PyTorch's ``F.pad``
builds its pads with Shape, ConstantOfShape, Concat, Transpose, Reshape and Cast of
constant lists). Rules that need such a value (a reflect ``Pad``'s pads, a ``Reshape``'s
target) read it only when it is a constant, so a main-graph node whose inputs are all known
integer or boolean constants and whose outputs are integer or boolean is evaluated once,
with onnx's reference evaluator, and replaced by ``Constant`` nodes of the same output
names. Float results are left as they are: a float expression of weights changes with
training. Only integer initializers of rank 0 or 1 (shapes, pads, axes) count as known:
one of higher rank is data (quantized weight codes, index tables), which a quantized
weight's adapter must still see (:mod:`onnxgrad.graph.qlora`). A node that could allocate more than
:data:`MAX_ELEMENTS` elements is not evaluated.
"""

from __future__ import annotations

import numpy as np
from onnx import ModelProto, NodeProto, TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad._onnx_utils import FLOAT_TYPES, normalize_domain, subgraphs
from onnxgrad.normalize.facts import Facts

#: The largest folded value, and the largest ``ConstantOfShape`` evaluated.
MAX_ELEMENTS = 1 << 16

#: Ops whose result may be large for small inputs, or is random: never evaluated.
_UNBOUNDED = frozenset(
    {
        "Expand", "Tile", "Range", "OneHot", "EyeLike", "Resize", "Upsample", "Pad",
        "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
        "Multinomial", "Bernoulli", "Constant",
    }
)  # fmt: skip


def folded_integer_constants(model: ModelProto, facts: Facts | None = None) -> ModelProto:
    """``model`` with the integer expressions of constants of its main graph replaced by
    ``Constant`` nodes (see the module docstring); ``facts`` are forgotten if it changes."""
    graph = model.graph
    known = {
        i.name: i for i in graph.initializer if i.data_type not in FLOAT_TYPES and len(i.dims) <= 1
    }
    nodes, changed = [], False
    for node in graph.node:
        folded = _folded(node, known, model)
        if folded is None:
            _record_constant(node, known)
            nodes.append(node)
            continue
        changed = True
        for name, array in zip(node.output, folded):
            tensor = numpy_helper.from_array(array, name)
            known[name] = tensor
            nodes.append(helper.make_node("Constant", [], [name], name=node.name, value=tensor))
    if changed:
        del graph.node[:]
        graph.node.extend(nodes)
        if facts is not None:
            facts.forget()
    return model


def _record_constant(node: NodeProto, known: dict) -> None:
    if node.op_type != "Constant" or normalize_domain(node.domain) or len(node.attribute) != 1:
        return
    attr = node.attribute[0]
    if attr.name == "value" and attr.t.data_type not in FLOAT_TYPES:
        known[node.output[0]] = attr.t
    elif attr.name in ("value_int", "value_ints"):
        value = np.asarray(helper.get_attribute_value(attr), dtype=np.int64)
        known[node.output[0]] = numpy_helper.from_array(value, node.output[0])


def _folded(node: NodeProto, known: dict, model: ModelProto):
    """The node's output values when it is a foldable integer expression, else None."""
    if normalize_domain(node.domain) or node.op_type in _UNBOUNDED or subgraphs(node):
        return None
    inputs = [name for name in node.input if name]
    if not inputs or not all(name in known for name in inputs):
        return None
    feeds = {name: numpy_helper.to_array(known[name]) for name in inputs}
    if node.op_type == "ConstantOfShape" and int(np.prod(feeds[inputs[0]])) > MAX_ELEMENTS:
        return None
    try:
        results = _evaluate(node, feeds, model)
    except Exception:  # an expression the reference evaluator cannot run stays a node
        return None
    arrays = [np.asarray(r) for r in results]
    if any(a.dtype.kind not in "iub" or a.size > MAX_ELEMENTS for a in arrays):
        return None
    return arrays


def _evaluate(node: NodeProto, feeds: dict, model: ModelProto) -> list:
    inputs = [
        helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
        for name, v in feeds.items()
    ]
    outputs = [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in node.output]
    graph = helper.make_graph([node], "fold", inputs, outputs)
    single = helper.make_model(graph, opset_imports=list(model.opset_import))
    return ReferenceEvaluator(single).run(None, feeds)
