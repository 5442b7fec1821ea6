"""Default weights are parameters, not structural constants (onnxgrad.graph.weight_roles).

Small graphs check each role; transformers exports (tiny Llama and BERT, random weights)
check that the default weights are exactly what PyTorch's ``parameters()`` holds and that
fine-tuning through onnxgrad's train step follows PyTorch's own, step for step.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.graph import get_train_initializer
from onnxgrad.training import LearningRateAdam, LearningRateSGD, make_train_step

F = TensorProto.FLOAT


def _model(nodes, inits, inputs, outputs, domains=(), shape=None):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, F, shape) for n in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    opsets = [helper.make_opsetid("", 18), *(helper.make_opsetid(d, 1) for d in domains)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9)


def _weights(model) -> list[str]:
    return list(get_train_initializer(model))


def f32(*shape, value=None):
    rng = np.random.default_rng(len(shape))
    array = rng.standard_normal(shape) if value is None else np.full(shape, value)
    return array.astype(np.float32)


X = [("x", F, [None, 8, 4])]


def test_rms_norm_scale_is_a_weight_its_epsilon_is_not():
    node = helper.make_node
    model = _model(
        [
            node("Pow", ["x", "two"], ["sq"]),
            node("ReduceMean", ["sq", "axes"], ["ms"]),
            node("Add", ["ms", "eps"], ["mse"]),
            node("Sqrt", ["mse"], ["rms"]),
            node("Div", ["x", "rms"], ["normed"]),
            node("Mul", ["g", "normed"], ["y"]),
        ],
        {"two": np.float32(2), "axes": np.array([-1]), "eps": np.float32(1e-6), "g": f32(4)},
        X,
        ["y"],
    )
    assert _weights(model) == ["g"]


def test_attention_scale_mask_and_fill_value_are_constants_projections_are_weights():
    node = helper.make_node
    model = _model(
        [
            node("MatMul", ["x", "wq"], ["q0"]),
            node("Add", ["q0", "bq"], ["q"]),
            node("Mul", ["q", "scale"], ["qs"]),
            node("Transpose", ["q"], ["kt"], perm=[0, 2, 1]),
            node("MatMul", ["qs", "kt"], ["scores"]),
            node("Add", ["scores", "mask"], ["masked"]),
            node("IsNaN", ["masked"], ["nan"]),
            node("Where", ["nan", "fill", "masked"], ["clean"]),
            node("Softmax", ["clean"], ["y"]),
        ],
        {
            "wq": f32(4, 4),
            "bq": f32(4),
            "scale": np.float32(0.5),
            "mask": np.triu(np.full((8, 8), -1e9, np.float32), 1)[None],
            "fill": np.float32(0),
        },
        X,
        ["y"],
    )
    assert _weights(model) == ["wq", "bq"]


def _scores_plus(table: np.ndarray, then_mask=None) -> list[str]:
    """The default weights of ``softmax(x wq (x wk)^T + table [+ mask])``."""
    node = helper.make_node
    nodes = [
        node("MatMul", ["x", "wq"], ["q"]),
        node("MatMul", ["x", "wk"], ["k"]),
        node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        node("MatMul", ["q", "kt"], ["scores"]),
        node("Add", ["scores", "table"], ["biased"]),
    ]
    inits = {"wq": f32(4, 4), "wk": f32(4, 5)[:, :4].copy(), "table": table}
    if then_mask is not None:
        nodes.append(node("Add", ["biased", "mask"], ["masked"]))
        inits["mask"] = then_mask
    nodes.append(node("Softmax", [nodes[-1].output[0]], ["y"]))
    return sorted(_weights(_model(nodes, inits, X, ["y"])))


def _alibi(slopes: np.ndarray) -> np.ndarray:
    """ALiBi's ``-m_h |i - j|`` over 8 positions, ``[1, heads, 8, 8]``."""
    distance = np.abs(np.arange(8)[None] - np.arange(8)[:, None])
    return (-slopes[:, None, None] * distance)[None].astype(np.float32)


def test_a_relative_position_bias_folded_into_the_scores_is_a_weight():
    # Swin as torch.onnx writes it: Gather(table, constant index) folded into one
    # [1, heads, S, S] constant added to the scores
    folded = np.random.default_rng(3).normal(0, 0.02, (1, 1, 8, 8)).astype(np.float32)
    assert _scores_plus(folded) == ["table", "wk", "wq"]
    causal = np.triu(np.full((8, 8), -1e9, np.float32), 1)[None, None]
    assert _scores_plus(folded, then_mask=causal) == ["table", "wk", "wq"]


def test_a_folded_bias_added_to_a_window_mask_computed_from_the_shape_is_a_weight():
    # Swin's shifted windows: the bias is first added to a mask the export computes from the
    # shape (here zeros of the scores' shape), then to the scores
    node = helper.make_node
    table = np.random.default_rng(4).normal(0, 0.02, (1, 8, 8)).astype(np.float32)
    model = _model(
        [
            node("MatMul", ["x", "wq"], ["q"]),
            node("Transpose", ["q"], ["qt"], perm=[0, 2, 1]),
            node("MatMul", ["q", "qt"], ["scores"]),
            node("Shape", ["scores"], ["shape"]),
            node("ConstantOfShape", ["shape"], ["window"]),
            node("Add", ["table", "window"], ["bias"]),
            node("Add", ["scores", "bias"], ["biased"]),
            node("Softmax", ["biased"], ["y"]),
        ],
        {"wq": f32(4, 4), "table": table},
        X,
        ["y"],
    )
    assert sorted(_weights(model)) == ["table", "wq"]


@pytest.mark.parametrize(
    "table",
    [
        _alibi(np.array([0.5, 0.25], np.float32)),  # a folded ALiBi: linear in j - i
        np.triu(np.full((8, 8), -1e9, np.float32), 1)[None, None],  # a causal mask
        np.triu(np.full((8, 8), -np.inf, np.float32), 1)[None, None],
        _alibi(np.array([0.5], np.float32)) + np.triu(np.full((8, 8), -1e9, np.float32), 1),
    ],
    ids=["alibi", "mask", "inf-mask", "alibi-and-mask"],
)
def test_alibi_and_masks_added_to_the_scores_are_not_weights(table):
    assert _scores_plus(table) == ["wk", "wq"]


def test_a_table_added_to_non_affine_data_elsewhere_is_not_a_bias():
    # a sine position table added after an activation (Whisper's encoder adds its table after
    # a GELU), not to attention scores
    node = helper.make_node
    positions = np.sin(np.arange(32).reshape(8, 4) / 3.0).astype(np.float32)
    model = _model(
        [
            node("MatMul", ["x", "w"], ["h"]),
            node("Tanh", ["h"], ["g"]),
            node("Add", ["g", "positions"], ["y"]),
        ],
        {"w": f32(4, 4), "positions": positions},
        X,
        ["y"],
    )
    assert _weights(model) == ["w"]


