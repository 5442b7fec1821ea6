"""Native gradients of networks exported by ``torch.onnx.export`` equal torch.autograd.

For a network ``y = f(x; theta)`` and a random output gradient ``g``, the native gradient
graph (``DerivativeOptions.Zero``) must return ``x.grad`` and every ``theta.grad`` of
``(f(x) * g).sum().backward()``.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnxruntime
import pytest

from onnxgrad import onnx_derivative

torch = pytest.importorskip("torch")
nn = torch.nn


class ConvNet2d(nn.Module):
    """Grouped, depthwise and transposed convolutions, batch norm, max pooling, PReLU."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1, groups=2)
        self.depthwise = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.PReLU(8)
        self.pool = nn.MaxPool2d(2, ceil_mode=True)
        self.up = nn.ConvTranspose2d(8, 3, 3, stride=2, padding=1, output_padding=1)

    def forward(self, x):
        h = self.pool(self.act(self.bn(self.depthwise(self.conv(x)))))
        return torch.tanh(self.up(h))


class PoolNet(nn.Module):
    """1-D, 2-D and 3-D average pooling with padding, ELU / SELU / Softplus."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(3, 4, 3)
        self.pool1 = nn.AvgPool1d(2, padding=1, count_include_pad=False)
        self.conv3 = nn.Conv3d(2, 2, 2)
        self.pool3 = nn.AvgPool3d(2, ceil_mode=True)

    def forward(self, x1, x3):
        a = nn.functional.elu(self.pool1(self.conv1(x1)))
        b = nn.functional.selu(self.pool3(self.conv3(x3)))
        return nn.functional.softplus(a).sum(-1), b.flatten(1)


class Attention(nn.Module):
    """Single-head self-attention block with layer norm and GELU feed-forward."""

    def __init__(self, d=8):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 16), nn.GELU(), nn.Linear(16, d))
        self.scale = d**-0.5

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        weights = torch.softmax(q @ k.transpose(-2, -1) * self.scale, dim=-1)
        h = self.norm(x + weights @ v)
        return h + self.ff(h)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 8), nn.Sigmoid(), nn.Linear(8, 2)
        )

    def forward(self, x):
        return torch.log_softmax(self.net(x), dim=-1)


NETWORKS = {
    "convnet2d": (ConvNet2d, [(2, 4, 9, 9)]),
    "pooling-1d-3d": (PoolNet, [(2, 3, 9), (1, 2, 5, 5, 5)]),
    "attention": (Attention, [(2, 5, 8)]),
    "mlp": (Mlp, [(4, 5)]),
}


def export(module, inputs, dynamo: bool, opset: int = 17) -> onnx.ModelProto:
    names = [f"x{i}" for i in range(len(inputs))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            program = torch.onnx.export(module, tuple(inputs), input_names=names, dynamo=True)
            return program.model_proto
        buffer = io.BytesIO()
        torch.onnx.export(
            module, tuple(inputs), buffer, input_names=names, dynamo=False,
            opset_version=opset, do_constant_folding=False,
        )  # fmt: skip
        return onnx.load_from_string(buffer.getvalue())


def torch_gradients(module, inputs, out_grads):
    inputs = [t.clone().requires_grad_(True) for t in inputs]
    module.zero_grad()
    outputs = module(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    total = sum((o * g).sum() for o, g in zip(outputs, out_grads))
    total.backward()
    grads = {f"x{i}": t.grad.numpy() for i, t in enumerate(inputs)}
    grads.update({name: p.grad.numpy() for name, p in module.named_parameters()})
    return [o.detach().numpy() for o in outputs], grads


@pytest.mark.parametrize(
    ("dynamo", "opset"),
    [(False, 11), (False, 17), (True, 18)],
    ids=["torchscript-opset11", "torchscript-opset17", "dynamo"],
)
@pytest.mark.parametrize("name", sorted(NETWORKS))
def test_native_gradient_equals_torch_autograd(name, dynamo, opset):
    torch.manual_seed(0)
    factory, shapes = NETWORKS[name]
    module = factory().eval()
    if hasattr(module, "bn"):
        module.bn.running_mean.uniform_(-0.5, 0.5)
        module.bn.running_var.uniform_(0.5, 2.0)
    inputs = [torch.randn(*s) for s in shapes]
    model = export(module, inputs, dynamo, opset)
    with torch.no_grad():
        outputs = module(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    out_grads = [torch.randn_like(o) for o in outputs]
    _, expected = torch_gradients(module, inputs, out_grads)

    parameters = dict(module.named_parameters())
    weights = [
        i.name
        for i in model.graph.initializer
        if i.name in parameters
        and np.array_equal(onnx.numpy_helper.to_array(i), parameters[i.name].detach().numpy())
    ]  # an exporter may fold BatchNormalization into a conv weight and keep its name
    grad_model = onnx_derivative(model, weights=weights)
    assert {n.domain for n in grad_model.graph.node} <= {""}
    feeds = {f"x{i}": t.numpy() for i, t in enumerate(inputs)}
    feeds.update({f"{o.name}_grad": g.numpy() for o, g in zip(model.graph.output, out_grads)})
    feeds.update(
        {
            i.name: onnx.numpy_helper.to_array(i)
            for i in model.graph.initializer
            if i.name in weights
        }
    )
    session = onnxruntime.InferenceSession(
        grad_model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    checked = [n for n in expected if f"{n}_grad" in got]
    assert len(checked) >= len(expected) // 2, f"too few weights kept their values: {checked}"
    for key in checked:
        np.testing.assert_allclose(
            got[f"{key}_grad"], expected[key], rtol=2e-4, atol=2e-5, err_msg=f"{name}: {key}"
        )


class TinyTransformer(nn.Module):
    """RMSNorm, causal scaled-dot-product attention (2 heads), SiLU feed-forward: exported at
    opset 23, torch emits the Attention and RMSNormalization operators."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 16), nn.SiLU(), nn.Linear(16, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        return x + self.ff(self.norm2(x))


