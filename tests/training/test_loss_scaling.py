"""Dynamic loss scaling and float32 master weights for float16 models.

The reference is PyTorch's own ``GradScaler`` training the same float16 model in float16
arithmetic, float32 master weights. onnxruntime's CPU provider runs most float16 operators
in float32 (it inserts casts, and drops float32 -> float16 -> float32 round trips), so the
steps that must see float16 underflow and overflow run in onnx's reference evaluator, which
computes float16 operators in float16 as a GPU does; onnxruntime runs the others.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad.training import LearningRateAdam, LearningRateSGD, make_train_step
from onnxgrad.training.step.loss_scaling import LossScaling
from tests.models import cast_mlp_model

LR = 0.5


def _half_product(n: int = 4, w=None, float32: bool = False):
    """``y = float32(float16(x) * w)``, ``w`` a float16 vector (float32 with ``float32``)."""
    elem = TensorProto.FLOAT if float32 else TensorProto.FLOAT16
    w = np.full(n, 1e-3, dtype=np.float16) if w is None else w
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["x"], ["xh"], to=elem),
            helper.make_node("Mul", ["xh", "w"], ["yh"]),
            helper.make_node("Cast", ["yh"], ["y"], to=TensorProto.FLOAT),
        ],
        "half_product",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
        [numpy_helper.from_array(w.astype(np.float32 if float32 else np.float16), "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _batches(n: int = 4):
    """Residuals of 1e-8 (their float16 gradient 2e-8 flushes to zero unscaled), then an
    overflowing one (2 * 60 * 2^16 > 65504), then small ones again."""
    x = np.ones((1, n), dtype=np.float32)
    y = (x.astype(np.float16) * np.full(n, 1e-3, dtype=np.float16)).astype(np.float32)
    tiny = (x, y + np.float32(1e-8))
    big = (np.full((1, n), 60000.0, dtype=np.float32), np.zeros((1, n), dtype=np.float32))
    rng = np.random.default_rng(0)
    small = [(x, y + rng.uniform(-1e-3, 1e-3, (1, n)).astype(np.float32)) for _ in range(4)]
    return [tiny, tiny, big, *small]


def _torch_steps(batches, scaler_kwargs):
    """PyTorch's GradScaler and SGD on the same model: float32 master weights, float16
    arithmetic. Returns the weights, scale and growth count after each step."""
    torch = pytest.importorskip("torch")
    w = torch.nn.Parameter(torch.full((4,), 1e-3, dtype=torch.float16).float())
    opt = torch.optim.SGD([w], lr=LR)
    scaler = torch.amp.GradScaler("cpu", **scaler_kwargs) if scaler_kwargs is not None else None
    history = []
    for x, t in batches:
        y = (torch.from_numpy(x).half() * w.half()).float()
        loss = ((y - torch.from_numpy(t)) ** 2).sum()
        opt.zero_grad()
        if scaler is None:
            loss.backward()
            opt.step()
            history.append((w.detach().numpy().copy(), None, None))
            continue
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        history.append(
            (w.detach().numpy().copy(), scaler.get_scale(), int(scaler._growth_tracker.item()))
        )
    return history


def _onnx_steps(step, batches, run):
    values = {**step.weight_inputs({"w": np.full(4, 1e-3, np.float16).astype(np.float32)})}
    values.update(step.initial_state())
    history = []
    for x, t in batches:
        feeds = {"x": x, step.label: t, step.learning_rate: np.array(LR, np.float32), **values}
        outputs = dict(zip([step.loss, *step.new_weights, *step.new_state], run(feeds)))
        weights = step.unpack_weights(outputs)
        values = {**step.weight_inputs(weights)}
        values.update({s: outputs[n] for s, n in zip(step.state, step.new_state)})
        scale = values.get("loss_scale")
        growth = values.get("loss_scale_growth")
        history.append(
            (
                weights["w"],
                None if scale is None else float(scale[0]),
                None if growth is None else int(growth[0]),
            )
        )
    return history


@pytest.mark.parametrize("layout", ["per_weight", "flat"])
def test_dynamic_scaling_matches_torch_grad_scaler(layout):
    scaling = LossScaling(growth_interval=3)
    step = make_train_step(
        _half_product(), learning_rate=LearningRateSGD(), layout=layout, loss_scale=scaling
    )
    evaluator = ReferenceEvaluator(step.model)
    batches = _batches()
    with np.errstate(over="ignore", invalid="ignore"):
        got = _onnx_steps(step, batches, lambda feeds: evaluator.run(None, feeds))
    expected = _torch_steps(batches, {"init_scale": 2.0**16, "growth_interval": 3})
    for k, ((w, scale, growth), (w_ref, scale_ref, growth_ref)) in enumerate(zip(got, expected)):
        np.testing.assert_allclose(w, w_ref, rtol=1e-6, err_msg=f"step {k}")
        assert (scale, growth) == (scale_ref, growth_ref), f"step {k}"
    scales = [s for _, s, _ in got]
    assert scales == [2.0**16, 2.0**16, 2.0**15, 2.0**15, 2.0**15, 2.0**16, 2.0**16]
    assert not np.array_equal(got[0][0], np.full(4, 1e-3, np.float16).astype(np.float32))


def test_without_scaling_the_float16_gradient_flushes_to_zero():
    step = make_train_step(_half_product(), learning_rate=LearningRateSGD(), loss_scale=None)
    assert "loss_scale" not in step.state
    evaluator = ReferenceEvaluator(step.model)
    batches = _batches()[:1]
    got = _onnx_steps(step, batches, lambda feeds: evaluator.run(None, feeds))
    expected = _torch_steps(batches, None)
    start = np.full(4, 1e-3, np.float16).astype(np.float32)
    np.testing.assert_array_equal(got[0][0], start)
    np.testing.assert_array_equal(expected[0][0], start)


def _ort_run(model):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return lambda feeds: session.run(None, feeds)


def test_a_skipped_step_leaves_weights_and_adam_state_bit_equal():
    step = make_train_step(
        _half_product(), learning_rate=LearningRateAdam(), loss_scale=LossScaling(growth_interval=2)
    )
    run = _ort_run(step.model)
    rng = np.random.default_rng(1)
    values = {"w": np.full(4, 0.5, np.float32), **step.initial_state()}
    names = [step.loss, *step.new_weights, *step.new_state]
    inputs = [*step.weights, *step.state]
    scales = []
    for k in range(5):
        x = rng.standard_normal((3, 4)).astype(np.float32)
        if k == 2:
            x[1, 2] = np.inf
        feeds = {"x": x, step.label: np.zeros((3, 4), np.float32), step.learning_rate: 0.1}
        feeds[step.learning_rate] = np.array(0.1, np.float32)
        outputs = dict(zip(names, run({**feeds, **values})))
        new = {i: outputs[n] for i, n in zip(inputs, names[1:])}
        if k == 2:
            for name in ("w", *step.state[:-2]):
                np.testing.assert_array_equal(new[name], values[name], err_msg=name)
                assert new[name].tobytes() == values[name].tobytes()
        else:
            assert not np.array_equal(new["w"], values["w"])
        scales.append((float(new["loss_scale"][0]), int(new["loss_scale_growth"][0])))
        values = new
    assert scales == [(2.0**16, 1), (2.0**17, 0), (2.0**16, 0), (2.0**16, 1), (2.0**17, 0)]


def test_static_scale_skips_non_finite_steps_without_state():
    step = make_train_step(_half_product(), learning_rate=LearningRateSGD(), loss_scale=1024.0)
    assert step.state == ()
    run = _ort_run(step.model)
    w = np.full(4, 0.5, np.float32)
    x = np.ones((1, 4), np.float32)
    t = np.zeros((1, 4), np.float32)
    feeds = {"x": x, step.label: t, step.learning_rate: np.array(0.1, np.float32), "w": w}
    loss, new = run(feeds)
    np.testing.assert_allclose(new, w - 0.1 * 2 * 0.5, rtol=1e-6)
    np.testing.assert_allclose(loss, 4 * 0.25, rtol=1e-6)
    _, skipped = run({**feeds, "x": np.full((1, 4), np.nan, np.float32)})
    assert skipped.tobytes() == w.tobytes()


def test_auto_scales_float16_models_only():
    assert "loss_scale" in make_train_step(_half_product()).state
    assert make_train_step(_half_product(float32=True)).state == ()
    assert make_train_step(_half_product(), loss_scale=None).state == ()
    with pytest.raises(ValueError, match="loss_scale must be one of"):
        make_train_step(_half_product(), loss_scale="static")
    with pytest.raises(ValueError, match="growth_interval"):
        make_train_step(_half_product(), loss_scale=LossScaling(growth_interval=0))


def test_master_weights_are_float32_and_merge_back_to_float16(tmp_path):
    from onnxgrad.training import (
        Checkpoint,
        generate_artifacts,
        load_train_step,
        merge_checkpoint,
        save_checkpoint,
    )

    rng = np.random.default_rng(3)
    model = _half_product(w=(rng.standard_normal(4) * 0.5).astype(np.float16))
    art = generate_artifacts(model, optimizer="adam", learning_rate=0.05, folder=tmp_path / "a")
    step = load_train_step(tmp_path / "a")
    assert art.checkpoint.weights["w"].dtype == np.float32
    assert art.checkpoint.optimizer_state["loss_scale"].tolist() == [2.0**16]
    run = _ort_run(step.model)
    values = {**art.checkpoint.weights, **art.checkpoint.optimizer_state}
    x = rng.standard_normal((16, 4)).astype(np.float32)
    target = x * np.array([1.0, -1.0, 0.5, 2.0], np.float32)
    losses = []
    for _ in range(40):
        feeds = {"x": x, "label": target, "learning_rate": np.array(0.05, np.float32)}
        loss, *new = run({**feeds, **values})
        values = dict(zip([*step.weights, *step.state], new))
        losses.append(float(loss))
    assert losses[-1] < 0.1 * losses[0]
    trained = Checkpoint({"w": values["w"]}, {s: values[s] for s in step.state})
    save_checkpoint(trained, tmp_path / "trained.json")
    merged = merge_checkpoint(tmp_path / "a", tmp_path / "trained.json")
    stored = numpy_helper.to_array(merged.graph.initializer[0])
    assert stored.dtype == np.float16
    np.testing.assert_array_equal(stored, values["w"].astype(np.float16))


def _finite_differences(model, feeds: dict, weights: dict, eps: float) -> dict:
    """Central differences of the summed squared error, the model run by onnxruntime with
    weights perturbed by ``eps`` (exact in float16 on the 2^-10 grid of the weights; the
    prediction model reads them as float32, cast to float16 exactly)."""
    from onnxgrad.training import make_predict_model

    run = _ort_run(make_predict_model(model, list(weights)))

    def loss(values):
        y = run({"x": feeds["x"], **{k: v.astype(np.float32) for k, v in values.items()}})[0]
        y = y.astype(np.float64)
        return float(np.sum((y - feeds["label"]) ** 2))

    result = {}
    for name, value in weights.items():
        gradient = np.zeros(value.shape)
        for index in np.ndindex(value.shape):
            shifted = []
            for sign in (1, -1):
                moved = value.copy()
                moved[index] += sign * eps
                assert float(moved[index]) == float(value[index]) + sign * eps
                shifted.append(loss({**weights, name: moved}))
            gradient[index] = (shifted[0] - shifted[1]) / (2 * eps)
        result[name] = gradient
    return result


def test_master_weight_gradients_agree_with_float16_and_float32_models():
    """The train step's gradient of a float16 model (master weights, float16 arithmetic in
    the reference evaluator, or as onnxruntime runs it) against central differences of the
    float16 model and against the float32 model's gradient."""
    from onnxgrad.training import SquareLearningLoss
    from onnxgrad.training.step.composition import loss_gradient, make_loss_model

    rng = np.random.default_rng(4)

    def grid(*shape):
        return (np.round(rng.standard_normal(shape) * 0.5 * 1024) / 1024).astype(np.float16)

    weights = {"w1": grid(6, 5), "b1": grid(5), "w2": grid(5, 2)}
    names = list(weights)
    feeds = {
        "x": rng.standard_normal((8, 6)).astype(np.float32),
        "label": rng.standard_normal((8, 2)).astype(np.float32),
    }
    half = cast_mlp_model(weights, TensorProto.FLOAT16)
    full = cast_mlp_model({k: v.astype(np.float32) for k, v in weights.items()}, TensorProto.FLOAT)

    def gradient(model, evaluate):
        lm = make_loss_model(model, SquareLearningLoss(), weights=names, label_name="label")
        graph = loss_gradient(lm)
        assert [i.type.tensor_type.elem_type for i in graph.graph.input if i.name in names] == [
            TensorProto.FLOAT
        ] * 3
        values = {**feeds, **{k: v.astype(np.float32) for k, v in weights.items()}}
        outputs = evaluate(graph)(values)
        return {k: np.asarray(v, np.float64) for k, v in zip(names, outputs)}

    def reference(graph):
        evaluator = ReferenceEvaluator(graph)
        return lambda values: evaluator.run(None, values)

    in_half = gradient(half, reference)
    by_ort = gradient(half, _ort_run)
    in_float32 = gradient(full, _ort_run)
    fd = _finite_differences(half, feeds, weights, eps=2.0**-8)
    for name in names:
        scale = np.abs(fd[name]).max()
        assert np.abs(in_half[name] - fd[name]).max() / scale < 5e-3, name  # 5.6e-4
        assert np.abs(by_ort[name] - fd[name]).max() / scale < 2e-4, name  # 1.9e-5
        assert np.abs(in_half[name] - in_float32[name]).max() / scale < 1e-2, name  # 5.5e-4


