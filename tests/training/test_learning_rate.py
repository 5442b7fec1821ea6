"""Schedules against scikit-learn, updates against scikit-learn's and torch's optimizers."""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
import pytest
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import SGDRegressor
from sklearn.neural_network._stochastic_optimizers import SGDOptimizer

from onnxgrad.training import (
    LearningRateAdam,
    LearningRateSGD,
    LearningRateSGDNesterov,
    OrtDataLoader,
    SquareLearningLoss,
    TrainingRunner,
    check_device,
    learning_rate_from_name,
    make_train_step,
)
from onnxgrad.training.step.learning_rate import LEARNING_RATE_NAMES, select_learning_rate
from tests.models import linear_regression_model

#: the references below are gradients of the mean squared error
MEAN = SquareLearningLoss(reduction="mean")


def sklearn_sgd_rates(schedule: str, n: int, **params) -> np.ndarray:
    """The learning rate SGDRegressor used for each of its first ``n`` samples, recovered
    from its updates ``w <- w - eta (w x - y) x`` (one feature, no intercept, no penalty)."""
    rng = np.random.default_rng(0)
    x = rng.uniform(0.01, 0.03, n)
    y = rng.uniform(-1, 1, n)
    sgd = SGDRegressor(
        learning_rate=schedule,
        penalty=None,
        fit_intercept=False,
        shuffle=False,
        max_iter=1,
        tol=None,
        **params,
    )
    w = 0.3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        sgd.fit(x[:1, None], y[:1], coef_init=np.array([w]))
    rates = []
    for i in range(n):
        if i:
            sgd.partial_fit(x[i : i + 1, None], y[i : i + 1])
        new = float(sgd.coef_[0])
        rates.append((w - new) / ((w * x[i] - y[i]) * x[i]))
        w = new
    return np.array(rates)


@pytest.mark.parametrize(
    ("schedule", "params"),
    [
        ("constant", {"eta0": 0.05}),
        ("invscaling", {"eta0": 0.05, "power_t": 0.25}),
        ("invscaling", {"eta0": 0.02, "power_t": 0.5}),
        ("optimal", {"alpha": 0.01}),
        ("optimal", {"alpha": 0.0001}),
    ],
)
def test_schedules_equal_sgdregressor(schedule, params):
    """'optimal' with ``eta0 = typw`` (scikit-learn ignores eta0 there) is scikit-learn's."""
    expected = sklearn_sgd_rates(schedule, 20, **params)
    if schedule == "optimal":
        params = {**params, "eta0": LearningRateSGD.sklearn_eta0(params["alpha"])}
    lr = LearningRateSGD(learning_rate=schedule, **params).init_learning_rate()
    got = [lr.update_learning_rate(t).value for t in range(20)]
    np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.parametrize("alpha", [0.01, 0.0001])
def test_optimal_starts_at_eta0_with_scikit_learn_decay(alpha):
    """The seeds' 'optimal': scikit-learn's 1 / (alpha (t + t0)) scaled to start at eta0, so
    an eta0 of 0.01 never becomes sqrt(1 / sqrt(alpha)) (10 for alpha=1e-4)."""
    expected = sklearn_sgd_rates("optimal", 20, alpha=alpha)
    lr = LearningRateSGD(eta0=0.01, alpha=alpha, learning_rate="optimal")
    got = np.array(list(lr.loop(20)))
    assert got[0] == pytest.approx(0.01)
    np.testing.assert_allclose(got / got[0], expected / expected[0], rtol=1e-6)


def test_loop_yields_the_schedule():
    lr = LearningRateSGD(eta0=0.1, power_t=0.5)
    np.testing.assert_allclose(list(lr.loop(4)), [0.1 / np.sqrt(t + 1) for t in range(4)])


@pytest.mark.parametrize("schedule", ["constant", "invscaling"])
def test_schedules_equal_mlp_sgd_optimizer(schedule):
    reference = SGDOptimizer(
        [np.zeros(1)], learning_rate_init=0.1, lr_schedule=schedule, power_t=0.5
    )
    lr = LearningRateSGDNesterov(eta0=0.1, learning_rate=schedule, power_t=0.5)
    lr.init_learning_rate()
    assert lr.value == pytest.approx(reference.learning_rate)
    for samples_seen in (15, 750, 1500, 75000):
        reference.iteration_ends(samples_seen)
        assert lr.update_learning_rate(samples_seen).value == pytest.approx(
            reference.learning_rate, rel=1e-12
        )


def linear_problem(n=12, features=3, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, features)).astype(np.float32)
    y = (X @ rng.standard_normal((features, 1)) + 0.5).astype(np.float32)
    coef = rng.standard_normal((1, features)) * 0.1
    model = linear_regression_model(coef, np.array([0.2]))
    weights = {"coefs": coef.T.astype(np.float32), "intercept": np.array([0.2], np.float32)}
    return model, X, y, weights


