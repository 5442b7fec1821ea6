"""Every loss name through every entry point: the first-batch loss equals an independent
reference (scikit-learn's metrics, torch's losses where torch is installed, numpy).

Entry points: :func:`onnxgrad.add_loss_output`, :class:`OrtGradientOptimizer` on that
model, :class:`OrtGradientForwardBackwardOptimizer` with ``learning_loss=name``, and the
commands ``onnxgrad add-loss --score name`` and ``onnxgrad train --loss name``.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from sklearn.metrics import log_loss, mean_absolute_error, mean_squared_error

from onnxgrad import add_loss_output
from onnxgrad.graph.loss_table import ALIASES, LOSSES
from onnxgrad.training import (
    LearningRateSGD,
    OrtGradientForwardBackwardOptimizer,
    OrtGradientOptimizer,
)
from onnxgrad.training.step.losses import select_learning_loss
from tests.cli.helpers import run_in_process, run_model

N, FEATURES, CLASSES = 12, 4, 3
#: the output each loss is put on: regression values, probabilities or logits
OUTPUT = {
    "squared_error": "values",
    "absolute_error": "values",
    "elastic": "values",
    "log": "p1",
    "log_logits": "s",
    "cross_entropy": "p",
    "cross_entropy_logits": "z",
}


def model() -> onnx.ModelProto:
    """``z = x W + b`` (3 columns), ``p = softmax(z)``, ``s = z[:, :1]``, ``p1 = sigmoid(s)``,
    ``values = z[:, :2]``."""
    rng = np.random.default_rng(7)
    W = rng.standard_normal((FEATURES, CLASSES)).astype(np.float32)
    b = rng.standard_normal(CLASSES).astype(np.float32)
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["z"]),
        helper.make_node("Softmax", ["z"], ["p"], axis=1),
        helper.make_node("Slice", ["z", "zero", "one", "one"], ["s"]),
        helper.make_node("Sigmoid", ["s"], ["p1"]),
        helper.make_node("Slice", ["z", "zero", "two", "one"], ["values"]),
    ]
    constants = [
        numpy_helper.from_array(np.array([v], np.int64), name)
        for name, v in (("zero", 0), ("one", 1), ("two", 2))
    ]
    outputs = [("z", CLASSES), ("p", CLASSES), ("s", 1), ("p1", 1), ("values", 2)]
    graph = helper.make_graph(
        nodes,
        "table",
        [helper.make_tensor_value_info("x", f, [None, FEATURES])],
        [helper.make_tensor_value_info(name, f, [None, k]) for name, k in outputs],
        [numpy_helper.from_array(W, "W"), numpy_helper.from_array(b, "b"), *constants],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def data(name: str):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((N, FEATURES)).astype(np.float32)
    kind = OUTPUT[name]
    if kind == "values":
        return x, rng.standard_normal((N, 2)).astype(np.float32)
    return x, rng.integers(0, 2 if kind in ("p1", "s") else CLASSES, N).astype(np.int64)


def reference(name: str, x, y) -> float:
    """The loss summed over the batch (the default reduction): the mean of scikit-learn's or
    torch's metric times the number of label elements."""
    return mean_reference(name, x, y) * y.size


def mean_reference(name: str, x, y) -> float:
    out = {k: v.astype(np.float64) for k, v in run_model(model(), {"x": x}).items()}
    if name == "squared_error":
        return mean_squared_error(y, out["values"])
    if name == "absolute_error":
        return mean_absolute_error(y, out["values"])
    if name == "elastic":
        d = out["values"] - y
        return float(np.mean(0.5 * np.abs(d) + 0.5 * d**2))
    if name in ("log", "log_logits"):
        probability = 1 / (1 + np.exp(-out["s"][:, 0]))  # from the logits, not from p1
        return log_loss(y, probability)
    if name == "cross_entropy":
        p = out["p"] / out["p"].sum(axis=1, keepdims=True)  # float32 rows, summed in float64
        return log_loss(y, p, labels=list(range(CLASSES)))
    try:
        import torch
    except ImportError:  # numpy: -log softmax(z)_y = logsumexp(z) - z_y
        z = out["z"]
        top = z.max(axis=1)
        log_sum = top + np.log(np.exp(z - top[:, None]).sum(axis=1))
        return float(np.mean(log_sum - z[np.arange(len(y)), y]))
    return torch.nn.functional.cross_entropy(torch.tensor(out["z"]), torch.tensor(y)).item()