def test_estimator_trains_a_float16_model_on_master_weights():
    from onnxgrad.training import LearningRateSGD, OrtGradientForwardBackwardOptimizer

    rng = np.random.default_rng(5)
    model = cast_mlp_model(
        {
            "w1": (rng.standard_normal((6, 5)) * 0.5).astype(np.float16),
            "b1": np.zeros(5, np.float16),
            "w2": (rng.standard_normal((5, 2)) * 0.5).astype(np.float16),
        },
        TensorProto.FLOAT16,
    )
    x = rng.standard_normal((64, 6)).astype(np.float32)
    y = np.tanh(x[:, :2]).astype(np.float32)
    est = OrtGradientForwardBackwardOptimizer(
        model, max_iter=10, learning_rate=LearningRateSGD(eta0=5e-3), random_state=0
    )
    est.fit(x, y)
    assert est.train_losses_[-1] < 0.5 * est.train_losses_[0]
    assert est.runner_.step.state[-2:] == ("loss_scale", "loss_scale_growth")
    trained = est.get_trained_onnx()
    stored = {i.name: numpy_helper.to_array(i) for i in trained.graph.initializer}
    weights = est.runner_.get_weights()
    for name, value in weights.items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(stored[name], value.astype(np.float16))
    predicted = _ort_run(trained)({"x": x[:4]})[0]
    np.testing.assert_allclose(predicted, est.predict(x[:4]), atol=5e-3)
    est.set_params(loss_scale=None).fit(x, y)
    assert "loss_scale" not in est.runner_.step.state


