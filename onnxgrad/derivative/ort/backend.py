"""``backend="ort"``: onnxruntime-training's gradient builder behind :func:`onnx_derivative`.

The builder (``OrtModuleGraphBuilder`` of ``onnxruntime.capi._pybind_state``, onnxruntime-
training 1.19.2) differentiates the forward graph. It runs, like the check that the result
loads in an ``InferenceSession``, in a child interpreter (:mod:`.process`): onnxruntime
segfaults on some models (an output that is also a differentiated input, for one), and a
crash must become a :class:`RuntimeError`, not take the user's process down. The child
costs about 0.2 s a call on an idle machine (interpreter start and onnxruntime import,
PyTorch import blocked); the build of a small model takes milliseconds.

The result contains onnxruntime contrib ops (``com.microsoft``: ``SliceGrad``,
``BroadcastGradientArgs``, ``FusedMatMul``, ``YieldOp`` with ``KeepYieldOp``...). The
training ops onnxruntime registers in the default domain without an ONNX schema
(``AveragePoolGrad``, ``MaxPoolGrad``) are replaced by the native gradient of their forward
node (:mod:`.standard`), so onnx's full checker accepts every result
(:func:`check_gradient_model`). It runs with onnxruntime (training wheel), not with the
inference wheel or the ONNX reference evaluator.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import onnx
from onnx import ModelProto

from onnxgrad._onnx_utils import normalize_domain
from onnxgrad._runtime import require_training_builder
from onnxgrad.derivative.api import DerivativeRequest
from onnxgrad.derivative.options import DerivativeOptions
from onnxgrad.derivative.ort.checks import (
    check_built_gradients,
    check_gradient_shapes,
    refuse_known_wrong_cases,
)
from onnxgrad.derivative.ort.graph import (
    BuiltGraph,
    Forward,
    assemble,
    built_graph,
    connected_sources,
    prepare_forward,
)
from onnxgrad.derivative.ort.process import BuilderError, OrtChild
from onnxgrad.derivative.ort.standard import replace_training_ops

#: Gradient ops whose onnxruntime kernels read the output shape from the graph, not from
#: an input: the forward input must have a static shape (onnxruntime 1.19.2 otherwise
#: returns empty tensors or dies of SIGFPE at run time). ``MaxPoolGrad`` gets it from its
#: indices input and handles dynamic shapes.
STATIC_SHAPE_GRADIENTS = {"AveragePoolGrad": "AveragePool"}

_NO_GRADIENT = re.compile(r"gradient builder has not been registered: (\S+) for node (.*)$")
_UNREACHABLE = (
    re.compile(r"Cannot compute the partial derivative for '(.+?)' as it's unreachable"),
    re.compile(r"(\S+) couldn't find the consumer node"),
)


def ort_derivative(request: DerivativeRequest) -> ModelProto:
    """The gradient model of ``request`` built by onnxruntime-training (see the module doc).

    Sources (inputs, weights) no output depends on through differentiable ops get a zero
    gradient; zeros for any other source, a gradient shaped unlike its source and the
    builder cases known to be wrong (:mod:`.checks`) are refused. Raises
    ``NotImplementedError`` naming the op and node onnxruntime-training
    cannot differentiate, ``RuntimeError`` when its builder fails or crashes, ``ImportError``
    naming the wheel to install when the active onnxruntime has no training builder.
    """
    require_training_builder()
    forward = prepare_forward(request)
    sources = [*request.inputs, *request.weights]
    refuse_known_wrong_cases(forward.model, sources)
    with (
        tempfile.TemporaryDirectory(prefix="onnxgrad-ort-") as tmp,
        OrtChild(tmp) as child,
    ):
        built = _build(child, forward, request, Path(tmp))
        check_built_gradients(forward.model, built.gradients, sources)
        result = assemble(built, forward, request)
        check_gradient_shapes(result, forward.model, sources)
        check_static_pooling_shapes(forward.model, result)
        replace_training_ops(result, forward.model)
        check_gradient_model(result)
        if DerivativeOptions.KeepYieldOp not in request.options:
            path = Path(tmp) / "gradient.onnx"
            onnx.save(result, path)
            try:
                child.load(path)
            except BuilderError as exc:
                raise RuntimeError(
                    f"onnxruntime cannot load the gradient graph built with backend='ort': "
                    f"{short_message(str(exc))}; try backend='onnx'"
                ) from None
    return result


def _build(child: OrtChild, forward: Forward, request: DerivativeRequest, tmp: Path) -> BuiltGraph:
    """Run the builder, dropping the sources it finds unreachable from every output."""
    reachable = set(connected_sources(forward.model, [*request.inputs, *request.weights]))
    weights = [w for w in request.weights if w in reachable]
    inputs = [i for i in request.inputs if i in reachable]
    model_path, output_path = tmp / "forward.onnx", tmp / "yield.onnx"
    onnx.save(forward.model, model_path)
    while weights or inputs:
        try:
            info = child.build(model_path, output_path, weights, inputs)
        except BuilderError as exc:
            unreachable = unreachable_source(str(exc))
            if unreachable in weights:
                weights.remove(unreachable)
            elif unreachable in inputs:
                inputs.remove(unreachable)
            else:
                raise builder_error(str(exc), forward.model) from None
            continue
        return built_graph(onnx.load(output_path), info)
    if DerivativeOptions.KeepYieldOp in request.options:
        raise ValueError(
            "KeepYieldOp: no output depends on the selected inputs and weights, "
            "onnxruntime-training builds no graph"
        )
    return built_graph(None, None)


def unreachable_source(message: str) -> str | None:
    """The name onnxruntime-training's builder reports as not reaching any output."""
    for pattern in _UNREACHABLE:
        match = pattern.search(message)
        if match:
            return match.group(1)
    return None