CANONICAL = list(LOSSES)
EVERY_NAME = [*LOSSES, *ALIASES]


def canonical(name: str) -> str:
    return ALIASES.get(name, name)


def estimator_options():
    """One batch of N rows, one epoch, a learning rate too small to matter."""
    return {
        "batch_size": N,
        "max_iter": 1,
        "learning_rate": LearningRateSGD(eta0=1e-12, learning_rate="constant"),
    }


@pytest.mark.parametrize("name", EVERY_NAME)
def test_add_loss_output(name):
    x, y = data(canonical(name))
    with_loss = add_loss_output(model(), name, output_index=OUTPUT[canonical(name)])
    got = run_model(with_loss, {"x": x, "label": y})["loss"]
    assert got == pytest.approx(reference(canonical(name), x, y), rel=1e-5)


@pytest.mark.parametrize("name", CANONICAL)
def test_ort_gradient_optimizer(name):
    x, y = data(name)
    with_loss = add_loss_output(model(), name, output_index=OUTPUT[name])
    est = OrtGradientOptimizer(with_loss, ["W", "b"], **estimator_options()).fit(x, y)
    assert est.train_losses_[0] == pytest.approx(reference(name, x, y), rel=1e-5)


@pytest.mark.parametrize("name", EVERY_NAME)
def test_forward_backward_optimizer(name):
    x, y = data(canonical(name))
    est = OrtGradientForwardBackwardOptimizer(
        model(),
        ["W", "b"],
        learning_loss=name,
        output=OUTPUT[canonical(name)],
        **estimator_options(),
    ).fit(x, y)
    assert est.train_losses_[0] == pytest.approx(reference(canonical(name), x, y), rel=1e-5)