def _rotary(x, cos, sin, out):
    """``x cos + rotate_half(x) sin``, ``rotate_half(x) = [-x2, x1]`` (halves of the last
    axis), as transformers writes rotary embeddings."""
    node = helper.make_node
    return [
        node("Split", [x], [f"{out}_x1", f"{out}_x2"], axis=-1, num_outputs=2),
        node("Neg", [f"{out}_x2"], [f"{out}_minus_x2"]),
        node("Concat", [f"{out}_minus_x2", f"{out}_x1"], [f"{out}_rotated"], axis=-1),
        node("Mul", [x, cos], [f"{out}_cos"]),
        node("Mul", [f"{out}_rotated", sin], [f"{out}_sin"]),
        node("Add", [f"{out}_cos", f"{out}_sin"], [out]),
    ]


def test_rotary_tables_are_constants_computed_or_folded_a_full_elementwise_factor_is_not():
    """The cos/sin tables of a rotation (computed from ``inv_freq`` and positions, or folded
    into initializers by an exporter) are constants; a factor of the same shape whose product
    is used otherwise is an elementwise weight."""
    node = helper.make_node
    model = _model(
        [
            node("Range", ["start", "limit", "delta"], ["positions"]),
            node("Cast", ["positions"], ["pos_f"], to=F),
            node("Unsqueeze", ["pos_f", "one_axis"], ["pos_col"]),
            node("Mul", ["pos_col", "inv_freq"], ["freqs"]),
            node("Concat", ["freqs", "freqs"], ["angles"], axis=-1),
            node("Cos", ["angles"], ["cos"]),
            node("Sin", ["angles"], ["sin"]),
            node("MatMul", ["x", "wq"], ["q"]),
            *_rotary("q", "cos", "sin", "y"),
            *_rotary("x", "cos_table", "sin_table", "z"),
            node("Mul", ["x", "gate"], ["g"]),
        ],
        {
            "start": np.array(0),
            "limit": np.array(8),
            "delta": np.array(1),
            "one_axis": np.array([1]),
            "inv_freq": np.array([1.0, 0.1], np.float32),
            "wq": f32(4, 4),
            "cos_table": np.cos(f32(1, 8, 4)),
            "sin_table": np.sin(f32(1, 8, 4)),
            "gate": f32(1, 8, 4),
        },
        X,
        ["y", "z", "g"],
    )
    assert _weights(model) == ["wq", "gate"]


def test_the_one_of_one_minus_p_is_a_constant_but_a_bias_is_a_weight():
    node = helper.make_node
    model = _model(
        [
            node("MatMul", ["x", "w"], ["s0"]),
            node("Add", ["s0", "b"], ["s"]),
            node("Sigmoid", ["s"], ["p"]),
            node("Sub", ["one", "p"], ["q"]),
            node("Concat", ["q", "p"], ["y"], axis=1),
        ],
        {"w": f32(4, 1), "b": np.array([0.5], np.float32), "one": np.float32(1)},
        [("x", F, [None, 4])],
        ["y"],
    )
    assert _weights(model) == ["w", "b"]


def test_a_complement_is_a_constant_even_of_an_affine_value():
    """``[1 - s, s]`` of raw scores (a one-score LinearClassifier without transform)."""
    node = helper.make_node
    model = _model(
        [
            node("MatMul", ["x", "w"], ["s"]),
            node("Sub", ["one", "s"], ["q"]),
            node("Sub", ["s", "offset"], ["r"]),
            node("Concat", ["q", "r"], ["y"], axis=1),
        ],
        {"w": f32(4, 1), "one": np.float32(1), "offset": np.array([0.5], np.float32)},
        [("x", F, [None, 4])],
        ["y"],
    )
    assert _weights(model) == ["w", "offset"]


def test_one_number_scaling_one_feature_is_a_weight_scaling_several_is_not():
    node = helper.make_node
    one = _model(
        [node("Mul", ["x", "a"], ["ax"]), node("Add", ["ax", "b"], ["y"])],
        {"a": np.array([2.0], np.float32), "b": np.array([1.0], np.float32)},
        [("x", F, [None, 1])],
        ["y"],
    )
    assert _weights(one) == ["a", "b"]
    several = _model(
        [node("Mul", ["x", "a"], ["y"])],
        {"a": np.array([2.0], np.float32)},
        [("x", F, [None, 4])],
        ["y"],
    )
    assert _weights(several) == []


def test_quantization_scales_are_not_weights_but_a_quantized_bias_is():
    node = helper.make_node
    model = _model(
        [
            node(
                "DynamicQuantizeMatMul",
                ["x", "wq", "scale", "zp", "bias"],
                ["h"],
                domain="com.microsoft",
            ),
            node("Mul", ["h", "g"], ["y"]),
        ],
        {
            "wq": np.ones((4, 3), np.int8),
            "scale": np.array([0.1], np.float32),
            "zp": np.array([0], np.int8),
            "bias": f32(3),
            "g": f32(3),
        },
        [("x", F, [None, 4])],
        ["y"],
        domains=["com.microsoft"],
    )
    assert _weights(model) == ["bias", "g"]


def test_a_constant_named_explicitly_is_trained():
    node = helper.make_node
    model = _model(
        [node("Mul", ["x", "scale"], ["y"])],
        {"scale": np.float32(0.5)},
        X,
        ["y"],
        shape=[None, 8, 4],
    )
    assert _weights(model) == []
    step = make_train_step(model, ["scale"], learning_rate=LearningRateSGD())
    assert step.weights == ("scale",)


@pytest.mark.parametrize("kind", ["logistic", "mlp", "svc_linear", "svc_rbf"])
def test_lowered_classifiers_constants_stay_constants_once_promoted(kind):
    """The lowering writes its structural constants (masks, the uniform start of the
    probability coupling, the 1 of ``1 - p``...) as ``Constant`` nodes; promoted to
    initializers, as the normalisation of a model makes them, none becomes a weight."""
    skl2onnx = pytest.importorskip("skl2onnx")
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier
    from sklearn.svm import SVC

    from onnxgrad.graph import lower_ml_operators

    estimators = {
        "logistic": LogisticRegression(),
        "mlp": MLPClassifier((3,), max_iter=20, random_state=0),
        "svc_linear": SVC(kernel="linear", probability=True, random_state=0),
        "svc_rbf": SVC(probability=True, random_state=0),
    }
    rng = np.random.default_rng(0)
    X = rng.standard_normal((60, 3)).astype(np.float32)
    y = np.digitize(X[:, 0], [-0.4, 0.4]) if kind.startswith("svc") else X[:, 1] > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimator = estimators[kind].fit(X, y)
        model = skl2onnx.to_onnx(estimator, X[:1], target_opset=17, options={"zipmap": False})
    lowered = lower_ml_operators(model, keep_zipmap=False)
    assert _weights(_promote_float_constants(lowered)) == _weights(lowered)


