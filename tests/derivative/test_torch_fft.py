"""A spectral filter exported by torch's dynamo exporter (``torch.fft.rfft``, then
``irfft`` along the same axis and along another one, of odd length): the native gradient of
its loss and ``onnx_hvp`` against torch's float64 autograd at the same point. The exporter
feeds DFT's axis as an input and emits the real inverse of half a spectrum (irfft), the two
forms the DFT rule once refused. Run by onnx's reference evaluator (onnxruntime before 1.20
refuses ``inverse`` with ``onesided``)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import DerivativeOptions, onnx_derivative, onnx_hvp

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow


class SpectralFilter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(5, 16))

    def forward(self, x):
        spectrum = torch.fft.rfft(x * self.w, dim=-1)
        filtered = spectrum * torch.linspace(1.0, 0.2, spectrum.shape[-1])
        y = torch.fft.irfft(filtered, n=16, dim=-1)
        z = torch.fft.irfft(spectrum, n=9, dim=1)
        return (y.sin() ** 2).sum() + (z * z).sum()


@pytest.fixture(scope="module")
def exported():
    torch.manual_seed(0)
    module, x = SpectralFilter(), torch.randn(3, 5, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.onnx.export(module, (x,), dynamo=True).model_proto
    return module.double(), x.double(), model


def _run(model, feeds):
    names = {i.name for i in model.graph.input}
    outputs = ReferenceEvaluator(model).run(None, {k: v for k, v in feeds.items() if k in names})
    return dict(zip([o.name for o in model.graph.output], outputs))


def test_gradient_equals_torch(exported):
    module, x, model = exported
    (weight,) = [i for i in model.graph.initializer if list(i.dims) == [5, 16]]
    gradient = onnx_derivative(
        model, weights=[weight.name], inputs=["x"], options=DerivativeOptions.Loss
    )
    feeds = {"x": x.float().numpy(), weight.name: numpy_helper.to_array(weight)}
    got = _run(gradient, feeds)
    xx = x.clone().requires_grad_(True)
    module(xx).backward()
    for name, expected in (("x", xx.grad), (weight.name, module.w.grad)):
        expected = expected.numpy()
        np.testing.assert_allclose(
            got[f"{name}_grad"], expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max()
        )


def test_hvp_equals_torch(exported):
    module, x, model = exported
    tangent = torch.randn_like(x)
    _, expected = torch.autograd.functional.hvp(module, x, tangent)
    hvp = onnx_hvp(model, inputs=["x"])
    feeds = {"x": x.float().numpy(), "x_tangent": tangent.float().numpy()}
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    got = _run(hvp, {**weights, **feeds})["x_grad_tangent"]
    expected = expected.numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