@pytest.mark.parametrize("layout", ["per_weight", "flat"])
def test_training_runner_skips_a_non_finite_batch_in_its_buffers(layout):
    """The runner's ping-pong and in-place buffers keep a skipped step's weights and state."""
    from onnxgrad.training import OrtDataLoader, TrainingRunner, check_device

    step = make_train_step(
        _half_product(), learning_rate=LearningRateAdam(), layout=layout, loss_scale="dynamic"
    )
    runner = TrainingRunner(step, check_device("cpu"), {"w": np.full(4, 0.5, np.float32)})
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    finite = OrtDataLoader(x, np.zeros((6, 4), np.float32), batch_size=3, random_state=0)
    x_bad = x.copy()
    x_bad[:, 0] = np.inf
    bad = OrtDataLoader(x_bad, np.zeros((6, 4), np.float32), batch_size=3, random_state=0)
    runner.run_epoch(finite, 0.1)
    before = {**runner.get_weights(), **runner.get_state()}
    assert before["loss_scale_growth"].tolist() == [2]
    runner.run_epoch(bad, 0.1)
    after = {**runner.get_weights(), **runner.get_state()}
    for name in ("w", *step.state[:-2]):
        assert after[name].tobytes() == before[name].tobytes(), name
    assert after["loss_scale"].tolist() == [2.0**14]
    assert after["loss_scale_growth"].tolist() == [0]
    runner.run_epoch(finite, 0.1)
    assert not np.array_equal(runner.get_weights()["w"], before["w"])