def test_lookups_embeddings_and_relative_biases_are_weights_rotary_caches_are_not():
    """A table looked up by token ids (an embedding) or by constant indices and added to
    attention scores (T5's relative bias) is a weight; cos/sin caches looked up by position
    ids only multiply the queries: constants."""
    node = helper.make_node
    model = _model(
        [
            node("Gather", ["embedding", "ids"], ["h"]),
            node("MatMul", ["h", "wq"], ["q0"]),
            node("Gather", ["cos_cache", "positions"], ["cos"]),
            node("Mul", ["q0", "cos"], ["q"]),
            node("Transpose", ["q"], ["kt"], perm=[0, 2, 1]),
            node("MatMul", ["q", "kt"], ["scores"]),
            node("Gather", ["relative", "buckets"], ["bias"]),
            node("Squeeze", ["bias", "last"], ["bias2d"]),
            node("Add", ["scores", "bias2d"], ["y"]),
        ],
        {
            "embedding": f32(16, 4),
            "wq": f32(4, 4),
            "cos_cache": np.cos(f32(8, 4)),
            "relative": f32(15, 1),
            "buckets": np.subtract.outer(np.arange(8), np.arange(8)) + 7,
            "last": np.array([-1]),
        },
        [("ids", TensorProto.INT64, [2, 8]), ("positions", TensorProto.INT64, [2, 8])],
        ["y"],
    )
    assert _weights(model) == ["embedding", "wq", "relative"]


# -- transformers exports ------------------------------------------------------------------


def _transformers(kind: str):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    sizes = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=32,
    )
    if kind == "llama":
        config = transformers.LlamaConfig(**sizes, num_key_value_heads=1, use_cache=False)
        module, logits = transformers.LlamaForCausalLM(config), (2, 8, 64)
    else:
        config = transformers.BertConfig(
            **sizes, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
        )
        module, logits = transformers.BertForSequenceClassification(config), (2, 3)
    with torch.no_grad():
        for p in module.parameters():  # distinct values: an exporter shares equal constants
            p.normal_(0.0, 0.3)
    return torch, module, logits


def _export(torch, module, args, names, outputs, optimize):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module,
            args,
            input_names=names,
            output_names=outputs,
            dynamo=True,
            optimize=optimize,
            opset_version=18,
            verbose=False,
        )
    return _promote_float_constants(program.model_proto)


def _promote_float_constants(model):
    """Float ``Constant`` nodes as initializers, as the normalisation of a model makes them,
    so the rule sees every constant (epsilons, scales, fill values) as a candidate."""
    graph = model.graph
    kept = []
    for node in graph.node:
        attribute = node.attribute[0] if node.op_type == "Constant" else None
        if attribute is not None and attribute.name == "value" and attribute.t.data_type == F:
            value = numpy_helper.to_array(attribute.t)
            graph.initializer.append(numpy_helper.from_array(value, node.output[0]))
        else:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    return model


def _assert_weights_are_the_parameters(module, model):
    found = get_train_initializer(model)
    params = [p.detach().numpy() for p in module.parameters()]
    unmatched = [
        name
        for name, (value, _) in found.items()
        if not any(np.array_equal(value, p) or np.array_equal(value, p.T) for p in params)
    ]
    assert unmatched == []
    assert len(found) == len(params)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_default_weights_of_a_transformers_export_are_its_parameters(kind):
    """With constants folded (the exporter's default): the rotary tables, the mask, the
    epsilon, the attention scale and GELU's constants are initializers, not weights."""
    torch, module, _ = _transformers(kind)
    module.eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = module

        def forward(self, ids):
            return self.m(input_ids=ids).logits

    ids = torch.randint(0, 64, (2, 8))
    model = _export(torch, Logits(), (ids,), ["ids"], ["logits"], optimize=True)
    if kind == "llama":
        _assert_weights_are_the_parameters(module, model)
    else:
        # the exporter folds BERT's position and token-type lookups (constant indices) into
        # tables: every other parameter is found, and no structural constant
        found = get_train_initializer(model)
        scalars = [n for n, (v, _) in found.items() if v.size == 1]
        assert scalars == []
        assert len(found) == len(list(module.parameters()))


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "optimizer"), [("llama", "adam"), ("bert", "sgd")])
def test_fine_tuning_a_transformers_export_follows_pytorch_step_for_step(kind, optimizer):
    """``sum((f(ids) - label)^2)`` trained 3 steps by onnxgrad's train step (default weights)
    and by ``torch.optim`` on ``module.parameters()``: the losses agree to 1e-5."""
    torch, module, logits = _transformers(kind)

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = module

        def forward(self, ids, label):
            return ((self.m(input_ids=ids).logits - label) ** 2).sum()

    ids, label = torch.randint(0, 64, (2, 8)), torch.randn(logits)
    wrapped = Loss()
    model = _export(torch, wrapped, (ids, label), ["ids", "label"], ["loss"], optimize=False)
    weights = {k: v for k, (v, _) in _assert_weights_are_the_parameters(module, model).items()}
    lr = 0.01
    if optimizer == "adam":
        ours, theirs = LearningRateAdam(eta0=lr), torch.optim.Adam(module.parameters(), lr=lr)
    else:
        ours, theirs = LearningRateSGD(eta0=lr), torch.optim.SGD(module.parameters(), lr=lr)
    step = make_train_step(model, loss=None, label_name="label", learning_rate=ours)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(
        step.model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in session.get_outputs()]
    state = step.initial_state()
    for _ in range(3):
        feeds = {"ids": ids.numpy(), "label": label.numpy(), **step.weight_inputs(weights)}
        feeds.update(state)
        feeds[step.learning_rate] = np.array(lr, np.float32)
        out = dict(zip(names, session.run(None, feeds)))
        weights = step.unpack_weights(out)
        state = {s: out[n] for s, n in zip(step.state, step.new_state)}
        theirs.zero_grad()
        expected = wrapped(ids, label)
        expected.backward()
        theirs.step()
        assert float(out[step.loss]) == pytest.approx(float(expected.detach()), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("folding", [True, False])
def test_t5_relative_attention_bias_is_a_weight(folding):
    """T5's relative attention bias: an embedding looked up by bucket indices computed from
    positions (constants) and added to the attention scores. The T5 encoder goes through the
    TorchScript exporter (the dynamo exporter fails on it)."""
    import io

    import onnx

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
    )
    module = transformers.T5EncoderModel(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)
    module.eval()

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = module

        def forward(self, ids):
            return self.m(input_ids=ids).last_hidden_state

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Hidden(),
            (torch.randint(0, 64, (2, 8)),),
            buffer,
            input_names=["ids"],
            output_names=["h"],
            dynamo=False,
            do_constant_folding=folding,
            opset_version=18,
        )
    model = _promote_float_constants(onnx.load_from_string(buffer.getvalue()))
    found = _assert_weights_are_the_parameters(module, model)
    bias = module.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    assert any(np.array_equal(v, bias.detach().numpy()) for v, _ in found.values())


# -- the property on twenty-five architectures in their deployed forms --------------------


def _architecture_cases():
    from tests.architectures import ARCHITECTURES, suite_forms

    return [(a, f) for a in ARCHITECTURES for f in suite_forms(a)]