def test_tiny_transformer_at_the_newest_opset_equals_torch_autograd():
    """The gradient goes through the function bodies of Attention and RMSNormalization; it
    runs on onnx's reference evaluator (onnxruntime-training 1.19 stops at opset 21)."""
    from onnx.reference import ReferenceEvaluator

    torch.manual_seed(0)
    module = TinyTransformer().eval()
    with torch.no_grad():  # distinct scales, so the exporter cannot merge the two into one
        module.norm1.weight.uniform_(0.5, 1.5)
        module.norm2.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.onnx.export(
            module, (x,), input_names=["x0"], dynamo=True, opset_version=23
        ).model_proto
    assert {"Attention", "RMSNormalization"} <= {n.op_type for n in model.graph.node}
    with torch.no_grad():
        g = torch.randn_like(module(x))
    _, expected = torch_gradients(module, [x], [g])
    parameters = dict(module.named_parameters())
    weights = [
        i.name
        for i in model.graph.initializer
        if i.name in parameters
        and np.array_equal(onnx.numpy_helper.to_array(i), parameters[i.name].detach().numpy())
    ]
    assert {"norm1.weight", "norm2.weight", "qkv.bias"} <= set(weights)
    grad_model = onnx_derivative(model, weights=weights)
    assert {n.domain for n in grad_model.graph.node} <= {""}
    feeds = {"x0": x.numpy(), f"{model.graph.output[0].name}_grad": g.numpy()}
    feeds.update(
        {
            i.name: onnx.numpy_helper.to_array(i)
            for i in model.graph.initializer
            if i.name in weights
        }
    )
    outputs = ReferenceEvaluator(grad_model).run(None, feeds)
    got = dict(zip([o.name for o in grad_model.graph.output], outputs))
    for key in ["x0", *weights]:
        np.testing.assert_allclose(got[f"{key}_grad"], expected[key], rtol=2e-4, atol=2e-5)
