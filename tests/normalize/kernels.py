"""One-node models of onnxruntime's operators, run by onnxruntime's own kernel and, lowered
by the normalisation pipeline, as standard ONNX."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxgrad._onnx_utils import elem_type, normalize_domain
from onnxgrad.normalize import normalized_model

MS = "com.microsoft"


def one_node_model(
    op: str,
    inputs: list[tuple[str, np.ndarray] | None],
    n_outputs: int = 1,
    domain: str = MS,
    opset: int = 17,
    initializers: tuple[str, ...] = (),
    out_types: tuple = (),
    **attrs,
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The model ``op(inputs)`` (``None`` for an absent optional input) and its feeds; the
    inputs named in ``initializers`` are stored in the model instead of fed; outputs are
    declared of ``out_types`` (numpy dtypes), by default of the first float input's type."""
    names, feeds, graph_inputs, inits = [], {}, [], []
    for entry in inputs:
        if entry is None:
            names.append("")
            continue
        name, value = entry
        names.append(name)
        if name in initializers:
            inits.append(onnx.numpy_helper.from_array(value, name=name))
            continue
        feeds[name] = value
        graph_inputs.append(
            helper.make_tensor_value_info(name, elem_type(value.dtype), value.shape)
        )
    outs = [f"y{i}" for i in range(n_outputs)]
    floats = (v.dtype for e in inputs if e is not None for v in [e[1]] if v.dtype.kind == "f")
    types = [elem_type(t) for t in out_types] or [elem_type(next(floats))] * n_outputs
    node = helper.make_node(op, names, outs, domain=domain, **attrs)
    graph = helper.make_graph(
        [node],
        op,
        graph_inputs,
        [helper.make_tensor_value_info(o, t, None) for o, t in zip(outs, types, strict=True)],
        inits,
    )
    imports = [helper.make_opsetid("", opset)]
    if normalize_domain(domain):
        imports.append(helper.make_opsetid(domain, 1))
    model = helper.make_model(graph, opset_imports=imports, ir_version=8)
    return model, feeds


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)


def kernel_outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """onnxruntime's kernel's outputs; a skip, with the reason, where this onnxruntime has no
    such kernel (an older release)."""
    try:
        return run(model, feeds)
    except Exception as exc:  # the message says which kernel or type is missing
        text = str(exc)
        missing = (
            "NOT_IMPLEMENTED",
            "Could not find an implementation",
            "Unrecognized attribute",
            "Only 4b quantization is supported",
        )
        if any(m in text for m in missing):
            node = model.graph.node[0]
            pytest.skip(
                f"onnxruntime {ort.__version__} has no CPU kernel for {node.op_type}: {text[:160]}"
            )
        raise


def lowered_outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The outputs of the normalised model, checked to hold default-domain operators only."""
    lowered = normalized_model(model)
    foreign = [n.op_type for n in lowered.graph.node if normalize_domain(n.domain)]
    assert not foreign, foreign
    assert all(o.domain in ("", "ai.onnx") for o in lowered.opset_import)
    onnx.checker.check_model(lowered, full_check=True)
    return run(lowered, feeds)


def assert_lowering_matches(model, feeds, rtol=1e-5, atol=1e-5, outputs=None) -> None:
    expected = kernel_outputs(model, feeds)
    got = lowered_outputs(model, feeds)
    for index in outputs if outputs is not None else range(len(expected)):
        want, have = expected[index], got[index]
        if want is None:  # an optional output older kernels leave unwritten
            continue
        assert have.dtype == want.dtype, (index, have.dtype, want.dtype)
        assert have.shape == want.shape, (index, have.shape, want.shape)
        np.testing.assert_allclose(
            have.astype(np.float64),
            want.astype(np.float64),
            rtol=rtol,
            atol=atol,
            err_msg=str(index),
        )


def assert_within(actual: np.ndarray, spec: np.ndarray, tolerance, who: str) -> None:
    """``|actual - spec| <= tolerance`` elementwise (``tolerance`` broadcast), naming the worst
    element."""
    tolerance = np.broadcast_to(np.asarray(tolerance, np.float64), np.shape(spec))
    excess = np.abs(np.asarray(actual, np.float64) - spec) - tolerance
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    assert excess[worst] <= 0, (
        f"{who}: {actual[worst]} at {worst}, the specification {spec[worst]} +- {tolerance[worst]}"
    )


def assert_lowering_and_kernel_match_spec(model, feeds, spec, tolerance, kernel_slack) -> None:
    """The first output of the lowering within ``tolerance`` of ``spec`` (the operator's
    specification computed with numpy), and onnxruntime's kernel's within ``tolerance +
    kernel_slack``: the error its u8s8 CPU path can add (``integer_products``), zero where no
    pair of products saturates int16."""
    kernel = kernel_outputs(model, feeds)[0]
    lowered = lowered_outputs(model, feeds)[0]
    assert lowered.dtype == kernel.dtype and lowered.shape == kernel.shape == np.shape(spec)
    assert_within(lowered, spec, tolerance, "the lowering")
    assert_within(kernel, spec, np.asarray(tolerance) + kernel_slack, "onnxruntime's kernel")


FLOAT16 = TensorProto.FLOAT16


def since_runtime(version: str, reason: str):
    """Skip on an onnxruntime older than ``version`` whose kernel computes otherwise."""
    from packaging.version import Version

    older = Version(ort.__version__.split("+")[0]) < Version(version)
    return pytest.mark.skipif(older, reason=f"onnxruntime {ort.__version__}: {reason}")
