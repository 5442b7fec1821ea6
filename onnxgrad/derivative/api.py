"""``onnx_derivative``: resolves what to differentiate, then hands over to a backend.

Both backends receive the same resolved request and return graphs with the same interface:

* inputs: the model's inputs, then the differentiated weights (former initializers, same
  names), then one ``<output>_grad`` per differentiated output (``Zero`` only);
* outputs: ``<input>_grad`` for each differentiated input, then ``<weight>_grad`` for each
  weight, then the original outputs (``KeepOutputs``) or the loss (``Loss``).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

from onnx import ModelProto

from onnxgrad._onnx_utils import (
    FLOAT_TYPES,
    ModelLike,
    protobuf_failures_as_memory_errors,
    real_inputs,
    supported_ir_version,
)
from onnxgrad.derivative.options import DerivativeOptions, check_options
from onnxgrad.derivative.recompute import check_recompute
from onnxgrad.derivative.seeds import batch_seeds, check_seeds
from onnxgrad.normalize import normalized_model
from onnxgrad.normalize.facts import Facts
from onnxgrad.normalize.ste import quantized_activations as rounding

#: backend name -> "module:function" implementing ``fn(request) -> ModelProto``.
BACKENDS = {
    "onnx": "onnxgrad.derivative.native:native_derivative",
    "ort": "onnxgrad.derivative.ort.backend:ort_derivative",
}


@dataclass(frozen=True)
class DerivativeRequest:
    """A validated request: the model (a private copy) and what to differentiate."""

    model: ModelProto
    weights: tuple[str, ...]
    inputs: tuple[str, ...]
    options: DerivativeOptions
    loss: str | None = None
    label: str | None = None
    #: the outputs whose gradient is seeded (``<output>_grad`` inputs, ones or the loss)
    outputs: tuple[str, ...] = ()
    #: forward values rebuilt in the backward (:mod:`onnxgrad.derivative.recompute`)
    recompute: object = None
    #: leaves in the order onnxruntime should run them (:mod:`onnxgrad.derivative.leaf_order`):
    #: for a graph run as it is, not one a train step appends its update to
    order_leaves: bool = True
    #: a result where no seeded output depends on a source at all is zeros, not an error
    #: (forward mode's transposition: a tangent the reverse graph never reads is 0)
    structural_zeros: bool = False
    #: run onnx's full check on the result (off for an intermediate graph checked later)
    checked: bool = True
    #: what the normalisation knows of ``model`` as it stands: the engine takes its shape
    #: inference where it is the engine's (:meth:`~onnxgrad.normalize.facts.Facts.take_inferred`,
    #: the facts then forget it: nothing holds it past the engine's types); ``None``: infer
    facts: Facts | None = None


@protobuf_failures_as_memory_errors()
def onnx_derivative(
    model: ModelLike,
    weights: Sequence[str] | None = None,
    inputs: Sequence[str] | None = None,
    options: DerivativeOptions | int = DerivativeOptions.Zero,
    loss: str | None = None,
    label: str | None = None,
    backend: str = "onnx",
    outputs: Sequence[str] | None = None,
    recompute: str | Sequence[str] | None = None,
    quantized_activations: str = "straight_through",
    seeds: int | None = None,
) -> ModelProto:
    """The gradient graph of ``model`` with respect to weights and/or inputs.

    For outputs ``y_k = f_k(x, w)`` and output gradients ``g_k`` (``<y_k>_grad`` inputs,
    ones with ``FillGrad``, 1 for the loss with ``Loss``), the graph returns the
    vector-Jacobian products ``x_grad = sum_k g_k . dy_k/dx`` and ``w_grad = sum_k g_k . dy_k/dw``.

    :param model: ModelProto or path; never modified. It is first made regular by
        :func:`onnxgrad.normalize.normalized_model` (``ValueError`` naming the node or value
        at fault): nodes in topological order, weights stored as ``Constant`` nodes become
        initializers, a model below opset 13 is converted to it, ``ai.onnx.ml`` operators
        are lowered into standard ONNX (ZipMap dropped, its probability tensor exposed as
        the output ``probabilities``), declared shapes are reconciled with inferred ones.
    :param weights: initializers to differentiate; ``None`` means every weight returned by
        :func:`onnxgrad.get_train_initializer`, ``[]`` none. They become graph inputs.
    :param inputs: graph inputs to differentiate; ``None`` means every float input (the
        label excepted with ``Loss``), ``[]`` none.
    :param options: :class:`DerivativeOptions` flags.
    :param loss: with ``Loss``, the name of the scalar loss output (default: ``'loss'`` if it
        exists, else the only output).
    :param label: with ``Loss``, the name of the label input (excluded from the default inputs).
    :param backend: ``"onnx"`` (native engine, standard ONNX ops only) or ``"ort"``
        (onnxruntime-training's gradient builder).
    :param outputs: the outputs ``y_k`` to differentiate (PyTorch's ``outputs`` of
        ``torch.autograd.grad``): only they get a ``<y_k>_grad`` input (``Zero``) or a seed of
        ones (``FillGrad``); the others count as constants. ``None``: every float output.
        An integer (or other non-float) output is never differentiated: it has no gradient
        input. ``KeepOutputs`` still returns every output. With ``Loss``, the loss is the
        one output differentiated.
    :param recompute: forward values the backward recomputes instead of keeping them from
        the forward (less memory; ``backend="onnx"`` only): ``"attention"`` (attentions whose
        scores may be large computed in tiles of query rows, forward and backward, and
        backward work that reads forward values only made to wait for the gradient),
        ``"auto"`` (that, and cheap values recomputed), or a list of regular expressions
        naming blocks to checkpoint, e.g. ``[r"layers\\.\\d+"]`` (see
        :mod:`onnxgrad.derivative.recompute`); ``None`` (default here; the training entries
        default to ``"attention"``): the backward as the rules build it.
    :param quantized_activations: how rounded activations (QDQ pairs,
        ``DynamicQuantizeLinear``) are differentiated: ``"straight_through"`` (default, for
        training: the estimator, identity inside the quantization range) or ``"exact"`` (for
        analysis: the derivative of the file itself, rounding held, dynamic scales still
        differentiated; :mod:`onnxgrad.normalize.ste`).
    :param seeds: ``k`` output gradients per run (``Zero`` and ``KeepOutputs`` only): every
        ``<y>_grad`` input and ``<x>_grad`` output gets a leading axis of size ``k``, the
        ``i``-th gradient being that of the ``i``-th seed
        (:mod:`onnxgrad.derivative.seeds`); ``None``: one seed, no extra axis.
    """
    options = _check_arguments(options, backend)
    seeds = check_seeds(seeds)
    seeded = options & (DerivativeOptions.FillGrad | DerivativeOptions.Loss)
    if seeds is not None and (backend != "onnx" or seeded):
        raise ValueError(
            "seeds= needs backend='onnx' and output gradients as inputs (options Zero or "
            f"KeepOutputs), not backend={backend!r} with {options!r}"
        )
    facts = Facts()
    with rounding(quantized_activations):
        model = normalized_model(model, facts)
    outputs_of_model = {o.name for o in model.graph.output}
    result = derive_in_place(
        model,
        weights,
        inputs,
        options,
        loss,
        label,
        backend,
        outputs=outputs,
        recompute=recompute,
        checked=seeds is None,  # batch_seeds checks the batched graph
        facts=facts,
    )
    if seeds is None:
        return result
    return batch_seeds(result, *_seed_names(result, outputs_of_model), seeds)


def _seed_names(gradient: ModelProto, model_outputs: set[str]) -> tuple[list[str], list[str]]:
    """``(the <y>_grad inputs, the <x>_grad outputs)`` of a gradient graph."""
    inputs = {i.name for i in gradient.graph.input}
    seeds = [
        i.name
        for i in gradient.graph.input
        if i.name.endswith("_grad") and i.name[: -len("_grad")] in model_outputs
    ]
    results = [
        o.name
        for o in gradient.graph.output
        if o.name.endswith("_grad") and o.name[: -len("_grad")] in inputs
    ]
    return seeds, results


def derive_in_place(
    model: ModelProto,
    weights: Sequence[str] | None = None,
    inputs: Sequence[str] | None = None,
    options: DerivativeOptions | int = DerivativeOptions.Zero,
    loss: str | None = None,
    label: str | None = None,
    backend: str = "onnx",
    outputs: Sequence[str] | None = None,
    recompute: str | Sequence[str] | None = None,
    order_leaves: bool = True,
    structural_zeros: bool = False,
    checked: bool = True,
    facts: Facts | None = None,
) -> ModelProto:
    """:func:`onnx_derivative` of a private model already normalised (see
    :func:`onnxgrad.normalize.normalized_model`), which it may rewrite into the result:
    the command and the train step use it so that no weight is copied (``order_leaves``:
    ``structural_zeros``, ``checked``, ``facts``: see :class:`DerivativeRequest`)."""
    options = _check_arguments(options, backend)
    model.ir_version = supported_ir_version(model)
    request = resolve_request(model, weights, inputs, options, loss, label, outputs)
    request = replace(
        with_recompute(request, recompute, backend),
        order_leaves=order_leaves,
        structural_zeros=structural_zeros,
        checked=checked,
        facts=facts,
    )
    module_name, function_name = BACKENDS[backend].split(":")
    return getattr(importlib.import_module(module_name), function_name)(request)


def with_recompute(request: DerivativeRequest, recompute, backend: str) -> DerivativeRequest:
    """``request`` with a checked ``recompute`` choice."""
    if recompute is not None and backend != "onnx":
        raise ValueError(f"recompute={recompute!r} needs backend='onnx', not {backend!r}")
    check_recompute(recompute)
    return replace(request, recompute=recompute)


def _check_arguments(options: DerivativeOptions | int, backend: str) -> DerivativeOptions:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}, expected one of {sorted(BACKENDS)}")
    return check_options(options, backend)


def resolve_request(
    model: ModelProto,
    weights: Sequence[str] | None,
    inputs: Sequence[str] | None,
    options: DerivativeOptions,
    loss: str | None,
    label: str | None,
    outputs: Sequence[str] | None = None,
) -> DerivativeRequest:
    """Check names and fill the defaults of :func:`onnx_derivative`."""
    if DerivativeOptions.Loss in options:
        loss, label = _resolve_loss(model, loss, label)
    elif loss is not None or label is not None:
        raise ValueError("loss= and label= need options=DerivativeOptions.Loss")
    resolved_weights = _resolve_weights(model, weights)
    resolved_inputs = _resolve_inputs(model, inputs, exclude=label)
    if not resolved_weights and not resolved_inputs:
        raise ValueError("nothing to differentiate: no weight and no input selected")
    resolved_outputs = _resolve_outputs(model, outputs, options, loss)
    return DerivativeRequest(
        model, resolved_weights, resolved_inputs, options, loss, label, resolved_outputs
    )


def _resolve_outputs(
    model: ModelProto, outputs: Sequence[str] | None, options: DerivativeOptions, loss: str | None
) -> tuple[str, ...]:
    """The outputs to differentiate: ``outputs`` checked, by default every float output
    (the loss alone with ``Loss``)."""
    infos = {o.name: o for o in model.graph.output}
    if DerivativeOptions.Loss in options:
        if outputs is not None and list(_string_list(outputs, "outputs")) != [loss]:
            raise ValueError(
                f"outputs={list(outputs)!r}: with DerivativeOptions.Loss the loss {loss!r} is "
                "the one output differentiated"
            )
        return (loss,)
    if outputs is None:  # an output of undeclared type may be float: the engine will say
        return tuple(n for n, o in infos.items() if _maybe_float(o))
    names = _string_list(outputs, "outputs")
    unknown = [n for n in names if n not in infos]
    if unknown:
        raise ValueError(f"unknown outputs {unknown}, the model's outputs are {list(infos)}")
    not_float = [n for n in names if not _maybe_float(infos[n])]
    if not_float:
        raise ValueError(f"outputs {not_float} are not float tensors and have no gradient")
    if not names:
        raise ValueError("outputs=[]: nothing to differentiate")
    return tuple(names)


def _string_list(names: Sequence[str], what: str) -> list[str]:
    if isinstance(names, str):
        raise TypeError(f"{what} must be a list of names, not the string {names!r}")
    names = list(names)
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{what} lists {duplicates} more than once")
    return names


def _resolve_weights(model: ModelProto, weights: Sequence[str] | None) -> tuple[str, ...]:
    from onnxgrad.graph.initializers import train_initializer_names

    if weights is None:
        return tuple(train_initializer_names(model))
    names = _string_list(weights, "weights")
    initializers = {init.name: init for init in model.graph.initializer}
    unknown = [n for n in names if n not in initializers]
    if unknown:
        raise ValueError(f"unknown weights {unknown}: they are not initializers of the model")
    not_float = [n for n in names if initializers[n].data_type not in FLOAT_TYPES]
    if not_float:
        raise ValueError(f"weights {not_float} are not float tensors and have no gradient")
    return tuple(names)


def graph_inputs(model: ModelProto) -> list[str]:
    """Names of the inputs a caller feeds (see :func:`onnxgrad._onnx_utils.real_inputs`)."""
    return [i.name for i in real_inputs(model)]


def _resolve_inputs(
    model: ModelProto, inputs: Sequence[str] | None, exclude: str | None
) -> tuple[str, ...]:
    types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    real_inputs = graph_inputs(model)
    if inputs is None:
        return tuple(n for n in real_inputs if types[n] in FLOAT_TYPES and n != exclude)
    names = _string_list(inputs, "inputs")
    unknown = [n for n in names if n not in real_inputs]
    if unknown:
        raise ValueError(f"unknown inputs {unknown}, the model's inputs are {real_inputs}")
    not_float = [n for n in names if types[n] not in FLOAT_TYPES]
    if not_float:
        raise ValueError(f"inputs {not_float} are not float tensors and have no gradient")
    return tuple(names)


def _resolve_loss(model: ModelProto, loss: str | None, label: str | None) -> tuple[str, str | None]:
    outputs = [o.name for o in model.graph.output]
    if loss is None:
        if "loss" in outputs:
            loss = "loss"
        elif len(outputs) == 1:
            loss = outputs[0]
        else:
            raise ValueError(f"the model has several outputs {outputs}: name the loss with loss=")
    if loss not in outputs:
        raise ValueError(f"loss output {loss!r} not found among the outputs {outputs}")
    _check_scalar_loss(next(o for o in model.graph.output if o.name == loss))
    if label is not None and label not in graph_inputs(model):
        raise ValueError(f"label input {label!r} not found among the inputs {graph_inputs(model)}")
    return loss, label


def _maybe_float(output) -> bool:
    """A float output, or one whose element type is not declared."""
    elem_type = output.type.tensor_type.elem_type
    return elem_type in FLOAT_TYPES or elem_type == 0


def _check_scalar_loss(output) -> None:
    """A loss is one float number: shape ``[]``, ``[1]``, ``[1, 1]``... (unknown shapes pass)."""
    tensor = output.type.tensor_type
    if tensor.elem_type and tensor.elem_type not in FLOAT_TYPES:
        raise ValueError(f"loss output {output.name!r} is not a float tensor")
    if tensor.HasField("shape"):
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        if any(d is not None and d != 1 for d in dims):
            raise ValueError(
                f"loss output {output.name!r} has shape {dims}: DerivativeOptions.Loss needs a "
                "scalar loss (use FillGrad to differentiate the sum of an output)"
            )