@pytest.mark.parametrize("name", CANONICAL)
def test_command_add_loss(tmp_path, name):
    x, y = data(name)
    onnx.save(model(), tmp_path / "m.onnx")
    result = run_in_process(
        "add-loss", "m.onnx", "-o", "l.onnx", "--score", name, "--prediction", OUTPUT[name],
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    got = run_model(tmp_path / "l.onnx", {"x": x, "label": y})["loss"]
    assert got == pytest.approx(reference(name, x, y), rel=1e-5)


@pytest.mark.parametrize("name", CANONICAL)
def test_command_train(tmp_path, name):
    x, y = data(name)
    only = onnx.utils.Extractor(model()).extract_model(["x"], [OUTPUT[name]])
    onnx.save(only, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", X=x, y=y)
    result = run_in_process(
        "train", "m.onnx", "--data", "d.npz", "-o", "t.onnx", "--loss", name,
        "--epochs", "1", "--batch-size", str(N), "--optimizer", "sgd", "--lr", "1e-12",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    start = float(re.search(r"starting loss (\S+)", result.stdout).group(1))
    first = float(re.search(r"epoch +1/1 +loss (\S+)", result.stdout).group(1))
    expected = reference(name, x, y)
    assert start == pytest.approx(expected, rel=1e-5)
    assert first == pytest.approx(expected, rel=1e-5)


def logits_only() -> onnx.ModelProto:
    """The table model reduced to its logits ``z = x W + b``."""
    return onnx.utils.Extractor(model()).extract_model(["x"], ["z"])


def eval_loss(artifacts, x, y) -> float:
    feeds = {"x": x, "label": y, **artifacts.checkpoint.weights}
    return float(run_model(artifacts.path("eval_model.onnx"), feeds)["loss"])


def test_loss_objects_default_to_logits_as_their_aliases():
    from onnxgrad.training import CrossEntropyLearningLoss, NegLogLearningLoss

    assert CrossEntropyLearningLoss().loss_name == "cross_entropy_logits"
    assert NegLogLearningLoss().loss_name == "log_logits"
    assert select_learning_loss("neg_log").get_params() == NegLogLearningLoss().get_params()
    for alias, name in ALIASES.items():
        assert select_learning_loss(alias).loss_name == name, alias


def test_generate_artifacts_default_cross_entropy_object_is_on_logits(tmp_path):
    from onnxgrad.training import CrossEntropyLearningLoss, generate_artifacts

    x, y = data("cross_entropy_logits")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        art = generate_artifacts(logits_only(), loss=CrossEntropyLearningLoss(), folder=tmp_path)
    assert eval_loss(art, x, y) == pytest.approx(reference("cross_entropy_logits", x, y), rel=1e-5)


@pytest.mark.parametrize(("name", "fix"), [("cross_entropy", "cross_entropy_logits")])
def test_generate_artifacts_warns_for_a_probabilities_loss_on_logits(tmp_path, name, fix):
    from onnxgrad.training import generate_artifacts

    with pytest.warns(UserWarning, match=rf"'{name}' expects probabilities.*'z'.*use '{fix}'"):
        generate_artifacts(logits_only(), loss=name, folder=tmp_path)


def test_generate_artifacts_refuses_a_logits_loss_on_a_softmax(tmp_path):
    from onnxgrad.training import CrossEntropyLearningLoss, generate_artifacts

    probabilities = onnx.utils.Extractor(model()).extract_model(["x"], ["p"])
    with pytest.raises(ValueError, match=r"Softmax node computing 'p'.*use 'cross_entropy'"):
        generate_artifacts(probabilities, loss=CrossEntropyLearningLoss(), folder=tmp_path)
    assert not (tmp_path / "training_model.onnx").exists()


def per_row(name: str, x, y) -> np.ndarray:
    """The pointwise loss summed over a row's elements (numpy)."""
    out = {k: v.astype(np.float64) for k, v in run_model(model(), {"x": x}).items()}
    if name == "squared_error":
        return ((out["values"] - y) ** 2).sum(axis=1)
    z = out["z"]
    top = z.max(axis=1)
    return top + np.log(np.exp(z - top[:, None]).sum(axis=1)) - z[np.arange(len(y)), y]


def elastic_penalty(l1: float, l2: float) -> float:
    weights = [numpy_helper.to_array(i).astype(np.float64) for i in model().graph.initializer]
    return sum(l1 * np.abs(w).sum() + l2 * (w**2).sum() for w in weights[:2])


BATCH = 5  # N = 12 rows: batches of 5, 5 and 2


def expected_objective(name: str, reduction: str, x, y, penalty: float) -> float:
    """The scale every reported loss uses: batches of BATCH rows, 'mean' weighted by rows
    (the mean over every element), 'sum' each batch's sum once, the penalty added once."""
    rows = per_row(name, x, y)
    if reduction == "mean":
        columns = 2 if name == "squared_error" else 1
        return rows.sum() / (len(rows) * columns) + penalty
    return rows.sum() / -(-len(rows) // BATCH) + penalty


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", ["squared_error", "cross_entropy_logits"])
def test_command_train_reports_one_scale(tmp_path, name, reduction):
    """Starting, epoch and validation losses of `onnxgrad train` with batches smaller than
    the data, a penalty and both reductions (the learning rate too small to move)."""
    x, y = (np.repeat(a[:1], N, axis=0) for a in data(name))  # any split: the same rows
    only = onnx.utils.Extractor(model()).extract_model(["x"], [OUTPUT[name]])
    onnx.save(only, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", X=np.concatenate([x, x]), y=np.concatenate([y, y]))
    result = run_in_process(
        "train", "m.onnx", "--data", "d.npz", "-o", "t.onnx", "--loss", name,
        "--reduction", reduction, "--penalty", "l1:0.01,l2:0.02", "--val-fraction", "0.5",
        "--epochs", "1", "--batch-size", str(BATCH), "--optimizer", "sgd", "--lr", "1e-12",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    start = re.search(r"starting loss (\S+)  validation (\S+)", result.stdout)
    first = re.search(r"epoch +1/1 +loss (\S+)  validation (\S+)", result.stdout)
    penalty = elastic_penalty(0.01, 0.02)
    expected = expected_objective(name, reduction, x, y, penalty)
    for value in (*start.groups(), *first.groups()):
        assert float(value) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_generate_artifacts_eval_model_reduction(tmp_path, reduction):
    from onnxgrad.training import generate_artifacts

    x, y = data("cross_entropy_logits")
    loss = select_learning_loss("cross_entropy_logits", reduction)
    art = generate_artifacts(logits_only(), loss=loss, folder=tmp_path)
    rows = per_row("cross_entropy_logits", x, y)
    expected = rows.mean() if reduction == "mean" else rows.sum()
    assert reference("cross_entropy_logits", x, y) == pytest.approx(rows.sum(), rel=1e-6)
    assert eval_loss(art, x, y) == pytest.approx(expected, rel=1e-5)
    result = run_in_process(
        "artifacts", "m.onnx", "-o", "art", "--loss", "cross_entropy_logits",
        "--reduction", reduction, cwd=_saved(tmp_path, logits_only()),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    feeds = {"x": x, "label": y, **art.checkpoint.weights}
    got = run_model(tmp_path / "art" / "eval_model.onnx", feeds)["loss"]
    assert float(got) == pytest.approx(expected, rel=1e-5)


def _saved(folder, onnx_model):
    onnx.save(onnx_model, folder / "m.onnx")
    return folder


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_estimator_losses_share_one_scale(reduction):
    """train_losses_, validation_losses_ and objective() with batches of 5, 5 and 2 rows and a
    penalty: one scale, whatever rows the shuffled batches hold."""
    from onnxgrad.training import ElasticLearningPenalty

    name = "cross_entropy_logits"
    x, y = data(name)
    est = OrtGradientForwardBackwardOptimizer(
        model(),
        ["W", "b"],
        learning_loss=name,
        output="z",
        learning_penalty=ElasticLearningPenalty(l1=0.01, l2=0.02),
        **{**estimator_options(), "batch_size": BATCH},
    )
    est.learning_loss = select_learning_loss(name, reduction)
    expected = expected_objective(name, reduction, x, y, elastic_penalty(0.01, 0.02))
    est.fit(x, y, X_val=x, y_val=y)
    assert est.train_losses_[0] == pytest.approx(expected, rel=1e-5)
    assert est.validation_losses_[0] == pytest.approx(expected, rel=1e-5)
    assert est.objective(x, y) == pytest.approx(expected, rel=1e-5)


def test_every_entry_point_defaults_to_the_canonical_squared_error():
    import inspect

    from onnxgrad.cli import build_parser
    from onnxgrad.training import OrtGradientClassifier, generate_artifacts

    defaults = {
        "add_loss_output": inspect.signature(add_loss_output).parameters["score_name"].default,
        "generate_artifacts": inspect.signature(generate_artifacts).parameters["loss"].default,
        "estimator": OrtGradientForwardBackwardOptimizer(model()).get_params()["learning_loss"],
    }
    parser = build_parser()
    for command, flag in (("add-loss", "score"), ("train", "loss"), ("artifacts", "loss")):
        args = ["m.onnx", "-o", "o"] + (["--data", "d.npz"] if command == "train" else [])
        defaults[command] = getattr(parser.parse_args([command, *args]), flag)
    assert set(defaults.values()) == {"squared_error"} <= set(LOSSES), defaults
    assert OrtGradientClassifier(model()).get_params()["learning_loss"] in LOSSES


def test_entry_points_put_the_loss_on_the_same_first_float_output(tmp_path):
    """A model whose first output is an int64 class: every entry point picks `z`."""
    from onnxgrad.training import generate_artifacts

    labelled = model()
    labelled.graph.node.append(helper.make_node("ArgMax", ["z"], ["label_out"], axis=1))
    outputs = list(labelled.graph.output)
    del labelled.graph.output[:]
    labelled.graph.output.extend(
        [helper.make_tensor_value_info("label_out", TensorProto.INT64, [None, 1]), *outputs]
    )
    name = "cross_entropy_logits"
    x, y = data(name)
    expected = reference(name, x, y)
    with_loss = add_loss_output(labelled, name)
    assert run_model(with_loss, {"x": x, "label": y})["loss"] == pytest.approx(expected, rel=1e-5)
    art = generate_artifacts(labelled, loss=name, folder=tmp_path)
    assert eval_loss(art, x, y) == pytest.approx(expected, rel=1e-5)
    est = OrtGradientForwardBackwardOptimizer(labelled, learning_loss=name, **estimator_options())
    assert est.fit(x, y).train_losses_[0] == pytest.approx(expected, rel=1e-5)
    assert est.graphs_.output == "z" and est.graphs_.n_classes == CLASSES


def test_one_reduction_check_for_every_entry_point():
    from onnxgrad.training import SquareLearningLoss

    message = r"reduction must be one of \['sum', 'mean'\], got 'total'"
    with pytest.raises(ValueError, match=message):
        add_loss_output(model(), "squared_error", output_index="values", reduction="total")
    with pytest.raises(ValueError, match=message):
        select_learning_loss("squared_error", "total")
    with pytest.raises(ValueError, match=message):
        select_learning_loss(SquareLearningLoss(reduction="total"))


@pytest.mark.parametrize("name", ["log", "log_logits", "cross_entropy_logits"])
def test_class_labels_of_shape_n_and_n_by_1_everywhere(tmp_path, name):
    """The seeds' labels ``[N, 1]`` and scikit-learn's ``[N]`` give the same first loss through
    the estimators, the runner with a data loader, and ``onnxgrad train``."""
    from onnxgrad.training import OrtDataLoader, TrainingRunner, check_device, make_train_step

    x, y = data(name)
    expected = reference(name, x, y)
    only = onnx.utils.Extractor(model()).extract_model(["x"], [OUTPUT[name]])
    onnx.save(only, tmp_path / "m.onnx")
    loss = select_learning_loss(name)
    step = make_train_step(only, ["W", "b"], loss=loss, learning_rate=LearningRateSGD())
    weights = {i.name: numpy_helper.to_array(i) for i in model().graph.initializer[:2]}
    for labels in (y, y.reshape(-1, 1)):
        est = OrtGradientForwardBackwardOptimizer(
            only, ["W", "b"], learning_loss=name, **estimator_options()
        ).fit(x, labels)
        assert est.train_losses_[0] == pytest.approx(expected, rel=1e-5)
        runner = TrainingRunner(step, check_device("cpu"), weights)
        first = runner.run_epoch(OrtDataLoader(x, labels, batch_size=N), 1e-12)[0]
        assert first == pytest.approx(expected, rel=1e-5)
        np.savez(tmp_path / "d.npz", X=x, y=labels)
        result = run_in_process(
            "train", "m.onnx", "--data", "d.npz", "-o", "t.onnx", "--loss", name,
            "--epochs", "1", "--batch-size", str(N), "--optimizer", "sgd", "--lr", "1e-12",
            cwd=tmp_path,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        start = float(re.search(r"starting loss (\S+)", result.stdout).group(1))
        assert start == pytest.approx(expected, rel=1e-5)