def test_lora_on_a_model_with_float16_inputs_and_outputs(tmp_path):
    """float32 adapters and a float16 loss: the loss is cast to float32, the adapters' type."""
    from onnxgrad import add_lora
    from onnxgrad.training import generate_artifacts, load_train_step

    rng = np.random.default_rng(6)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "half_io",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [None, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [None, 3])],
        [numpy_helper.from_array((rng.standard_normal((8, 3)) * 0.5).astype(np.float16), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    art = generate_artifacts(add_lora(model, rank=2), learning_rate=0.05, folder=tmp_path)
    step = load_train_step(tmp_path)
    assert step.state[-2:] == ("loss_scale", "loss_scale_growth")
    run = _ort_run(step.model)
    values = {**art.checkpoint.weights, **art.checkpoint.optimizer_state}
    x = rng.standard_normal((16, 8)).astype(np.float16)
    target = (x @ rng.standard_normal((8, 3)).astype(np.float16)).astype(np.float16)
    losses = []
    for _ in range(30):
        feeds = {"x": x, "label": target, "learning_rate": np.array(0.05, np.float32)}
        loss, *new = run({**feeds, **values})
        values = dict(zip([*step.weights, *step.state], new))
        losses.append(loss)
    assert losses[0].dtype == np.float32
    assert losses[-1] < 0.8 * losses[0]
