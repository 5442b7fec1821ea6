"""The normalisation pipeline on models written as shipped files are, each checked against
central finite differences of the ORIGINAL model (float64, reference evaluator) and by
training with the generated artifacts in plain onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from onnxgrad import (
    OrtGradientForwardBackwardOptimizer,
    generate_artifacts,
    get_train_initializer,
    onnx_derivative,
)
from onnxgrad.normalize import PASSES, normalized_model
from onnxgrad.training.step.composition import make_train_step
from onnxgrad.training.step.losses import SquareLearningLoss
from tests.cli.helpers import run_in_process, save
from tests.derivative.fd import onnx_function
from tests.normalize import models

RNG = np.random.default_rng(0)
EPS = 1e-5


def _constant_values(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    from onnxgrad._onnx_utils import subgraphs

    values = {}

    def visit(graph) -> None:
        for node in graph.node:
            if node.op_type == "Constant" and node.attribute[0].name == "value":
                values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
            for sub in subgraphs(node):
                visit(sub)

    visit(model.graph)
    return values


def _directional_fd(model, feeds, seeds, moved: str, direction) -> float:
    """``d/dt sum_k <g_k, y_k>`` along ``direction`` of the input, initializer or Constant
    ``moved`` of the original model."""

    def objective(t: float) -> float:
        point = dict(feeds)
        m = model
        initializers = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
        if moved in feeds or moved in initializers:
            base = feeds[moved] if moved in feeds else initializers[moved]
            point[moved] = base.astype(np.float64) + t * direction
        else:
            value = _constant_values(model)[moved].astype(np.float64) + t * direction
            m = models.with_constant_value(model, moved, value)
        outputs = onnx_function(m)(point)
        return sum(float(np.sum(g * y)) for g, y in zip(seeds, outputs))

    return (objective(EPS) - objective(-EPS)) / (2 * EPS)


def _gradients(model, feeds, seeds, weights) -> dict[str, np.ndarray]:
    """The native gradient graph of ``model`` run on onnxruntime: ``{name: gradient}``."""
    gradient = onnx_derivative(model)
    session = ort.InferenceSession(gradient.SerializeToString(), providers=["CPUExecutionProvider"])
    run_feeds = dict(feeds)
    run_feeds.update(weights)
    for output, seed in zip(model.graph.output, seeds):
        run_feeds[f"{output.name}_grad"] = seed.astype(np.float32)
    wanted = {i.name for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    values = session.run(names, {k: v for k, v in run_feeds.items() if k in wanted})
    return {n[: -len("_grad")]: v for n, v in zip(names, values) if n.endswith("_grad")}


def _check_against_fd(model, feeds, seeds, names) -> None:
    weights = {k: v for k, (v, _) in get_train_initializer(model).items()}
    grads = _gradients(model, feeds, seeds, weights)
    for name in names:
        point = feeds.get(name, weights.get(name))
        direction = RNG.normal(size=point.shape)
        expected = _directional_fd(model, feeds, seeds, name, direction)
        got = float(np.sum(grads[name].astype(np.float64) * direction))
        np.testing.assert_allclose(got, expected, rtol=2e-3, atol=1e-4, err_msg=name)


def test_passes_are_named_and_say_what_they_ensure():
    names = [p.name for p in PASSES]
    assert len(names) == len(set(names)) and all(p.ensures for p in PASSES)


def test_constant_weights_and_dynamic_dims_of_a_paddle_like_model():
    """Class 1 and 2 of issue 19: weights stored as Constants are found and differentiated,
    the ``-1`` dims are dynamic, the scalar 0.5 and the int64 shape stay constants."""
    model = models.paddle_like()
    before = model.SerializeToString()
    weights = get_train_initializer(model)
    assert sorted(weights) == ["conv_b", "conv_w", "fc_b", "fc_w"]
    x = RNG.normal(size=(2, 3, 5, 5)).astype(np.float32)
    seeds = [RNG.normal(size=(2, 2))]
    _check_against_fd(model, {"x": x}, seeds, ["x", "conv_w", "conv_b", "fc_w", "fc_b"])
    normal = normalized_model(model)
    assert [n.output[0] for n in normal.graph.node if n.op_type == "Constant"] == ["half", "shape"]
    dims = normal.graph.input[0].type.tensor_type.shape.dim
    assert not any(d.HasField("dim_value") and d.dim_value < 0 for d in dims)
    assert model.SerializeToString() == before


def test_normalising_twice_changes_nothing():
    for build in (models.paddle_like, models.weights_in_branches, models.resize_opset11):
        once = normalized_model(build())
        twice = normalized_model(once)
        assert twice.SerializeToString() == once.SerializeToString(), build.__name__


@pytest.mark.parametrize(
    "entry",
    [
        lambda model, folder: generate_artifacts(model, artifact_directory=folder),
        lambda model, folder: make_train_step(model, loss=SquareLearningLoss()),
        lambda model, folder: OrtGradientForwardBackwardOptimizer(model, max_iter=1).fit(
            RNG.normal(size=(4, 3, 5, 5)).astype(np.float32),
            RNG.normal(size=(4, 2)).astype(np.float32),
        ),
    ],
    ids=["generate_artifacts", "make_train_step", "estimator_fit"],
)
def test_an_entry_point_normalises_once(entry, tmp_path, monkeypatch):
    """The entry points built on others (the train step on the loss model, the artifacts on
    the train and eval steps, the estimator on all of them) run the pipeline once."""
    from onnxgrad.normalize import pipeline

    runs = []
    normalize = pipeline.normalize_in_place
    monkeypatch.setattr(
        pipeline, "normalize_in_place", lambda m, *facts: runs.append(1) or normalize(m, *facts)
    )
    entry(models.paddle_like(), tmp_path / "artifacts")
    assert len(runs) == 1


def test_weights_inside_if_branches_are_promoted_and_differentiated():
    model = models.weights_in_branches()
    assert sorted(get_train_initializer(model)) == ["w_else", "w_then"]
    x = RNG.normal(size=(2, 3)).astype(np.float32)
    for flag, taken in ((True, "w_then"), (False, "w_else")):
        feeds = {"x": x, "flag": np.array(flag)}
        _check_against_fd(model, feeds, [RNG.normal(size=(2, 3))], ["x", taken])


def test_a_wrong_declared_output_rank_is_replaced_by_the_computed_one():
    """Class 2: the train step's label takes the computed shape ``[N, 2]``, not the
    declared ``[N]``, and onnxruntime runs the step."""
    model = models.wrong_output_rank()
    normal = normalized_model(model)
    dims = normal.graph.output[0].type.tensor_type.shape.dim
    assert len(dims) == 2 and dims[1].dim_value == 2
    step = make_train_step(model, loss=SquareLearningLoss(reduction="sum"))
    session = ort.InferenceSession(
        step.model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    label = next(i for i in session.get_inputs() if i.name == step.label)
    assert len(label.shape) == 2
    x = RNG.normal(size=(5, 3)).astype(np.float32)
    feeds = {step.features[0]: x, step.label: np.zeros((5, 2), np.float32)}
    feeds.update(step.weight_inputs({k: v for k, (v, _) in get_train_initializer(model).items()}))
    feeds.update(step.state_inputs(step.initial_state()))
    feeds["learning_rate"] = np.array(0.01, np.float32)
    wanted = {i.name for i in session.get_inputs()}
    loss = session.run([step.loss], {k: v for k, v in feeds.items() if k in wanted})[0]
    W = numpy_helper.to_array(model.graph.initializer[0])
    np.testing.assert_allclose(loss, np.sum((x @ W) ** 2), rtol=1e-4)


@pytest.mark.parametrize("build", [models.resize_opset11, models.lstm_opset12])
def test_every_entry_point_agrees_on_old_opsets(build, tmp_path):
    """Class 3: onnx_derivative, info and generate_artifacts take the same model the same
    way (Resize-11 and an opset-12 LSTM, refused by some entry points before)."""
    model = build()
    x_shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = RNG.normal(size=x_shape).astype(np.float32)
    out = model.graph.output[0].type.tensor_type.shape.dim
    seeds = [RNG.normal(size=[d.dim_value for d in out])]
    weights = sorted(get_train_initializer(model))
    _check_against_fd(model, {"x": x}, seeds, ["x", *weights])
    save(model, tmp_path / "model.onnx")
    info = run_in_process("info", "model.onnx", cwd=tmp_path)
    assert info.returncode == 0, info.stderr
    assert "nothing: the gradient and the train step build" in info.stdout
    artifacts = generate_artifacts(model, artifact_directory=tmp_path / "art", optimizer="sgd")
    assert set(artifacts.train_step.weights) == set(weights)


def test_info_names_what_stops_the_build(tmp_path):
    """info's dry build: an op without a rule is named, and the section never says
    'nothing' when the gradient cannot be built."""
    model = models.paddle_like()
    model.graph.node[-1].domain = "com.example"
    model.graph.node[-1].op_type = "Frobnicate"
    model.opset_import.append(onnx.helper.make_opsetid("com.example", 1))
    save(model, tmp_path / "custom.onnx")
    result = run_in_process("info", "custom.onnx", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    stops = result.stdout.split("what stops differentiation or training")[1]
    assert "com.example::Frobnicate" in stops and "gradient: NotImplementedError" in stops
    assert "nothing:" not in stops
    save(models.paddle_like(), tmp_path / "paddle.onnx")
    result = run_in_process("info", "paddle.onnx", cwd=tmp_path)
    assert "trainable initializers (4," in result.stdout
    assert "4 weights stored as Constant nodes made initializers" in result.stdout
    assert "default-domain opset 11 raised to 13" in result.stdout
    assert "declares a negative dimension" not in result.stdout + result.stderr
    assert "nothing: the gradient and the train step build" in result.stdout


def _ml_only_regressor() -> onnx.ModelProto:
    """A model importing ``ai.onnx.ml`` alone, IR 3, as old converters wrote them:
    ``y = x C^T + b``."""
    from onnx import TensorProto, helper

    node = helper.make_node(
        "LinearRegressor", ["x"], ["y"], domain="ai.onnx.ml", targets=2,
        coefficients=[0.5, -1.0, 2.0, 1.5, 0.25, -0.75], intercepts=[0.1, -0.2],
    )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "ml_only",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("ai.onnx.ml", 1)], ir_version=3
    )


def test_a_model_importing_only_ai_onnx_ml_is_differentiated(tmp_path):
    """Without a default-domain import every entry refused the model ("does not import the
    default ONNX domain"); the gradient is ``g C`` for ``x`` and ``g^T x`` for ``C``."""
    model = _ml_only_regressor()
    coefficients = np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]], np.float32)
    x = RNG.normal(size=(4, 3)).astype(np.float32)
    g = RNG.normal(size=(4, 2)).astype(np.float32)
    weights = get_train_initializer(model)
    assert sorted(v[0].size for v in weights.values()) == [2, 6]
    gradient = onnx_derivative(model)
    session = ort.InferenceSession(gradient.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": x, "y_grad": g, **{n: v[0] for n, v in weights.items()}}
    wanted = {i.name for i in session.get_inputs()}
    results = dict(
        zip(
            [o.name for o in session.get_outputs()],
            session.run(None, {k: v for k, v in feeds.items() if k in wanted}),
        )
    )
    np.testing.assert_allclose(results["x_grad"], g @ coefficients, rtol=1e-5)
    (coef,) = [n for n, v in weights.items() if v[0].size == 6]
    found = results[f"{coef}_grad"]
    expected = g.T @ x
    np.testing.assert_allclose(found, expected if found.shape == expected.shape else expected.T)
    save(model, tmp_path / "ml.onnx")
    info = run_in_process("info", "ml.onnx", cwd=tmp_path)
    assert info.returncode == 0, info.stderr
    assert "default-domain opset 13 imported" in info.stdout
    assert "nothing: the gradient and the train step build" in info.stdout


def test_an_output_dimension_traced_static_follows_the_input():
    """An exporter traced with 54 rows declares the output ``[batch, 54, 4]``; onnxruntime
    runs 10 rows with a warning. Inference cannot confirm the 54 (a reshape to a computed
    shape): it becomes unknown, so the gradient's seed takes 10 rows; ``x_grad = g W^T``."""
    from onnx import TensorProto, helper

    weight = RNG.normal(size=(4, 4)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("Shape", ["x"], ["s"]),
            helper.make_node("Reshape", ["h", "s"], ["y"]),
        ],
        "traced",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "rows", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 54, 4])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    gradient = onnx_derivative(model, inputs=["x"], weights=[])
    x = RNG.normal(size=(1, 10, 4)).astype(np.float32)
    g = RNG.normal(size=(1, 10, 4)).astype(np.float32)
    session = ort.InferenceSession(gradient.SerializeToString(), providers=["CPUExecutionProvider"])
    (x_grad,) = session.run(["x_grad"], {"x": x, "y_grad": g})
    np.testing.assert_allclose(x_grad, g @ weight.T, rtol=1e-5, atol=1e-6)