def mse_gradients(X, y, weights):
    """Gradients of mean_i (x_i W + b - y_i)^2 in float64."""
    residual = X.astype(np.float64) @ weights["coefs"] + weights["intercept"] - y
    return {
        "coefs": 2 * X.T.astype(np.float64) @ residual / len(X),
        "intercept": 2 * residual.sum(axis=0) / len(X),
    }


def run_steps(step, X, y, weights, lr, n_steps):
    """Feed the step graph its own outputs ``n_steps`` times; returns the weights and the
    optimizer state by weight."""
    session = ort.InferenceSession(
        step.model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    state = step.initial_state()
    values = dict(weights)
    for _ in range(n_steps):
        feeds = {"X": X, step.label: y, step.learning_rate: np.array(lr, np.float32)}
        feeds.update(step.weight_inputs(values))
        feeds.update(state)
        outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        values = step.unpack_weights(outputs)
        state = {s: outputs[n] for s, n in zip(step.state, step.new_state)}
    return values, step.state_by_weight(state)


@pytest.mark.parametrize("layout", ["per_weight", "flat"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_equals_sklearn_sgd_optimizer(nesterov, layout):
    model, X, y, weights = linear_problem()
    lr = LearningRateSGDNesterov(momentum=0.8, nesterov=nesterov)
    step = make_train_step(model, loss=MEAN, learning_rate=lr, layout=layout)
    got, state = run_steps(step, X, y, weights, 0.05, 6)

    params = [weights["coefs"].astype(np.float64), weights["intercept"].astype(np.float64)]
    reference = SGDOptimizer(
        params, learning_rate_init=0.05, lr_schedule="constant", momentum=0.8, nesterov=nesterov
    )
    for _ in range(6):
        grads = mse_gradients(X, y, {"coefs": params[0], "intercept": params[1]})
        reference.update_params(params, [grads["coefs"], grads["intercept"]])
    np.testing.assert_allclose(got["coefs"], params[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["intercept"], params[1], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state["coefs_velocity"], reference.velocities[0], atol=1e-5)


@pytest.mark.parametrize("layout", ["per_weight", "flat"])
def test_sgd_equals_numpy(layout):
    model, X, y, weights = linear_problem()
    step = make_train_step(model, loss=MEAN, learning_rate=LearningRateSGD(), layout=layout)
    got, state = run_steps(step, X, y, weights, 0.1, 5)
    expected = {k: v.astype(np.float64) for k, v in weights.items()}
    for _ in range(5):
        grads = mse_gradients(X, y, expected)
        expected = {k: expected[k] - 0.1 * grads[k] for k in expected}
    assert state == {}
    for name in weights:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["per_weight", "flat"])
def test_adam_equals_torch(layout):
    torch = pytest.importorskip("torch")
    model, X, y, weights = linear_problem()
    lr = LearningRateAdam(beta1=0.8, beta2=0.95, epsilon=1e-6)
    step = make_train_step(model, loss=MEAN, learning_rate=lr, layout=layout)
    got, state = run_steps(step, X, y, weights, 0.03, 7)

    params = {
        k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in weights.items()
    }
    adam = torch.optim.Adam(params.values(), lr=0.03, betas=(0.8, 0.95), eps=1e-6)
    for _ in range(7):
        grads = mse_gradients(X, y, {k: v.detach().numpy() for k, v in params.items()})
        for name, p in params.items():
            p.grad = torch.from_numpy(grads[name])
        adam.step()
    for name in weights:
        np.testing.assert_allclose(got[name], params[name].detach().numpy(), rtol=1e-4, atol=1e-6)
    assert state["step"].tolist() == [7]


@pytest.mark.parametrize("layout", ["per_weight", "flat"])
def test_runner_ping_pong_equals_numpy_over_epochs(layout):
    """Three batches an epoch (an odd number: the buffers swap roles between epochs)."""
    model, X, y, weights = linear_problem(n=10)
    lr = LearningRateSGDNesterov(momentum=0.9)
    step = make_train_step(model, loss=MEAN, learning_rate=lr, layout=layout)
    runner = TrainingRunner(step, check_device("cpu"), weights)
    loader = OrtDataLoader(X, y, batch_size=4, random_state=7)

    order = np.random.default_rng(7)
    expected = {k: v.astype(np.float64) for k, v in weights.items()}
    velocity = {k: np.zeros_like(v) for k, v in expected.items()}
    for epoch in range(3):
        losses = runner.run_epoch(loader, 0.01 * (epoch + 1))
        permutation = order.permutation(len(X))
        expected_losses = []
        for start in range(0, len(X), 4):
            rows = permutation[start : start + 4]
            residual = X[rows] @ expected["coefs"] + expected["intercept"] - y[rows]
            expected_losses.append((residual**2).mean())
            grads = mse_gradients(X[rows], y[rows], expected)
            for k in expected:
                velocity[k] = 0.9 * velocity[k] - 0.01 * (epoch + 1) * grads[k]
                expected[k] = expected[k] + 0.9 * velocity[k] - 0.01 * (epoch + 1) * grads[k]
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-4)
    got = runner.get_weights()
    for k in expected:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-4, atol=1e-6)
    state = step.state_by_weight(runner.get_state())
    np.testing.assert_allclose(state["coefs_velocity"], velocity["coefs"], rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0.5, LearningRateSGD(eta0=0.5)),
        ("SGD", LearningRateSGD()),
        ("nesterov", LearningRateSGDNesterov()),
        ("Momentum", LearningRateSGDNesterov(nesterov=False)),
        ("Adam", LearningRateAdam()),
    ],
)
def test_select_learning_rate(value, expected):
    selected = select_learning_rate(value)
    assert type(selected) is type(expected)
    assert selected.get_params() == expected.get_params()


