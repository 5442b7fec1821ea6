"""Models from elsewhere: declared sizes never drive an allocation, lying or damaged models
end in a ValueError naming the cause.

The cases run in one child under a memory cap (tests/security/isolated.py): before the
bounded inference (onnxgrad/_bounded_inference.py), onnx's data propagation allocated a
list element per declared element of a 1-D value, so each case below took gigabytes.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import onnx_derivative
from tests.security.isolated import accepted, refused, run_cases

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX resource limits")

#: Memory for the cases that must succeed: the libraries, plus the 64 MiB weight twice.
CAP = 1536 * 2**20


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _float(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def declared_dim(n: int) -> onnx.ModelProto:
    """The 88-byte attack: one Mul on an input declaring ``n`` elements."""
    return _model(
        [helper.make_node("Mul", ["X", "X"], ["Y"])], [_float("X", [n])], [_float("Y", [n])]
    )


def flattened(side: int) -> onnx.ModelProto:
    """Small declared dims whose product, through a constant Reshape, is a long 1-D value."""
    shape = numpy_helper.from_array(np.array([-1], np.int64), "flat")
    nodes = [
        helper.make_node("Reshape", ["X", "flat"], ["r"]),
        helper.make_node("Mul", ["r", "r"], ["Y"]),
    ]
    return _model(nodes, [_float("X", [side, side])], [_float("Y", ["M"])], [shape])


def computed_shape(side: int) -> onnx.ModelProto:
    """The same length computed from Shape: only data propagation can size it."""
    nodes = [
        helper.make_node("Shape", ["X"], ["s"]),
        helper.make_node("ReduceProd", ["s"], ["n"], keepdims=1),
        helper.make_node("Reshape", ["X", "n"], ["r"]),
        helper.make_node("Mul", ["r", "r"], ["Y"]),
    ]
    return _model(nodes, [_float("X", [side, side])], [_float("Y", ["M"])])


def one_d_weight(n: int) -> onnx.ModelProto:
    """A legitimate model: a 1-D weight of ``n`` floats (64 MiB for 2**24)."""
    weight = numpy_helper.from_array(np.linspace(-1, 1, n, dtype=np.float32), "W")
    nodes = [helper.make_node("Mul", ["X", "W"], ["Y"])]
    return _model(nodes, [_float("X", [n])], [_float("Y", [n])], [weight])


SUCCEEDING = {
    "declared-2^31": lambda: declared_dim(2**31),
    "declared-2^40": lambda: declared_dim(2**40),
    "flattened-2^16-squared": lambda: flattened(2**16),
    "computed-2^16-squared": lambda: computed_shape(2**16),
    "weight-2^24-floats": lambda: one_d_weight(2**24),
}


def _lying_initializer() -> onnx.ModelProto:
    """An initializer declaring 2**31 x 4 elements and holding 12."""
    lying = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[2**31, 4])
    lying.raw_data = np.arange(12, dtype=np.float32).tobytes()
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("Mul", ["h2", "h2"], ["Y"]),
    ]
    return _model(nodes, [_float("X", ["N", 3])], [_float("Y", None)], [lying])


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    cases = {}
    for key, build in SUCCEEDING.items():
        folder = tmp_path_factory.mktemp(key.replace("^", ""))
        onnx.save(build(), folder / "m.onnx")
        cases[key] = (folder, "from onnxgrad import onnx_derivative\nonnx_derivative('m.onnx')\n")
    folder = tmp_path_factory.mktemp("lying")
    onnx.save(_lying_initializer(), folder / "m.onnx")
    cases["lying-initializer"] = (
        folder,
        "from onnxgrad import onnx_derivative\nonnx_derivative('m.onnx')\n",
    )
    cases["byte-flips"] = (folder, _BYTE_FLIPS)
    return run_cases(cases, cap=CAP)


@pytest.mark.parametrize("key", sorted(SUCCEEDING))
def test_declared_sizes_do_not_drive_allocations(reports, key):
    accepted(reports[key])
    assert reports[key]["peak_mib"] < 1024, reports[key]


def test_an_initializer_lying_about_its_dims_is_named(reports):
    refused(reports["lying-initializer"], "ValueError", "initializer 'W'", "48 bytes")


#: Every byte of a small model flipped three ways: each result loads and differentiates,
#: or raises ValueError / NotImplementedError / TypeError (never KeyError or onnx's errors).
_BYTE_FLIPS = """
import numpy as np, onnx
from onnx import TensorProto, helper, numpy_helper
from onnxgrad import onnx_derivative
W = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "W")
nodes = [helper.make_node("MatMul", ["X", "W"], ["h1"]), helper.make_node("Relu", ["h1"], ["h2"]),
         helper.make_node("Mul", ["h2", "h2"], ["Y"])]
graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", 1, ["N", 3])],
                          [helper.make_tensor_value_info("Y", 1, ["N", 4])], [W])
data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                         ir_version=8).SerializeToString()
bad = []
for index in range(len(data)):
    for bits in (0x01, 0x80, 0xFF):
        flipped = bytearray(data)
        flipped[index] ^= bits
        try:
            model = onnx.load_from_string(bytes(flipped))
        except Exception:
            continue  # protobuf refuses it: onnxgrad.load_model names the file
        try:
            onnx_derivative(model)
        except (ValueError, NotImplementedError, TypeError):
            pass
        except Exception as exc:
            bad.append((index, bits, type(exc).__name__, str(exc)[:200]))
assert not bad, bad
"""


def test_byte_flipped_models_end_in_value_errors(reports):
    accepted(reports["byte-flips"])


def test_the_bounded_inference_keeps_static_shapes(tmp_path):
    """Shape data still flows where the model provides it: Shape -> Gather -> Concat ->
    Reshape gives the static shape numpy gives."""
    starts = numpy_helper.from_array(np.array([0], np.int64), "zero")
    minus = numpy_helper.from_array(np.array([-1], np.int64), "minus")
    nodes = [
        helper.make_node("Shape", ["X"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Concat", ["n", "minus"], ["target"], axis=0),
        helper.make_node("Reshape", ["X", "target"], ["Y"]),
    ]
    model = _model(nodes, [_float("X", [2, 3, 4])], [_float("Y", ["a", "b"])], [starts, minus])
    from onnxgrad.derivative.autodiff.value_types import infer_value_types

    expected = np.zeros((2, 3, 4)).reshape(2, -1).shape
    assert infer_value_types(model)["Y"].shape == expected
    grad = onnx_derivative(model)
    assert [d.dim_value for d in grad.graph.output[0].type.tensor_type.shape.dim] == [2, 3, 4]


def test_the_engine_sees_onnxs_error_for_a_model_it_cannot_type(tmp_path):
    """onnx cannot type ``h`` (a [N, 2] x [3, 4] MatMul). The rules never read ``h`` (Relu's
    reads its output ``Y``), so the gradient is built and the final check quotes onnx's
    error for the MatMul."""
    model = _model(
        [helper.make_node("MatMul", ["X", "W"], ["h"]), helper.make_node("Relu", ["h"], ["Y"])],
        [_float("X", ["N", 2])],
        [_float("Y", ["N", 4])],
        [numpy_helper.from_array(np.ones((3, 4), np.float32), "W")],
    )
    onnxs = r"op_type:MatMul\): \[ShapeInferenceError\] Incompatible dimensions"
    with pytest.raises(ValueError, match=r"fails onnx's check \(.*" + onnxs):
        onnx_derivative(model)