def test_a_declared_dimension_inference_knows_nothing_of_stays():
    """After an op onnx has no schema for, inference gives the output no type: the
    exporter's ``[2, 10]`` stays (only a dimension inference gives as not static goes)."""
    from onnx import TensorProto, helper

    from onnxgrad.normalize.shapes import reconciled_shapes

    graph = helper.make_graph(
        [
            helper.make_node("Gelu", ["x"], ["g"], domain="com.microsoft"),
            helper.make_node("Relu", ["g"], ["z"]),
        ],
        "opaque",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 10])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 10])],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = reconciled_shapes(helper.make_model(graph, opset_imports=opsets, ir_version=8))
    dims = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    assert dims == [2, 10]


def test_an_ir3_model_whose_initializer_is_not_an_input_is_raised():
    """onnxruntime's ``datasets/mul_1.onnx``: IR 3, opset 7, ``Y = X W`` with ``W`` an
    initializer not listed among the inputs (onnxruntime runs it). onnx's version converter
    refused it ("Input W is undefined"); ``W_grad = g X``."""
    from onnx import TensorProto, helper

    weight = np.arange(1, 7, dtype=np.float32).reshape(3, 2)
    graph = helper.make_graph(
        [helper.make_node("Mul", ["X", "W"], ["Y"])],
        "mul",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [3, 2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [3, 2])],
        [numpy_helper.from_array(weight, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 7)], ir_version=3)
    x = RNG.normal(size=(3, 2)).astype(np.float32)
    g = RNG.normal(size=(3, 2)).astype(np.float32)
    gradient = onnx_derivative(model, weights=["W"])
    session = ort.InferenceSession(gradient.SerializeToString(), providers=["CPUExecutionProvider"])
    (w_grad,) = session.run(["W_grad"], {"X": x, "W": weight, "Y_grad": g})
    np.testing.assert_allclose(w_grad, g * x, rtol=1e-6)


