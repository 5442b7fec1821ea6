"""Values recomputed in the backward (``recompute=``) give the gradients of the plain graph.

References: float64 central finite differences of the forward model (an attention block
built node by node), and the gradient graph without recomputation on networks exported by
PyTorch (a transformer classifier, a Llama-like LM, a residual network), which must agree
to 1e-6. Structure: a recomputed value is no longer read by the backward, and each copy
depends on a backward value (its gate), so onnxruntime cannot run it before the backward.
"""

from __future__ import annotations

import functools
import io
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import onnx_derivative
from onnxgrad.derivative import DerivativeOptions
from onnxgrad.training.step.composition import make_train_step
from tests.derivative.fd import onnx_numerical_vjp, run_onnxruntime

RNG = np.random.default_rng(0)


def attention_model(dtype=np.float64, seq: int = 4, dim: int = 3) -> onnx.ModelProto:
    """``loss = sum(tanh(softmax(Q K^T * s + M) V) * c)`` with ``Q = x Wq`` etc., the nodes
    of the block named ``block/...``, the loss outside it."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    weights = {name: RNG.standard_normal((dim, dim)).astype(dtype) for name in ("Wq", "Wk", "Wv")}
    mask = np.triu(np.full((seq, seq), -1e4), 1).astype(dtype)
    inits = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    inits += [
        numpy_helper.from_array(mask, "M"),
        numpy_helper.from_array(np.array(0.5, dtype), "s"),
        numpy_helper.from_array(RNG.standard_normal((seq, dim)).astype(dtype), "c"),
    ]
    nodes = [
        ("MatMul", ["x", "Wq"], "q"),
        ("MatMul", ["x", "Wk"], "k"),
        ("MatMul", ["x", "Wv"], "v"),
        ("Transpose", ["k"], "kt"),
        ("MatMul", ["q", "kt"], "scores"),
        ("Mul", ["scores", "s"], "scaled"),
        ("Add", ["scaled", "M"], "masked"),
        ("Softmax", ["masked"], "p"),
        ("MatMul", ["p", "v"], "h"),
        ("Tanh", ["h"], "t"),
    ]
    graph_nodes = [helper.make_node(op, ins, [out], name=f"block/{out}") for op, ins, out in nodes]
    graph_nodes += [
        helper.make_node("Mul", ["t", "c"], ["tc"], name="tc"),
        helper.make_node("ReduceSum", ["tc"], ["loss"], name="sum", keepdims=0),
    ]
    graph = helper.make_graph(
        graph_nodes,
        "attention",
        [helper.make_tensor_value_info("x", elem, [seq, dim])],
        [helper.make_tensor_value_info("loss", elem, [])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def gradients(model, recompute, feeds, **kwargs) -> dict[str, np.ndarray]:
    gradient = onnx_derivative(model, recompute=recompute, **kwargs)
    return run_onnxruntime(gradient, feeds)


@pytest.mark.parametrize("recompute", ["auto", [r"block/"]])
def test_attention_gradients_equal_finite_differences(recompute):
    model = attention_model()
    x = RNG.standard_normal((4, 3))
    weights = ["Wq", "Wk", "Wv"]
    gradient = onnx_derivative(
        model, weights, ["x"], DerivativeOptions.Loss, loss="loss", recompute=recompute
    )
    evaluator = ReferenceEvaluator(gradient)  # onnxruntime's fused MatMul lacks float64
    names = [o.name for o in gradient.graph.output]
    result = dict(zip(names, evaluator.run(None, {"x": x, **_weights(model, weights)})))
    expected = onnx_numerical_vjp(model, {"x": x, **_weights(model, weights)}, ["x", *weights])
    for name, value in expected.items():
        np.testing.assert_allclose(result[f"{name}_grad"], value, rtol=1e-6, atol=1e-8)


def test_recomputed_values_leave_the_backward_and_wait_for_a_gate():
    model = attention_model(np.float32)
    plain = onnx_derivative(model, options=DerivativeOptions.Loss, loss="loss")
    gradient = onnx_derivative(
        model, options=DerivativeOptions.Loss, loss="loss", recompute=[r"block/"]
    )
    forward = {n.name for n in model.graph.node}
    backward_reads = {i for n in plain.graph.node if n.name not in forward for i in n.input}
    assert {"p", "scores"} & backward_reads  # the plain backward keeps attention values
    copies = [n for n in gradient.graph.node if n.name.startswith("recompute/")]
    later = [n for n in gradient.graph.node if n.name not in forward and n not in copies]
    assert not {"p", "q", "kt", "v", "h"} & {i for n in later for i in n.input}
    gated = [n for n in copies if n.op_type == "Reshape" and n.output[0].endswith("_gated")]
    assert {n.input[0] for n in gated} >= {"x"}
    slices = [n for n in copies if n.op_type == "Slice"]
    assert slices and all(_depends_on_backward(gradient, s.input[0], forward) for s in slices)


def _depends_on_backward(model, name, forward) -> bool:
    """Whether ``name`` is a backward value, or a copy's reshape of one."""
    producer = {o: n for n in model.graph.node for o in n.output}
    node = producer.get(name)
    while node is not None and node.name.startswith("recompute/") and node.op_type == "Reshape":
        node = producer.get(node.input[0])
    return node is not None and node.name not in forward and not node.name.startswith("recomp")


