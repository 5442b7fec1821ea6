"""The kernels behind the LeNet-like train step, one at a time, on its shapes (batch 64).

* Pooling: onnxruntime's MaxPool with and without ``Indices``, and the standard-ONNX ways to
  send a 2x2 pool's gradient to each window's first maximum (64x8x24x24): through
  ``Indices`` and ``ScatterElements`` (the rule for overlapping windows), through
  ``SpaceToDepth``, ``ArgMax``, a one-hot product and ``DepthToSpace`` (the rule for windows
  that tile the input), and the formulations measured and dropped. Each is checked against
  the ``Indices`` route on ReLU-like input, where most windows tie.
* Convolutions: onnxruntime's Conv and ConvTranspose, and the kernel-gradient formulations
  the Conv rule can emit, for LeNet's two convolutions (1->8 and 8->16 channels, 5x5);
  PyTorch's own kernels on the same shapes when it is installed.

CPU time (``time.process_time``) of one run, median of ``--repeat``, one thread everywhere:
the numbers docs/benchmarks.md gives for these kernels.

    python benchmarks/bench_kernels.py [--repeat 40]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime
from onnx import ModelProto, TensorProto, helper, numpy_helper

node = helper.make_node


def ints(name: str, values) -> numpy_helper.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def floats(name: str, values) -> numpy_helper.TensorProto:
    return numpy_helper.from_array(np.array(values, np.float32), name)


def model(nodes, initializers, inputs: dict, outputs: list[str]) -> ModelProto:
    graph = helper.make_graph(
        nodes,
        "kernels",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def session(proto: ModelProto) -> onnxruntime.InferenceSession:
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(
        proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def median_us(run, repeat: int) -> float:
    run()
    times = []
    for _ in range(repeat):
        start = time.process_time()
        run()
        times.append(time.process_time() - start)
    return statistics.median(times) * 1e6


# -- pooling ----------------------------------------------------------------------------------
def pooling_models(n: int, c: int, h: int, w: int) -> dict[str, tuple[ModelProto, bool]]:
    """``{name: (model (x, g) -> (y, dx), routes to the first maximum)}`` for a 2x2 pool."""
    ho, wo = h // 2, w // 2
    io = {"x": [n, c, h, w], "g": [n, c, ho, wo]}
    pool = {"kernel_shape": [2, 2], "strides": [2, 2]}
    plain = node("MaxPool", ["x"], ["y"], **pool)
    shapes = [
        ints("flat", [-1]), ints("x_shape", [n, c, h, w]), ints("size", [n * c * h * w]),
        ints("by_window", [n, 4, -1]), ints("one_window", [n, 1, -1]),
        ints("planes", [n, 4 * c, ho, wo]), ints("offsets", np.arange(4).reshape(1, 4, 1)),
        ints("x6", [n, c, ho, 2, wo, 2]), ints("y6", [n, c, ho, 1, wo, 1]),
        ints("t6", [n, 2, 2, c, ho, wo]), floats("zero", 0.0),
    ]  # fmt: skip
    windows = [
        plain,
        node("SpaceToDepth", ["x"], ["xs"], blocksize=2),
        node("Reshape", ["xs", "by_window"], ["x4"]),
        node("Reshape", ["g", "one_window"], ["g1"]),
    ]
    one_hot = [
        node("ArgMax", ["x4"], ["first"], axis=1, keepdims=1),
        node("Equal", ["first", "offsets"], ["mask"]),
        node("Cast", ["mask"], ["maskf"], to=TensorProto.FLOAT),
        node("Mul", ["maskf", "g1"], ["d4"]),
    ]
    back = [
        node("Reshape", ["d4", "planes"], ["dp"]),
        node("DepthToSpace", ["dp"], ["dx"], blocksize=2, mode="DCR"),
    ]
    variants = {
        "MaxPool alone": ([plain, node("Identity", ["x"], ["dx"])], False),
        "MaxPool with Indices alone": (
            [node("MaxPool", ["x"], ["y", "i"], **pool), node("Identity", ["x"], ["dx"])],
            False,
        ),
        "Indices + ScatterElements (overlapping windows)": (
            [
                node("MaxPool", ["x"], ["y", "i"], **pool),
                node("ConstantOfShape", ["size"], ["zeros"]),
                node("Reshape", ["i", "flat"], ["fi"]),
                node("Reshape", ["g", "flat"], ["fg"]),
                node("ScatterElements", ["zeros", "fi", "fg"], ["s"], axis=0, reduction="add"),
                node("Reshape", ["s", "x_shape"], ["dx"]),
            ],
            True,
        ),
        "SpaceToDepth + ArgMax + Cast/Mul + DepthToSpace (tiles)": (
            windows + one_hot + back,
            True,
        ),
        "same with Where instead of Cast/Mul": (
            windows + one_hot[:2] + [node("Where", ["mask", "g1", "zero"], ["d4"])] + back,
            True,
        ),
        "Transpose instead of SpaceToDepth/DepthToSpace": (
            [
                plain,
                node("Reshape", ["x", "x6"], ["xr"]),
                node("Transpose", ["xr"], ["xt"], perm=[0, 3, 5, 1, 2, 4]),
                node("Reshape", ["xt", "by_window"], ["x4"]),
                node("Reshape", ["g", "one_window"], ["g1"]),
                *one_hot,
                node("Reshape", ["d4", "t6"], ["d6"]),
                node("Transpose", ["d6"], ["dt"], perm=[0, 3, 4, 1, 5, 2]),
                node("Reshape", ["dt", "x_shape"], ["dx"]),
            ],
            True,
        ),
        "natural layout, Equal to the maximum (every tie gets g)": (
            [
                plain,
                node("Reshape", ["x", "x6"], ["xr"]),
                node("Reshape", ["y", "y6"], ["yr"]),
                node("Reshape", ["g", "y6"], ["gr"]),
                node("Equal", ["xr", "yr"], ["mask"]),
                node("Cast", ["mask"], ["maskf"], to=TensorProto.FLOAT),
                node("Mul", ["maskf", "gr"], ["d6"]),
                node("Reshape", ["d6", "x_shape"], ["dx"]),
            ],
            False,
        ),
    }
    return {
        name: (model(nodes, shapes, io, ["y", "dx"]), first)
        for name, (nodes, first) in variants.items()
    }


def bench_pooling(repeat: int) -> None:
    n, c, h, w = 64, 8, 24, 24
    rng = np.random.default_rng(0)
    x = np.maximum(rng.standard_normal((n, c, h, w)), 0).astype(np.float32)
    g = rng.standard_normal((n, c, h // 2, w // 2)).astype(np.float32)
    feeds = {"x": x, "g": g}
    models = pooling_models(n, c, h, w)
    sessions = {name: session(proto) for name, (proto, _) in models.items()}
    reference = sessions["Indices + ScatterElements (overlapping windows)"].run(["dx"], feeds)[0]
    print(f"MaxPool 2x2 stride 2 on {n}x{c}x{h}x{w} and its gradient (ReLU-like input):")
    for name, sess in sessions.items():
        same = ""
        if models[name][1]:
            agrees = np.array_equal(sess.run(["dx"], feeds)[0], reference)
            same = "same routing as Indices" if agrees else "DIFFERENT routing"
        print(f"  {median_us(lambda s=sess: s.run(None, feeds), repeat):8.0f} us  {name}  {same}")


# -- convolutions -----------------------------------------------------------------------------
def conv_models(n: int, c: int, size: int, m: int, k: int) -> dict[str, ModelProto]:
    out = size - k + 1
    io = {"x": [n, c, size, size], "w": [m, c, k, k], "g": [n, m, out, out]}
    swap = [1, 0, 2, 3]
    one_hot = floats("one_hot", np.eye(k * k).reshape(k * k, 1, k, k))
    shapes = [
        one_hot, ints("images", [-1, 1, size, size]), ints("p3", [n, c * k * k, out * out]),
        ints("g3", [n, m, out * out]), ints("w_shape", [m, c, k, k]), ints("axis0", [0]),
        ints("p2", [c * k * k, -1]), ints("g2", [m, -1]),
    ]  # fmt: skip
    patches = [
        node("Reshape", ["x", "images"], ["xm"]), node("Conv", ["xm", "one_hot"], ["p"]),
        node("Reshape", ["p", "p3"], ["pr"]), node("Reshape", ["g", "g3"], ["gr"]),
    ]  # fmt: skip
    graphs = {
        "Conv (forward)": [node("Conv", ["x", "w"], ["out"])],
        "ConvTranspose (input gradient)": [node("ConvTranspose", ["g", "w"], ["out"])],
        "kernel gradient: Conv over swapped axes (the rule's)": [
            node("Transpose", ["x"], ["xt"], perm=swap),
            node("Transpose", ["g"], ["gt"], perm=swap),
            node("Conv", ["xt", "gt"], ["z"]),
            node("Transpose", ["z"], ["out"], perm=swap),
        ],
        "kernel gradient: one-hot Conv im2col + batched MatMul": [
            *patches,
            node("Transpose", ["pr"], ["pt"], perm=[0, 2, 1]),
            node("MatMul", ["gr", "pt"], ["b"]),
            node("ReduceSum", ["b", "axis0"], ["s"], keepdims=0),
            node("Reshape", ["s", "w_shape"], ["out"]),
        ],
        "kernel gradient: one-hot Conv im2col + one Gemm": [
            *patches,
            node("Transpose", ["pr"], ["pt"], perm=[1, 0, 2]),
            node("Reshape", ["pt", "p2"], ["pm"]),
            node("Transpose", ["gr"], ["gt"], perm=[1, 0, 2]),
            node("Reshape", ["gt", "g2"], ["gm"]),
            node("Gemm", ["gm", "pm"], ["s"], transB=1),
            node("Reshape", ["s", "w_shape"], ["out"]),
        ],
    }
    return {name: model(nodes, shapes, io, ["out"]) for name, nodes in graphs.items()}


def torch_conv_times(n, c, size, m, k, repeat) -> dict[str, float]:
    try:
        import torch
    except ImportError:
        return {}
    torch.set_num_threads(1)
    x, w = torch.randn(n, c, size, size), torch.randn(m, c, k, k)
    b, g = torch.randn(m), torch.randn(n, m, size - k + 1, size - k + 1)
    backward = torch.ops.aten.convolution_backward

    def whole_backward():
        masks = [c > 1, True, True]  # LeNet's first layer needs no input gradient
        return backward(g, x, w, [m], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, masks)

    return {
        "PyTorch conv2d (forward)": median_us(lambda: torch.nn.functional.conv2d(x, w, b), repeat),
        "PyTorch convolution_backward (input if needed, kernel, bias)": median_us(
            whole_backward, repeat
        ),
    }


def bench_convolutions(repeat: int) -> None:
    rng = np.random.default_rng(0)
    for n, c, size, m, k in [(64, 1, 28, 8, 5), (64, 8, 12, 16, 5)]:
        out = size - k + 1
        feeds = {
            "x": rng.standard_normal((n, c, size, size)).astype(np.float32),
            "w": rng.standard_normal((m, c, k, k)).astype(np.float32),
            "g": rng.standard_normal((n, m, out, out)).astype(np.float32),
        }
        print(f"Conv {c}->{m} channels, {k}x{k}, on {n}x{c}x{size}x{size}:")
        results = {}
        for name, proto in conv_models(n, c, size, m, k).items():
            sess = session(proto)
            used = {i.name: feeds[i.name] for i in sess.get_inputs()}
            results[name] = sess.run(None, used)[0]
            print(f"  {median_us(lambda s=sess, f=used: s.run(None, f), repeat):8.0f} us  {name}")
        kernels = [v for name, v in results.items() if name.startswith("kernel")]
        scale = np.abs(kernels[0]).max()
        agree = all(np.abs(v - kernels[0]).max() <= 1e-5 * scale for v in kernels)
        print(f"            kernel gradients agree: {agree}")
        for name, us in torch_conv_times(n, c, size, m, k, repeat).items():
            print(f"  {us:8.0f} us  {name}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=40)
    args = parser.parse_args(argv)
    bench_pooling(args.repeat)
    bench_convolutions(args.repeat)


if __name__ == "__main__":
    main()