def test_a_raised_opset_declares_no_size_from_a_negative_dimension():
    """onnx's version converter declares every value's inferred shape; from PaddlePaddle's
    ``-1`` it derived sizes of -1 and 0 (a strided Conv: ``(-1 + 2 - 3) // 2 + 1``), which
    onnxruntime's layout optimisations reject in a merged model ("Invalid Target shape
    product of 0"): the negative dimensions are made unknown before converting."""
    from onnxgrad.graph.opset_raise import raised_opset

    model = models.paddle_like()
    model.graph.node[6].attribute.append(onnx.helper.make_attribute("strides", [2, 2]))
    for dim in model.graph.input[0].type.tensor_type.shape.dim[2:]:
        dim.dim_value = -1
    raised = raised_opset(model, 13)
    values = [*raised.graph.input, *raised.graph.value_info, *raised.graph.output]
    declared = {
        v.name: [
            d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim
        ]
        for v in values
    }
    assert declared["c"] == [None, 4, None, None] and declared["p"] == [None, 4, 1, 1], declared
    assert all(d is None or d > 0 for dims in declared.values() for d in dims), declared
    x = RNG.normal(size=(2, 3, 7, 7)).astype(np.float32)
    session = ort.InferenceSession(raised.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = onnx_function(model)({"x": x})
    np.testing.assert_allclose(session.run(None, {"x": x})[0], expected[0], rtol=1e-5)


def test_weights_trained_in_an_old_opset_file_keep_its_operators(tmp_path):
    """A file below the rules' opset is trained raised to it; its trained weights go back into
    the file as it was (opset 11: the converter wrote its ``Softmax`` as ``Flatten``,
    ``Softmax``, ``Reshape``), its outputs the normalised model's with those weights."""
    from onnxgrad.normalize.trained import trained_model

    model = models.paddle_like()
    model.graph.node[-1].attribute[0].i = -1  # the last axis: the converter rewrites it
    weights = {
        name: (value * 1.5).astype(np.float32)
        for name, (value, _) in get_train_initializer(model).items()
    }
    trained = trained_model(model, weights)
    assert trained.opset_import[0].version == 11
    assert [n.op_type for n in trained.graph.node] == [n.op_type for n in model.graph.node]
    x = RNG.normal(size=(2, 3, 5, 5)).astype(np.float32)
    normal = normalized_model(model)
    normal_weights = {
        i.name: weights.get(i.name, numpy_helper.to_array(i)) for i in normal.graph.initializer
    }
    expected = onnx_function(normal)({"x": x, **normal_weights})[0]
    got = ort.InferenceSession(trained.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(got.run(None, {"x": x})[0], expected, rtol=1e-5, atol=1e-6)