def builder_error(message: str, model: ModelProto) -> Exception:
    """The exception to raise for a builder failure, naming the op and node when possible."""
    match = _NO_GRADIENT.search(message)
    if match:
        op_type, name = match.group(1), match.group(2).strip()
        return NotImplementedError(
            f"backend='ort': onnxruntime-training has no gradient for op {op_type!r} "
            f"({_describe_node(model, op_type, name)}){_native_hint(model, op_type)}"
        )
    return RuntimeError(
        f"onnxruntime-training's gradient builder (backend='ort') failed: {short_message(message)}"
    )


def _native_hint(model: ModelProto, op_type: str) -> str:
    """``; try backend='onnx'`` when the native engine can differentiate ``op_type``."""
    from onnxgrad.derivative.autodiff.registry import find_rule, has_zero_gradient

    node = next((n for n in model.graph.node if n.op_type == op_type), None)
    domain = normalize_domain(node.domain) if node is not None else ""
    opsets = {normalize_domain(o.domain): o.version for o in model.opset_import}
    if find_rule(domain, op_type, opsets.get(domain, 0)) or has_zero_gradient(domain, op_type):
        return "; try backend='onnx'"
    return "; the native backend (backend='onnx') has no rule for it either"


def _describe_node(model: ModelProto, op_type: str, name: str) -> str:
    if name:
        return f"node {name!r}"
    for index, node in enumerate(model.graph.node):
        if node.op_type == op_type:
            return f"node #{index} {op_type}({', '.join(node.input)})"
    return "unnamed node"


def short_message(message: str) -> str:
    """An onnxruntime error without the C++ source location and function signature."""
    text = message.strip()
    if "[ONNXRuntimeError]" in text:
        return text[text.index("[ONNXRuntimeError]") :]
    location = re.match(r"\S+\.(?:cc|cpp|h):\d+ ", text)
    if not location:
        return text
    depth, in_signature = 0, False
    for index in range(location.end(), len(text)):
        char = text[index]
        if char in "(<":
            depth += 1
            in_signature |= char == "("
        elif char in ")>":
            depth -= 1
        elif char == " " and depth == 0 and in_signature:
            return text[index + 1 :]
    return text


def check_static_pooling_shapes(forward: ModelProto, gradient: ModelProto) -> None:
    """Refuse pooling gradients onnxruntime-training would compute wrongly at run time.

    Its ``AveragePoolGrad`` kernel takes ``dX``'s shape from the graph; with a symbolic
    dimension (a batch size ``N``...) it returns empty tensors or dies of SIGFPE.
    """
    pooled = {
        STATIC_SHAPE_GRADIENTS[n.op_type]
        for n in gradient.graph.node
        if n.domain in ("", "ai.onnx") and n.op_type in STATIC_SHAPE_GRADIENTS
    }
    if not pooled:
        return
    shapes = _static_shapes(forward)
    for node in forward.graph.node:
        if node.op_type in pooled and shapes.get(node.input[0]) is None:
            raise NotImplementedError(
                f"backend='ort' cannot differentiate {node.op_type} node "
                f"{node.name or node.output[0]!r}: onnxruntime-training's gradient kernel "
                f"needs the static shape of its input {node.input[0]!r}, which is dynamic "
                "or unknown; use backend='onnx' or give the model's inputs fixed shapes"
            )


def _static_shapes(model: ModelProto) -> dict[str, tuple[int, ...] | None]:
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    shapes = {}
    for info in [*graph.input, *graph.value_info, *graph.output]:
        tensor = info.type.tensor_type
        dims = tensor.shape.dim if tensor.HasField("shape") else None
        static = dims is not None and all(d.HasField("dim_value") for d in dims)
        shapes[info.name] = tuple(d.dim_value for d in dims) if static else None
    return shapes


def check_gradient_model(model: ModelProto) -> None:
    """``onnx.checker.check_model(full_check=True)``: the checker skips the ops of other
    domains (``com.microsoft``) and checks the rest (structure, order, types, shapes)."""
    onnx.checker.check_model(model, full_check=True)