def _file_values(model) -> dict[str, np.ndarray]:
    """Every float initializer and ``Constant`` of the user's file, subgraphs included."""
    from onnxgrad._onnx_utils import subgraphs

    found = {}
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        found.update((i.name, numpy_helper.to_array(i)) for i in graph.initializer)
        for node in graph.node:
            if node.op_type == "Constant" and node.attribute[0].name == "value":
                found[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
            graphs.extend(subgraphs(node))
    return {k: v for k, v in found.items() if v.dtype.kind == "f"}


def _is_block(big: np.ndarray, small: np.ndarray) -> bool:
    """``small`` is a contiguous block of ``big`` along one axis (or equal to it)."""
    if big.ndim != small.ndim:
        return False
    axes = [a for a in range(big.ndim) if big.shape[a] != small.shape[a]]
    if len(axes) > 1:
        return False
    if not axes:
        return np.array_equal(big, small)
    axis, length = axes[0], small.shape[axes[0]]
    return any(
        np.array_equal(np.take(big, range(start, start + length), axis=axis), small)
        for start in range(big.shape[axis] - length + 1)
    )


def _made_of_parameters(value: np.ndarray, params: list[np.ndarray]) -> bool:
    """``value`` is a block of a parameter, holds one as a block (fused q/k/v projections,
    position rows of a table), is made of row blocks of parameters (a recurrent layer's
    gates reordered by the exporter) or is what a tool folded from parameters: one
    reshaped (a GroupNorm's gamma as ``[C, 1]``), one plus one (Gemma's RMSNorm scale
    ``1 + w``), entries of one gathered by constant indices (Swin's relative position bias
    table) or a weight-normed kernel ``g v / |v|``."""
    candidates = [q for p in params for q in (p, p.T)]
    candidates += [p.reshape(value.shape) for p in params if p.size == value.size]
    if any(_is_block(value, q) or _is_block(q, value) for q in candidates):
        return True
    shifted = value.astype(np.float64) - 1  # 1 + w rounded: w to its stored type's spacing
    spacing = 2 * float(np.finfo(value.dtype).eps) * max(1.0, float(np.abs(value).max()))
    if any(q.shape == value.shape and np.allclose(shifted, q, 0, spacing) for q in params):
        return True
    if value.size > 1 and any(p.size > 1 and np.isin(value, p).all() for p in params):
        return True
    if _weight_normed(value, params):
        return True
    if value.ndim == 0:
        return False
    rows = value.reshape(value.shape[1:]) if value.ndim > 1 and value.shape[0] == 1 else value
    n = rows.shape[0]
    for size in [d for d in range(2, n) if n % d == 0][:8]:
        chunks = [rows[i : i + size] for i in range(0, n, size)]
        if all(any(_is_block(p, c) for p in params) for c in chunks):
            return True
    return False


def _close(value: np.ndarray, derived: np.ndarray) -> bool:
    """``value`` is ``derived`` (computed by the module) up to float32 rounding."""
    return value.shape == derived.shape and np.allclose(value, derived, rtol=1e-5, atol=1e-6)


def _weight_normed(value: np.ndarray, params: list[np.ndarray]) -> bool:
    """``value`` is ``g v / |v|`` of two parameters, the norm over the axes ``g`` spans once
    (``torch.nn.utils.weight_norm``, folded by a tool)."""
    for v in (p for p in params if p.shape == value.shape):
        for g in (p for p in params if p.ndim == v.ndim and p.size < v.size):
            axes = tuple(a for a in range(v.ndim) if g.shape[a] == 1)
            if any(g.shape[a] not in (1, v.shape[a]) for a in range(v.ndim)) or not axes:
                continue
            norm = np.sqrt(np.sum(v.astype(np.float64) ** 2, axis=axes, keepdims=True))
            if np.allclose(g * v / norm, value, rtol=1e-4, atol=1e-6):
                return True
    return False


@pytest.mark.slow
@pytest.mark.parametrize(("architecture", "form"), _architecture_cases())
def test_default_weights_of_every_deployed_form_are_the_parameters(architecture, form):
    """Every float initializer or ``Constant`` of the file equal to a parameter of the
    PyTorch module is a default weight; every other default weight is made of parameters
    (fused or reordered by a tool), never a structural constant (an epsilon, a fill value,
    GELU's coefficients, rotary frequencies, a quantization scale); each exists in the
    user's file, and the gradient graph asks for no input the file lacks."""
    import onnx

    from onnxgrad import onnx_derivative
    from tests import architectures

    try:
        path = architectures.deployed_form(architecture, form)
        params = architectures.parameters(architecture)
    except ImportError as error:  # no torch here and no cached export, or no 4-bit quantizer
        pytest.skip(f"{architecture} {form} cannot be made in this environment: {error}")
    model = onnx.load(path)
    values = _file_values(model)
    equal = {
        name
        for name, value in values.items()
        if any(np.array_equal(value, q.astype(value.dtype)) for p in params for q in (p, p.T))
    }
    found = get_train_initializer(model)
    assert set(found) <= set(values)
    assert sorted(equal - set(found)) == []
    derived = architectures.folded(architecture)
    structural = [
        (name, value.shape, value.ravel()[:3].tolist())
        for name, (value, _) in found.items()
        if name not in equal
        and not _made_of_parameters(value, [p.astype(value.dtype) for p in params])
        and not any(_close(value, d) for d in derived)
    ]
    assert structural == []
    if found:
        known = {i.name for i in model.graph.input} | set(values)
        seeds = {f"{o.name}_grad" for o in model.graph.output}
        asked = {i.name for i in onnx_derivative(model, inputs=[]).graph.input}
        assert sorted(asked - known - seeds) == []


# -- data from every input: shipped-model patterns (tf2onnx's magika, onnx-asr) -------------


def test_a_float_input_cast_to_codes_and_one_hot_is_data():
    """magika standard_v1: float bytes cast to int, one-hot encoded (OneHot's schema calls
    its output non-differentiable), then a dense layer and erf GELU: kernel and bias are the
    weights, GELU's 0.5, 1 and 1/sqrt(2) are not (before: every constant was a weight)."""
    node = helper.make_node
    model = _model(
        [
            node("Cast", ["x"], ["codes"], to=TensorProto.INT32),
            node("OneHot", ["codes", "depth", "values"], ["hot"]),
            node("MatMul", ["hot", "w"], ["h0"]),
            node("Add", ["h0", "b"], ["h"]),
            node("Mul", ["h", "inv_sqrt2"], ["hs"]),
            node("Erf", ["hs"], ["e"]),
            node("Add", ["one", "e"], ["e1"]),
            node("Mul", ["half", "h"], ["hh"]),
            node("Mul", ["hh", "e1"], ["y"]),
        ],
        {
            "depth": np.array([5], np.int64),
            "values": np.array([0.0, 1.0], np.float32),
            "w": f32(5, 3),
            "b": f32(3),
            "inv_sqrt2": np.float32(0.70710677),
            "one": np.float32(1),
            "half": np.float32(0.5),
        },
        [("x", F, [None, 4])],
        ["y"],
    )
    assert _weights(model) == ["w", "b"]


def _log_mel(front: list, inits: dict, spectral: str = "STFT"):
    """``front`` (nodes making ``spectrum`` from ``x``), power, a ``MatMul`` by ``mel``,
    ``log(mel + guard) / ln 10``, then ``Gemm`` by a trained ``head``."""
    node = helper.make_node
    return _model(
        [
            *front,
            node("ReduceSumSquare", ["spectrum", "last"], ["power"], keepdims=0),
            node("MatMul", ["power", "mel"], ["m"]),
            node("Add", ["m", "guard"], ["guarded"]),
            node("Log", ["guarded"], ["logm"]),
            node("Div", ["logm", "ln10"], ["features"]),
            node("Flatten", ["features"], ["flat"]),
            node("Gemm", ["flat", "head"], ["y"]),
        ],
        {
            "last": np.array([-1], np.int64),
            "guard": np.float32(1e-5),
            "ln10": np.float32(2.3025851),
            **inits,
        },
        [("x", F, [2, 32])],
        ["y"],
    )


def _stft_front(inits: dict):
    node = helper.make_node
    nodes = [
        node("Unsqueeze", ["x", "last"], ["signal"]),
        node("STFT", ["signal", "hop", "window"], ["spectrum"], onesided=1),
    ]
    return nodes, {
        "hop": np.array(4, np.int64),
        "window": np.hanning(8).astype(np.float32),
        **inits,
    }


def _dft_front(inits: dict):
    node = helper.make_node
    nodes = [
        node("Reshape", ["x", "frames"], ["framed"]),
        node("DFT", ["framed"], ["spectrum"], axis=2, onesided=1),
    ]
    return nodes, {"frames": np.array([2, 4, 8, 1], np.int64), **inits}


@pytest.mark.parametrize("front", [_stft_front, _dft_front])
def test_a_spectrum_is_data_its_filterbank_and_log_guard_are_not_weights(front):
    """onnx-asr's log-mel features (STFT, or framing and DFT as wespeaker's): the power
    spectrum times a non-negative mel filterbank, ``log(mel + guard)``: the filterbank is a
    fixed transform (before: a default weight), the guard an epsilon; the trained head after
    the features is the only weight."""
    bins = 5
    nodes, inits = front(
        {"mel": np.abs(f32(bins, 3)), "head": f32(3 * 7 if front is _stft_front else 3 * 4, 2)}
    )
    assert _weights(_log_mel(nodes, inits)) == ["head"]


def test_a_trained_layer_on_a_spectrum_is_a_weight():
    """A dense layer on the power spectrum (weights of both signs) stays a weight."""
    nodes, inits = _stft_front({"mel": f32(5, 3), "head": f32(21, 2)})
    assert _weights(_log_mel(nodes, inits)) == ["mel", "head"]


def test_a_fill_broadcast_from_one_number_is_not_a_weight_a_folded_beta_is():
    """TensorFlow's LayerNorm as tf2onnx writes it: a BatchNormalization over ones and zeros
    expanded to the batch, then ``x k + (beta - mean k)``: gamma and beta are the weights,
    the expanded 1 and 0 are not."""
    node = helper.make_node
    model = _model(
        [
            node("Shape", ["x"], ["s"]),
            node("Gather", ["s", "zero"], ["n"]),
            node("Expand", ["one", "n"], ["ones"]),
            node("Expand", ["nought", "n"], ["zeros"]),
            node("ReduceMean", ["x", "last"], ["mean"]),
            node("Mul", ["mean", "gamma"], ["mk"]),
            node("Sub", ["beta", "mk"], ["shift"]),
            node("Mul", ["x", "gamma"], ["xk"]),
            node("Add", ["xk", "shift"], ["z"]),
            node("Unsqueeze", ["z", "last"], ["z4"]),
            node("Unsqueeze", ["z4", "last"], ["z5"]),
            node("BatchNormalization", ["z5", "ones", "zeros", "mu", "var"], ["y"]),
        ],
        {
            "zero": np.array([1], np.int64),
            "last": np.array([-1], np.int64),
            "one": np.float32(1),
            "nought": np.float32(0),
            "gamma": f32(4),
            "beta": f32(4) + 1,
            "mu": np.zeros(8, np.float32),
            "var": np.ones(8, np.float32),
        },
        [("x", F, [None, 8, 4])],
        ["y"],
    )
    assert _weights(model) == ["gamma", "beta"]


def test_coordinates_computed_from_the_shape_are_not_weights_tables_they_index_are():
    """A detector's anchor grid (``Range(w) + 0.5`` times its stride, float ``Range`` start
    and step) and a sine position encoding (``sin(2 pi i / (w + eps))``) are added to the
    data: coordinates, not biases. A learned position table sliced to the data's width or
    gathered by positions is a weight."""
    node = helper.make_node
    model = _model(
        [
            node("MatMul", ["x", "kernel"], ["h"]),
            node("Shape", ["h"], ["s"]),
            node("Gather", ["s", "one"], ["w"]),
            node("Cast", ["w"], ["wf"], to=F),
            node("Range", ["start", "wf", "delta"], ["r"]),
            node("Add", ["r", "half"], ["centres"]),
            node("Mul", ["centres", "stride"], ["anchors"]),
            node("Unsqueeze", ["anchors", "last"], ["column"]),
            node("Add", ["h", "column"], ["boxes"]),
            node("Add", ["wf", "eps"], ["span"]),
            node("Div", ["r", "span"], ["ratio"]),
            node("Mul", ["ratio", "two_pi"], ["angle"]),
            node("Sin", ["angle"], ["wave"]),
            node("Unsqueeze", ["wave", "last"], ["wave_column"]),
            node("Add", ["boxes", "wave_column"], ["encoded"]),
            node("Slice", ["table", "zero1", "w1", "zero1"], ["rows"]),
            node("Add", ["encoded", "rows"], ["placed"]),
            node("Cast", ["r"], ["positions"], to=TensorProto.INT64),
            node("Gather", ["embedding", "positions"], ["learned"]),
            node("Add", ["placed", "learned"], ["y"]),
        ],
        {
            "kernel": f32(4, 4),
            "one": np.array(1, np.int64),
            "start": np.float32(0),
            "delta": np.float32(1),
            "half": np.float32(0.5),
            "stride": np.float32(8),
            "last": np.array([-1], np.int64),
            "eps": np.float32(1e-6),
            "two_pi": np.float32(2 * np.pi),
            "table": f32(16, 4),
            "zero1": np.array([0], np.int64),
            "embedding": f32(16, 4) + 1,
        },
        X,
        ["y"],
        shape=[None, 8, 4],
    )
    model.graph.node.insert(3, node("Unsqueeze", ["w", "zero1"], ["w1"]))
    assert _weights(model) == ["kernel", "table", "embedding"]


def test_a_table_broadcast_to_the_batch_by_a_shape_keeps_its_role():
    """DeBERTa's disentangled attention: the relative-position table, LayerNorm'd and
    projected by the key kernel (constants only), is expanded and tiled to the batch by
    shapes of the data, then multiplies the queries. A constant only broadcast by a shape
    keeps its role: table, norm and kernel are weights (before: the tiled value counted as
    coordinates computed from the shape, and none was)."""
    node = helper.make_node
    model = _model(
        [
            node("LayerNormalization", ["rel", "gamma", "beta"], ["normed"], axis=-1),
            node("MatMul", ["normed", "wk"], ["keys"]),
            node("Unsqueeze", ["keys", "zero1"], ["keys1"]),
            node("Shape", ["x"], ["s"]),
            node("Slice", ["s", "zero1", "one1"], ["batch"]),
            node("Concat", ["batch", "rows"], ["target"], axis=0),
            node("Expand", ["keys1", "target"], ["expanded"]),
            node("Div", ["batch", "batch"], ["unit"]),
            node("Concat", ["unit", "ones2"], ["repeats"], axis=0),
            node("Tile", ["expanded", "repeats"], ["tiled"]),
            node("Transpose", ["tiled"], ["keys_t"], perm=[0, 2, 1]),
            node("MatMul", ["x", "wq"], ["q"]),
            node("MatMul", ["q", "keys_t"], ["y"]),
        ],
        {
            "rel": f32(6, 4),
            "gamma": f32(4) + 1,
            "beta": f32(4) - 1,
            "wk": f32(4, 4) * 2,
            "zero1": np.array([0], np.int64),
            "one1": np.array([1], np.int64),
            "rows": np.array([6, 4], np.int64),
            "ones2": np.array([1, 1], np.int64),
            "wq": f32(4, 4) * 3,
        },
        X,
        ["y"],
    )
    assert sorted(_weights(model)) == ["beta", "gamma", "rel", "wk", "wq"]


def test_one_number_added_to_scores_on_their_way_to_a_softmax_is_not_a_weight():
    """DeBERTa's ``score = 0; score += c2p / scale`` (queries times a projected relative
    table: affine in the data), its 0.0 an initializer: softmax is invariant to a shift of
    every score alike, so that number has no gradient and is no parameter. One number added
    to a layer's output that reaches the graph's output is a bias."""
    node = helper.make_node
    model = _model(
        [
            node("MatMul", ["x", "wq"], ["q"]),
            node("MatMul", ["table", "wk"], ["k"]),
            node("Transpose", ["k"], ["kt"], perm=[1, 0]),
            node("MatMul", ["q", "kt"], ["scores"]),
            node("Add", ["scores", "start"], ["shifted"]),
            node("Reshape", ["shifted", "same"], ["moved"]),
            node("Softmax", ["moved"], ["p"]),
            node("MatMul", ["p", "x"], ["mixed"]),
            node("MatMul", ["mixed", "wo"], ["o"]),
            node("Add", ["o", "bias"], ["y"]),
        ],
        {
            "wq": f32(4, 4),
            "table": f32(8, 4) * 2,
            "wk": f32(4, 4) + 1,
            "start": np.float32(0),
            "same": np.array([0, 8, 8], np.int64),
            "wo": f32(4, 4) - 1,
            "bias": np.float32(0.5),
        },
        X,
        ["y"],
    )
    assert sorted(_weights(model)) == ["bias", "table", "wk", "wo", "wq"]


def test_a_folded_anchor_grid_and_its_strides_are_not_weights_a_bias_is():
    """A static detector export folds its decoding: anchor centres ``k + 1/2`` added to the
    box distances and strides 8, 16, 32 scaling them. A bias of trained values is a weight,
    and so is a fresh model's bias of zeros."""
    node = helper.make_node
    centres = np.tile(np.arange(20, dtype=np.float32) % 8 + 0.5, (2, 1))[None]
    strides = np.repeat(np.array([[8, 16, 32, 32]], np.float32), 5, axis=1)
    model = _model(
        [
            node("MatMul", ["x", "kernel"], ["h"]),
            node("Add", ["h", "bias"], ["hb"]),
            node("Add", ["hb", "zeros"], ["distances"]),
            node("Add", ["centres", "distances"], ["boxes"]),
            node("Mul", ["boxes", "strides"], ["y"]),
        ],
        {
            "kernel": f32(20, 20),
            "bias": f32(20),
            "zeros": np.zeros(20, np.float32),
            "centres": centres,
            "strides": strides,
        },
        [("x", F, [1, 2, 20])],
        ["y"],
        shape=[1, 2, 20],
    )
    assert _weights(model) == ["kernel", "bias", "zeros"]


def test_the_scales_of_a_weight_only_dequantization_in_plain_ops_are_not_weights():
    """``(Cast(q) - z) s`` of int8 codes (an export's weight-only quantization: the kernel,
    and a vocabulary table looked up by ids) is a dequantized weight like
    ``DequantizeLinear``'s: its scale and zero point are no weights; the bias and a
    ``Cast`` of int64 positions scaled by a trained factor stay what they are."""
    node = helper.make_node
    model = _model(
        [
            node("Cast", ["q"], ["qf"], to=F),
            node("Sub", ["qf", "zero"], ["centred"]),
            node("Mul", ["centred", "scale"], ["kernel"]),
            node("Cast", ["table_q"], ["table_f"], to=F),
            node("Transpose", ["table_f"], ["table_t"], perm=[1, 0]),
            node("Div", ["table_t", "table_scale"], ["table"]),
            node("Gather", ["table", "ids"], ["rows"]),
            node("MatMul", ["x", "kernel"], ["h"]),
            node("Add", ["h", "rows"], ["hr"]),
            node("Add", ["hr", "bias"], ["hb"]),
            node("Cast", ["positions"], ["pf"], to=F),
            node("Mul", ["pf", "frequency"], ["angles"]),
            node("Add", ["hb", "angles"], ["y"]),
        ],
        {
            "q": np.ones((4, 3), np.int8),
            "zero": np.float32(1),
            "scale": f32(3),
            "table_q": np.ones((3, 10), np.uint8),
            "table_scale": f32(3),
            "bias": f32(3),
            "positions": np.arange(3, dtype=np.int64),
            "frequency": f32(3),
        },
        [("x", F, [2, 4]), ("ids", TensorProto.INT64, [2])],
        ["y"],
        shape=[2, 3],
    )
    assert _weights(model) == ["bias", "frequency"]


def test_radial_basis_centres_are_not_weights_a_trained_offset_is():
    """A graph network expands its edge lengths ``d`` on Gaussians ``exp(-gamma (d -
    mu_k)^2)`` whose centres ``mu_k = linspace(0, 8, 20)`` the export wrote as a constant
    (caustic-nmr's PaiNN): coordinates, not a weight. A trained offset vector subtracted
    the same way (uneven values) is a weight, and so is a 4-entry evenly spaced one (a
    fresh model's vector may be)."""
    node = helper.make_node
    centres = np.linspace(0, 8, 20, dtype=np.float32)
    model = _model(
        [
            node("MatMul", ["x", "kernel"], ["d"]),
            node("Sub", ["d", "centres"], ["r"]),
            node("Mul", ["r", "r"], ["r2"]),
            node("Mul", ["r2", "gamma"], ["e"]),
            node("Exp", ["e"], ["rbf"]),
            node("Sub", ["rbf", "offset"], ["y"]),
        ],
        {
            "kernel": f32(20, 20),
            "centres": centres,
            "gamma": np.array(-1.2, np.float32),
            "offset": f32(20),
        },
        [("x", F, [1, 2, 20])],
        ["y"],
        shape=[1, 2, 20],
    )
    assert _weights(model) == ["kernel", "offset"]
    short = _model(
        [node("MatMul", ["x", "kernel"], ["d"]), node("Sub", ["d", "centres"], ["y"])],
        {"kernel": f32(4, 4), "centres": np.linspace(0, 3, 4, dtype=np.float32)},
        [("x", F, [1, 2, 4])],
        ["y"],
        shape=[1, 2, 4],
    )
    assert _weights(short) == ["kernel", "centres"]


def test_the_one_of_a_modulation_is_not_a_weight_a_bias_is():
    """An adaptive group norm (guided diffusion's ResBlock, a FiLM layer): ``scale, shift``
    from a linear layer over the condition, ``h (1 + scale) + shift``. The 1 is the
    modulation's identity, as the 1 of ``1 - p`` (the terrain UNet of
    adaptive-terrain-diffusion, PyTorch's dynamo export); a trained scalar bias added to a
    layer output (not exactly 1, or read otherwise) stays a weight."""
    node = helper.make_node
    nodes = [
        node("MatMul", ["c", "kernel"], ["scale"]),
        node("Add", ["scale", "one"], ["factor"]),
        node("Mul", ["x", "factor"], ["modulated"]),
        node("MatMul", ["x", "kernel2"], ["h"]),
        node("Add", ["h", "bias"], ["hb"]),
        node("Add", ["modulated", "hb"], ["y"]),
    ]
    model = _model(
        nodes,
        {
            "kernel": f32(4, 4),
            "one": np.array(1.0, np.float32),
            "kernel2": f32(4, 4),
            "bias": np.array(1.0, np.float32),
        },
        [("x", F, [2, 4]), ("c", F, [2, 4])],
        ["y"],
        shape=[2, 4],
    )
    assert _weights(model) == ["kernel", "kernel2", "bias"]


def test_sinusoidal_frequencies_scaling_a_noise_level_are_not_weights():
    """A diffusion model embeds its noise level ``c`` as ``[cos(c f), sin(c f)]`` with
    ``f_k = 10000^(-k/16)`` (guided diffusion's timestep embedding, written as a constant by
    PyTorch's dynamo export): a geometric progression, not a weight; random (learned)
    frequencies are."""
    node = helper.make_node
    geometric = (10000.0 ** (-np.arange(16) / 16)).astype(np.float32)[None]
    for freqs, expected in ((geometric, ["kernel"]), (f32(1, 16), ["freqs", "kernel"])):
        model = _model(
            [
                node("Mul", ["c", "freqs"], ["phase"]),
                node("Cos", ["phase"], ["cos"]),
                node("Sin", ["phase"], ["sin"]),
                node("Concat", ["cos", "sin"], ["embedding"], axis=1),
                node("MatMul", ["embedding", "kernel"], ["y"]),
            ],
            {"freqs": freqs, "kernel": f32(32, 4)},
            [("c", F, [2, 1])],
            ["y"],
            shape=[2, 4],
        )
        assert sorted(_weights(model)) == expected


def test_a_lowered_group_norms_ones_and_zeros_are_not_weights_its_gamma_and_beta_are():
    """PyTorch's dynamo export writes ``GroupNorm(2, 4)`` as an ``InstanceNormalization`` of
    ``[N, 2, 2 H W]`` with scale 1 and bias 0, reshaped back to ``[N, 4, H, W]``, then
    ``x gamma + beta`` per channel (the terrain UNet's 280 norms). A trained instance norm
    (scale not all 1) keeps its parameters."""
    node = helper.make_node
    for scale, expected in ((np.ones(2, np.float32), ["beta", "gamma"]), (f32(2), None)):
        model = _model(
            [
                node("Reshape", ["x", "grouped"], ["g"]),
                node("InstanceNormalization", ["g", "scale", "bias"], ["n"]),
                node("Reshape", ["n", "back"], ["nb"]),
                node("Mul", ["nb", "gamma"], ["scaled"]),
                node("Add", ["scaled", "beta"], ["y"]),
            ],
            {
                "grouped": np.array([0, 2, -1], np.int64),
                "back": np.array([0, 4, 3, 3], np.int64),
                "scale": scale,
                "bias": np.zeros(2, np.float32),
                "gamma": f32(4, 1, 1),
                "beta": f32(4, 1, 1),
            },
            [("x", F, [1, 4, 3, 3])],
            ["y"],
            shape=[1, 4, 3, 3],
        )
        weights = sorted(_weights(model))
        assert weights == (expected or ["beta", "bias", "gamma", "scale"])


def test_a_scalers_fitted_statistics_are_not_weights_the_layer_after_it_is():
    """skl2onnx's ``StandardScaler`` + ``MLPRegressor``: ``ai.onnx.ml::Scaler`` (mean and
    1/std of the training data in its attributes), then the network. The lowered Scaler's
    offset and scale are no default weights (before: both were, so training moved the
    features' normalisation); named, they are trained."""
    node = helper.make_node
    model = _model(
        [
            node(
                "Scaler",
                ["x"],
                ["scaled"],
                domain="ai.onnx.ml",
                offset=[5.0, 0.0, 12.0],
                scale=[0.3, 1.0, 0.1],
            ),
            node("MatMul", ["scaled", "kernel"], ["h"]),
            node("Add", ["h", "bias"], ["y"]),
        ],
        {"kernel": f32(3, 2), "bias": f32(2)},
        [("x", F, [None, 3])],
        ["y"],
        domains=["ai.onnx.ml"],
        shape=[None, 2],
    )
    assert _weights(model) == ["kernel", "bias"]
    step = make_train_step(model, ["Scaler_offset"], learning_rate=LearningRateSGD())
    assert step.weights == ("Scaler_offset",)


def hann_dft_rows() -> tuple[np.ndarray, np.ndarray]:
    """``w_n cos(2 pi k n / 8)`` and ``w_n sin(2 pi k n / 8)``, ``k < 5``, ``w`` a Hann window
    (rows of an STFT's DFT basis, float64)."""
    angle = 2 * np.pi * np.outer(np.arange(5), np.arange(8)) / 8
    window = np.hanning(10)[1:-1]
    return window * np.cos(angle), window * np.sin(angle)


def _conv_stft_front(real, imag):
    """torchlibrosa's STFT as two 1-D convolutions (openwakeword's melspectrogram.onnx):
    the power ``re^2 + im^2`` times a mel filterbank, ``log(mel + guard)``, a dense head."""
    node = helper.make_node
    nodes = [
        node("Unsqueeze", ["x", "one"], ["signal"]),
        node("Conv", ["signal", "real"], ["re"], strides=[4]),
        node("Conv", ["signal", "imag"], ["im"], strides=[4]),
        node("Mul", ["re", "re"], ["re2"]),
        node("Pow", ["im", "two"], ["im2"]),
        node("Add", ["re2", "im2"], ["power"]),
        node("Transpose", ["power"], ["frames"], perm=[0, 2, 1]),
        node("MatMul", ["frames", "mel"], ["mels"]),
        node("Add", ["mels", "guard"], ["guarded"]),
        node("Log", ["guarded"], ["logmel"]),
        node("Flatten", ["logmel"], ["flat"]),
        node("MatMul", ["flat", "head"], ["y"]),
    ]
    inits = {
        "one": np.array([1], np.int64),
        "two": np.float32(2),
        "real": real,
        "imag": imag,
        "mel": np.abs(f32(5, 3)),
        "guard": np.float32(1e-10),
        "head": f32(3 * 7, 2),
    }
    return _model(nodes, inits, [("x", F, [2, 32])], ["y"], shape=[2, 2])


def test_an_stft_written_as_convolutions_is_a_spectrum_its_kernels_are_not_weights():
    """The kernels ``w_n cos(2 pi k n / N)`` and ``-w_n sin(2 pi k n / N)`` (Hann window,
    ``N = 8``, 5 bins) compute a spectrum: they and the mel filterbank after its power are
    fixed transforms (before: all three were default weights); convolutions by trained
    kernels of the same shape stay weights, and so does the filterbank after them."""
    cos, sin = hann_dft_rows()
    real = cos.astype(np.float32)[:, None, :]
    imag = (-sin).astype(np.float32)[:, None, :]
    assert _weights(_conv_stft_front(real, imag)) == ["head"]
    trained = _conv_stft_front(f32(5, 1, 8), f32(5, 1, 8) * 0.5)
    assert _weights(trained) == ["real", "imag", "mel", "head"]


def _branched_stft_front(then_kernel: str, else_kernel: str, inits: dict):
    """silero's spox export: the STFT (a convolution by a DFT basis) inside both branches
    of an ``If`` on the sample rate, its magnitude and a trained head after the ``If``."""
    node = helper.make_node

    def branch(name, kernel):
        out = helper.make_tensor_value_info(f"spec_{name}", F, None)
        conv = node("Conv", ["signal", kernel], [f"spec_{name}"], strides=[4])
        return helper.make_graph([conv], name, [], [out])

    nodes = [
        node("Unsqueeze", ["x", "one"], ["signal"]),
        node(
            "If",
            ["c"],
            ["spec"],
            then_branch=branch("a", then_kernel),
            else_branch=branch("b", else_kernel),
        ),
        node("Mul", ["spec", "spec"], ["power"]),
        node("Transpose", ["power"], ["frames"], perm=[0, 2, 1]),
        node("MatMul", ["frames", "mel"], ["mels"]),
        node("Flatten", ["mels"], ["flat"]),
        node("MatMul", ["flat", "head"], ["y"]),
    ]
    inits = {"one": np.array([1], np.int64), "mel": np.abs(f32(10, 3)), "head": f32(21, 2), **inits}
    inputs = [("x", F, [2, 32]), ("c", TensorProto.BOOL, [])]
    return _model(nodes, inits, inputs, ["y"], shape=[2, 2])


def test_an_stft_inside_if_branches_is_a_spectrum_a_trained_kernel_there_a_weight():
    """Initializers read inside ``If`` branches had no role read (every one was a weight:
    silero-vad's spox exports' ``forward_basis_buffer``); the branches are walked now. A
    branch convolving by a trained kernel keeps it, and the filterbank after the ``If``, a
    weight."""
    cos, sin = hann_dft_rows()
    basis = np.concatenate([cos, sin])
    basis = basis.astype(np.float32)[:, None, :]
    assert _weights(_branched_stft_front("basis", "basis", {"basis": basis})) == ["head"]
    mixed = _branched_stft_front("basis", "trained", {"basis": basis, "trained": f32(10, 1, 8)})
    assert _weights(mixed) == ["mel", "head", "trained"]


def _smoothed(kernel: np.ndarray):
    node = helper.make_node
    nodes = [
        node("Conv", ["x", "window"], ["smooth"], pads=[2, 2]),
        node("Flatten", ["smooth"], ["flat"]),
        node("MatMul", ["flat", "head"], ["y"]),
    ]
    inits = {"window": kernel.astype(np.float32), "head": f32(16, 2)}
    return _model(nodes, inits, [("x", F, [2, 1, 16])], ["y"], shape=[2, 2])


def test_a_normalised_smoothing_window_is_not_a_weight_a_trained_kernel_is():
    """silero's adaptive normalisation smooths the log spectrum's mean by a fixed Gaussian
    (non-negative, symmetric, summing to 1): no weight (before: a default weight). A random
    kernel, or a non-negative one summing to 1 that is not symmetric, stays a weight."""
    gauss = np.exp(-0.5 * np.arange(-2, 3) ** 2)
    assert _weights(_smoothed((gauss / gauss.sum())[None, None])) == ["head"]
    assert _weights(_smoothed(np.full((1, 1, 5), 0.2))) == ["head"]  # a moving average
    assert _weights(_smoothed(f32(1, 1, 5))) == ["window", "head"]
    skewed = np.array([0.1, 0.2, 0.3, 0.4, 0.0])[None, None]
    assert _weights(_smoothed(skewed)) == ["window", "head"]


def test_a_lowered_group_norm_statically_quantized_keeps_its_ones_and_zeros_constants():
    """``quantize_static`` of the lowered GroupNorm (wav2vec2's feature encoder): the scale
    of ones fake-quantized like a weight, the normalized groups and their reshape each
    quantized and dequantized before the ``Mul``. Still structure: gamma and beta are the
    weights (before: the ones and zeros too)."""
    node = helper.make_node

    def qdq(name: str, scale: str) -> list:
        return [
            node("QuantizeLinear", [name, scale, "zero"], [f"{name}_q"]),
            node("DequantizeLinear", [f"{name}_q", scale, "zero"], [f"{name}_dq"]),
        ]

    model = _model(
        [
            node("Reshape", ["x", "grouped"], ["g"]),
            *qdq("ones", "unit"),
            node("InstanceNormalization", ["g", "ones_dq", "zeros"], ["n"]),
            *qdq("n", "step"),
            node("Reshape", ["n_dq", "back"], ["nb"]),
            *qdq("nb", "step"),
            node("Mul", ["nb_dq", "gamma"], ["scaled"]),
            node("Add", ["scaled", "beta"], ["y"]),
        ],
        {
            "grouped": np.array([0, 2, -1], np.int64),
            "back": np.array([0, 4, 3, 3], np.int64),
            "ones": np.ones(2, np.float32),
            "zeros": np.zeros(2, np.float32),
            "unit": np.float32(1 / 127),
            "step": np.float32(0.05),
            "zero": np.int8(0),
            "gamma": f32(4, 1, 1),
            "beta": f32(4, 1, 1),
        },
        [("x", F, [1, 4, 3, 3])],
        ["y"],
        shape=[1, 4, 3, 3],
    )
    assert sorted(_weights(model)) == ["beta", "gamma"]