def test_select_learning_rate_copies_objects():
    original = LearningRateSGDNesterov(eta0=0.3)
    copy = select_learning_rate(original)
    assert copy is not original and copy.get_params() == original.get_params()


@pytest.mark.parametrize(
    ("optimizer", "message"),
    [
        # set after construction (set_params): the check at fit names it too
        (
            LearningRateSGD().set_params(learning_rate="adaptive"),
            "unknown learning_rate schedule 'adaptive'",
        ),
        (LearningRateSGD(eta0=-1.0), "eta0 must be > 0"),
        (LearningRateSGDNesterov(momentum=1.5), "momentum must be in"),
        (LearningRateAdam(beta2=1.0), "beta2 must be in"),
    ],
)
def test_bad_hyper_parameters(optimizer, message):
    with pytest.raises(ValueError, match=message):
        optimizer.init_learning_rate()


def test_unknown_learning_rate_name():
    with pytest.raises(ValueError, match="unknown learning_rate 'rmsprop'"):
        select_learning_rate("rmsprop")
    with pytest.raises(TypeError, match="learning_rate must be"):
        select_learning_rate([0.1])


def test_state_moves_between_layouts():
    """A run continued in the other layout, its state converted by weight name, ends where
    a run in one layout ends."""
    model, X, y, weights = linear_problem(n=10)
    lr = LearningRateAdam(eta0=0.05)
    flat = make_train_step(model, learning_rate=lr, layout="flat")
    per_weight = make_train_step(model, learning_rate=lr, layout="per_weight")
    cpu = check_device("cpu")

    reference = TrainingRunner(flat, cpu, weights)
    first = TrainingRunner(flat, cpu, weights)
    loader_ref = OrtDataLoader(X, y, batch_size=4, random_state=1)
    loader = OrtDataLoader(X, y, batch_size=4, random_state=1)
    for _ in range(4):
        reference.run_epoch(loader_ref, 0.05)
    for _ in range(2):
        first.run_epoch(loader, 0.05)
    state = per_weight.state_inputs(flat.state_by_weight(first.get_state()))
    second = TrainingRunner(per_weight, cpu, first.get_weights(), state)
    for _ in range(2):
        second.run_epoch(loader, 0.05)
    for name, value in reference.get_weights().items():
        np.testing.assert_allclose(second.get_weights()[name], value, rtol=1e-5, atol=1e-7)
    expected = flat.state_by_weight(reference.get_state())
    for name, value in per_weight.state_by_weight(second.get_state()).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("SGD", 0.05, "constant"), LearningRateSGD(eta0=0.05, learning_rate="constant")),
        (("nesterov",), LearningRateSGDNesterov()),
        (("Momentum", 0.2), LearningRateSGDNesterov(eta0=0.2, nesterov=False)),
        (("adam", 0.003, "constant"), LearningRateAdam(eta0=0.003)),
    ],
)
def test_learning_rate_from_name(args, expected):
    selected = learning_rate_from_name(*args)
    assert type(selected) is type(expected)
    assert selected.get_params() == expected.get_params()
    assert args[0].lower() in LEARNING_RATE_NAMES


def test_learning_rate_from_name_errors():
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'"):
        learning_rate_from_name("rmsprop")
    with pytest.raises(ValueError, match="eta0 must be > 0"):
        learning_rate_from_name("sgd", -1.0)
    with pytest.raises(ValueError, match="no schedule 'optimal'"):
        learning_rate_from_name("adam", schedule="optimal")
    with pytest.raises(ValueError, match="unknown learning_rate schedule 'adaptive'"):
        learning_rate_from_name("nesterov", schedule="adaptive")