def _weights(model, names):
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.name in names}


def test_choices_are_checked():
    model = attention_model()
    with pytest.raises(TypeError, match="list of block patterns"):
        onnx_derivative(model, recompute="layers")
    with pytest.raises(ValueError, match="not a regular expression"):
        onnx_derivative(model, recompute=["("])
    with pytest.raises(ValueError, match=r"no forward node.*'nowhere/'"):
        onnx_derivative(model, recompute=["nowhere/"])
    with pytest.raises(ValueError, match="needs backend='onnx'"):
        onnx_derivative(model, recompute="auto", backend="ort")


def _tanh_mlp() -> onnx.ModelProto:
    """``y = tanh(x W1) W2`` in float32, a free batch axis."""
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W1"], ["h"], name="h"),
            helper.make_node("Tanh", ["h"], ["t"], name="t"),
            helper.make_node("MatMul", ["t", "W2"], ["y"], name="y"),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1])],
        [
            numpy_helper.from_array(RNG.standard_normal((3, 5)).astype(np.float32), "W1"),
            numpy_helper.from_array(RNG.standard_normal((5, 1)).astype(np.float32), "W2"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_artifacts_train_step_recomputes(tmp_path):
    from onnxgrad.training.artifacts.generate import generate_artifacts

    model = _tanh_mlp()
    artifacts = generate_artifacts(model, artifact_directory=tmp_path, recompute="auto")
    step = onnx.load(artifacts.path("training_model.onnx"))
    copies = [n for n in step.graph.node if n.name.startswith("recompute/t/")]
    assert {n.op_type for n in copies} >= {"MatMul", "Tanh"}


@pytest.mark.parametrize(
    "estimator", ["OrtGradientForwardBackwardOptimizer", "OrtGradientOptimizer"]
)
def test_estimators_train_with_recomputation(estimator):
    """``recompute`` of the estimators reaches their train step, whose weights then equal
    the plain step's."""
    import onnxgrad
    from onnxgrad import add_loss_output

    model = _tanh_mlp()
    weights = {}
    if estimator == "OrtGradientOptimizer":
        model, weights = add_loss_output(model), {"weights_to_train": ["W1", "W2"]}
    X = RNG.standard_normal((40, 3)).astype(np.float32)
    y = np.tanh(X.sum(axis=1, keepdims=True)).astype(np.float32)
    fitted = {}
    for recompute in (None, "auto"):
        options = {"max_iter": 3, "batch_size": 8, "random_state": 0, "learning_rate": 1e-2}
        est = getattr(onnxgrad, estimator)(model, recompute=recompute, **options, **weights)
        est.fit(X, y)
        copies = [n for n in est.runner_.step.model.graph.node if n.name.startswith("recompute/")]
        assert bool(copies) == (recompute == "auto")
        fitted[recompute] = est.get_state()
    for name, value in fitted[None].items():
        np.testing.assert_allclose(fitted["auto"][name], value, rtol=1e-6, atol=1e-7)


# -- networks exported by PyTorch -------------------------------------------------------------
torch = pytest.importorskip("torch")


def _export(module, example, dynamo: bool) -> onnx.ModelProto:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            batch = torch.export.Dim("batch", min=1)
            program = torch.onnx.export(
                module, example, input_names=["x", "label"], output_names=["loss"],
                dynamo=True, dynamic_shapes=({0: batch}, {0: batch}),
            )  # fmt: skip
            return program.model_proto
        buffer = io.BytesIO()
        torch.onnx.export(
            module, example, buffer, input_names=["x", "label"], output_names=["loss"],
            dynamo=False, opset_version=17,
            dynamic_axes={"x": {0: "batch"}, "label": {0: "batch"}},
        )  # fmt: skip
        return onnx.load_from_string(buffer.getvalue())


class WithLoss(torch.nn.Module):
    def __init__(self, inner, flat: bool = False):
        super().__init__()
        self.inner, self.flat = inner, flat

    def forward(self, x, label):
        out = self.inner(x)
        if self.flat:
            out = out.reshape(-1, out.shape[-1])
        return torch.nn.functional.cross_entropy(out, label.reshape(-1))


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(20, 16)
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(1))


class Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        conv = torch.nn.Conv2d
        self.stem = conv(3, 4, 3, padding=1)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(conv(4, 4, 3, padding=1), torch.nn.ReLU(), conv(4, 4, 1))
            for _ in range(2)
        )
        self.head = torch.nn.Linear(4, 5)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        for block in self.blocks:
            h = torch.relu(h + block(h))
        return self.head(h.mean((2, 3)))


