"""Native (backend="onnx") against onnxruntime-training (backend="ort") gradient graphs.

For each model: time to build the gradient graph, its node count, and the median time of
one gradient evaluation with onnxruntime on CPU. Also the build time of a 5,000-node graph.

    python benchmarks/bench_gradient.py [--repeat 50] [--json results.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import numpy as np
import onnxruntime
from onnx import ModelProto, TensorProto, helper, numpy_helper

from onnxgrad import DerivativeOptions, onnx_derivative


def mlp_model(sizes=(784, 512, 512, 10), seed=0) -> ModelProto:
    """Dense ReLU network, logits output, weights as initializers."""
    rng = np.random.default_rng(seed)
    nodes, inits, prev = [], [], "X"
    for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
        w = (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)
        inits += [
            numpy_helper.from_array(w, f"W{i}"),
            numpy_helper.from_array(np.zeros(n_out, np.float32), f"B{i}"),
        ]
        nodes += [
            helper.make_node("MatMul", [prev, f"W{i}"], [f"m{i}"]),
            helper.make_node("Add", [f"m{i}", f"B{i}"], [f"a{i}"]),
        ]
        prev = f"a{i}"
        if i < len(sizes) - 2:
            nodes.append(helper.make_node("Relu", [prev], [f"r{i}"]))
            prev = f"r{i}"
    nodes.append(helper.make_node("Identity", [prev], ["Y"]))
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", sizes[0]])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", sizes[-1]])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def cnn_model(seed=0) -> ModelProto:
    """Conv(3->16, 3x3) Relu MaxPool Conv(16->32, 3x3, stride 2) Relu GlobalAveragePool Gemm."""
    rng = np.random.default_rng(seed)

    def init(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32), name)

    node = helper.make_node
    nodes = [
        node("Conv", ["X", "C1", "c1"], ["h1"], pads=[1, 1, 1, 1]),
        node("Relu", ["h1"], ["h2"]),
        node("MaxPool", ["h2"], ["h3"], kernel_shape=[2, 2], strides=[2, 2]),
        node("Conv", ["h3", "C2", "c2"], ["h4"], strides=[2, 2], pads=[1, 1, 1, 1]),
        node("Relu", ["h4"], ["h5"]),
        node("GlobalAveragePool", ["h5"], ["h6"]),
        node("Flatten", ["h6"], ["h7"]),
        node("Gemm", ["h7", "D", "d"], ["Y"], transB=1),
    ]
    inits = [
        init("C1", 16, 3, 3, 3),
        init("c1", 16),
        init("C2", 32, 16, 3, 3),
        init("c2", 32),
        init("D", 10, 32),
        init("d", 10),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3, 32, 32])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 10])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def chain_model(n_nodes=5000) -> ModelProto:
    """A long chain alternating Add, Mul and Tanh with per-node weights."""
    nodes, inits, prev = [], [], "X"
    ops = ["Add", "Mul", "Tanh"]
    for i in range(n_nodes):
        op = ops[i % 3]
        inputs = [prev] if op == "Tanh" else [prev, f"w{i}"]
        if op != "Tanh":
            inits.append(numpy_helper.from_array(np.full(8, 0.5, np.float32), f"w{i}"))
        nodes.append(helper.make_node(op, inputs, [f"v{i}"], name=f"n{i}"))
        prev = f"v{i}"
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, ["N", 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _session(model: ModelProto) -> onnxruntime.InferenceSession:
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 2
    return onnxruntime.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _feeds(grad: ModelProto, forward: ModelProto, batch: int) -> dict:
    rng = np.random.default_rng(1)
    values = {i.name: numpy_helper.to_array(i) for i in forward.graph.initializer}
    feeds = {}
    for info in grad.graph.input:
        dims = [d.dim_value or batch for d in info.type.tensor_type.shape.dim]
        feeds[info.name] = values.get(info.name, rng.standard_normal(dims).astype(np.float32))
    return feeds


def measure(name: str, model: ModelProto, batch: int, repeat: int) -> list[dict]:
    rows = []
    for backend in ("ort", "onnx"):
        start = time.perf_counter()
        grad = onnx_derivative(model, inputs=[], options=DerivativeOptions.Zero, backend=backend)
        build = time.perf_counter() - start
        session = _session(grad)
        feeds = _feeds(grad, model, batch)
        for _ in range(5):
            session.run(None, feeds)
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            session.run(None, feeds)
            times.append(time.perf_counter() - start)
        rows.append(
            {
                "model": name,
                "backend": backend,
                "nodes": len(grad.graph.node),
                "build_s": build,
                "run_ms": 1000 * statistics.median(times),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    rows = measure("mlp 784-512-512-10 batch 64", mlp_model(), 64, args.repeat)
    rows += measure("cnn 3x32x32 batch 32", cnn_model(), 32, args.repeat)
    print(f"{'model':30s} {'backend':7s} {'nodes':>6s} {'build s':>8s} {'run ms':>8s}")
    for row in rows:
        print(
            f"{row['model']:30s} {row['backend']:7s} {row['nodes']:6d} "
            f"{row['build_s']:8.3f} {row['run_ms']:8.3f}"
        )
    for model in {r["model"] for r in rows}:
        ort, native = (next(r for r in rows if r["model"] == model and r["backend"] == b)
                       for b in ("ort", "onnx"))  # fmt: skip
        print(f"{model}: native/ort run time = {native['run_ms'] / ort['run_ms']:.3f}")
    chain = chain_model()
    start = time.perf_counter()
    onnx_derivative(chain, options=DerivativeOptions.FillGrad)
    chain_s = time.perf_counter() - start
    print(f"native build of a {len(chain.graph.node)}-node graph: {chain_s:.2f} s")
    rows.append({"model": "chain-5000", "backend": "onnx", "build_s": chain_s})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
