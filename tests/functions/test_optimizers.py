"""Update graphs chained over several steps against scikit-learn's and PyTorch's optimizers."""

from __future__ import annotations

import numpy as np
import pytest

from onnxgrad.functions import function_onnx_graph
from tests.functions.runtimes import RUNTIMES, run_onnxruntime

STEPS = 5


def _gradients(rng, shape, dtype) -> list[np.ndarray]:
    return [rng.standard_normal(shape).astype(dtype) for _ in range(STEPS)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("name", "nesterov"), [("axpyw", False), ("axpyw2", True)])
def test_momentum_steps_match_scikit_learn(name, nesterov, dtype, rng):
    from sklearn.neural_network._stochastic_optimizers import SGDOptimizer

    lr, momentum = 0.05, 0.9
    weight = rng.standard_normal((3, 4)).astype(dtype)
    grads = _gradients(rng, weight.shape, dtype)
    sklearn_weight = weight.copy()
    optimizer = SGDOptimizer(
        [sklearn_weight], learning_rate_init=lr, momentum=momentum, nesterov=nesterov
    )
    model = function_onnx_graph(name, dtype=dtype)
    velocity = np.zeros_like(weight)
    for grad in grads:
        optimizer.update_params([sklearn_weight], [grad])
        out = run_onnxruntime(
            model,
            {
                "X1": grad,
                "X2": weight,
                "G": velocity,
                "alpha": np.array([-lr], dtype=dtype),
                "beta": np.array([momentum], dtype=dtype),
            },
        )
        weight, velocity = out["Y"], out["Z"]
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(weight, sklearn_weight, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(velocity, optimizer.velocities[0], rtol=rtol, atol=rtol)


@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_adam_steps_match_pytorch(dtype, runtime, rng):
    torch = pytest.importorskip("torch")
    lr, beta1, beta2, eps = 0.01, 0.8, 0.95, 1e-6
    weight = rng.standard_normal((3, 4)).astype(dtype)
    grads = _gradients(rng, weight.shape, dtype)
    parameter = torch.nn.Parameter(torch.tensor(weight.astype(np.float64)))
    optimizer = torch.optim.Adam([parameter], lr=lr, betas=(beta1, beta2), eps=eps)
    model = function_onnx_graph("adam", dtype=dtype)
    moment1, moment2 = np.zeros_like(weight), np.zeros_like(weight)
    hyper = {
        "alpha": np.array([lr], dtype=dtype),
        "beta1": np.array([beta1], dtype=dtype),
        "beta2": np.array([beta2], dtype=dtype),
        "epsilon": np.array([eps], dtype=dtype),
    }
    for step, grad in enumerate(grads, start=1):
        parameter.grad = torch.tensor(grad.astype(np.float64))
        optimizer.step()
        feeds = {"X": weight, "G": grad, "M": moment1, "V": moment2, **hyper}
        out = RUNTIMES[runtime](model, {**feeds, "t": np.array([step], dtype=np.int64)})
        weight, moment1, moment2 = out["Y"], out["M_new"], out["V_new"]
    state = optimizer.state[parameter]
    rtol = 1e-5 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(weight, parameter.detach().numpy(), rtol=rtol, atol=rtol)
    np.testing.assert_allclose(moment1, state["exp_avg"].numpy(), rtol=rtol, atol=rtol)
    np.testing.assert_allclose(moment2, state["exp_avg_sq"].numpy(), rtol=rtol, atol=rtol)