def _llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8,
        use_cache=False, attn_implementation="eager",
    )  # fmt: skip
    llama = transformers.LlamaForCausalLM(config)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.llama = llama

        def forward(self, x):
            return self.llama(input_ids=x).logits

    return Logits()


def _case(name):
    torch.manual_seed(0)
    if name == "transformer":
        x = torch.randint(0, 20, (3, 8))
        return WithLoss(Classifier()).eval(), (x, torch.tensor([0, 2, 1])), True, r"layers\.\d+"
    if name == "llama":
        x = torch.randint(0, 40, (2, 8))
        return WithLoss(_llama(), flat=True).eval(), (x, torch.roll(x, -1, 1)), True, r"layers\.\d+"
    x = torch.randn(2, 3, 8, 8)
    return WithLoss(Residual()).eval(), (x, torch.tensor([1, 4])), False, r"blocks\.\d+/"


@functools.cache
def _exported(name):
    module, example, dynamo, blocks = _case(name)
    return _export(module, example, dynamo), example, dynamo, blocks


@pytest.mark.slow
@pytest.mark.parametrize("name", ["transformer", "llama", "residual"])
def test_exported_networks_same_gradients(name):
    model, example, _, blocks = _exported(name)
    feeds = {"x": example[0].numpy(), "label": example[1].numpy()}
    feeds.update({i.name: numpy_helper.to_array(i) for i in model.graph.initializer})
    kwargs = {"inputs": [], "options": DerivativeOptions.Loss, "loss": "loss", "label": "label"}
    plain = gradients(model, None, feeds, **kwargs)
    for recompute in ("auto", [blocks]) if name == "transformer" else ([blocks],):
        gradient = onnx_derivative(model, recompute=recompute, **kwargs)
        assert any(n.name.startswith("recompute/") for n in gradient.graph.node), recompute
        result = run_onnxruntime(gradient, feeds)
        assert result.keys() == plain.keys()
        for key, value in plain.items():
            np.testing.assert_allclose(
                result[key], value, rtol=1e-6, atol=1e-7, err_msg=f"{key} {recompute}"
            )


@pytest.mark.slow
def test_train_step_with_checkpointed_layers_matches_the_plain_step():
    from onnxgrad.training.running.data import OrtDataLoader
    from onnxgrad.training.running.devices import parse_device
    from onnxgrad.training.running.runner import TrainingRunner
    from onnxgrad.training.step.learning_rate import LearningRateSGD

    model, example, _, blocks = _exported("transformer")
    x, label = example[0].numpy(), example[1].numpy()
    results = []
    for recompute in (None, [blocks]):
        step = make_train_step(  # not Adam: it would scale the key bias's zero gradient
            model, loss=None, learning_rate=LearningRateSGD(eta0=0.1), recompute=recompute
        )
        weights = {n: v for n, v in _weights(model, step.weights).items()}
        runner = TrainingRunner(step, parse_device("cpu"), weights, None)
        loader = OrtDataLoader(x, label, batch_size=len(x), random_state=0)
        losses = [runner.run_epoch(loader, 0.01)[0] for _ in range(2)]
        results.append((losses, runner.get_weights()))
    (plain_losses, plain_weights), (losses, weights) = results
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    for name, value in plain_weights.items():
        np.testing.assert_allclose(weights[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_elements_of_unknown_dims_count_as_one():
    from onnxgrad.derivative.autodiff.value_types import ValueType
    from onnxgrad.derivative.recompute import _elements

    types = {"a": ValueType(TensorProto.FLOAT, ("batch", 4, 5)), "b": ValueType(1, None)}
    assert _elements(types, "a") == 20
    assert _elements(types, "b") == 1
