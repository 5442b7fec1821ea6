"""Forward mode on torch exports that broke it (issue 33): a transformers Llama (eager
attention: a Softmax in every layer) and a bidirectional 2-layer LSTM, ``onnx_jvp`` against
torch's own JVP (``torch.autograd.functional.jvp``, double-backward) at the same point."""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime
import pytest

from onnxgrad import onnx_jvp

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow


def _llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False, attn_implementation="eager",
    )  # fmt: skip
    inner = transformers.LlamaForCausalLM(config).eval()

    class Embedded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, embeddings):
            return self.inner(inputs_embeds=embeddings).logits

    return Embedded(), torch.randn(1, 5, 32), True


def _lstm():
    class Recurrent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.LSTM(3, 5, num_layers=2, bidirectional=True, batch_first=True)

        def forward(self, x):
            return self.rnn(x)[0]

    return Recurrent().eval(), torch.randn(2, 4, 3), False


@pytest.mark.parametrize("make", [_llama, _lstm], ids=["llama", "lstm"])
def test_jvp_equals_torch(make):
    torch.manual_seed(0)
    module, x, dynamo = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            model = torch.onnx.export(module, (x,), dynamo=True).model_proto
        else:
            import io

            import onnx

            buffer = io.BytesIO()
            torch.onnx.export(module, (x,), buffer, input_names=["x"], dynamo=False)
            model = onnx.load_from_string(buffer.getvalue())
    name = model.graph.input[0].name
    tangent = torch.randn_like(x)
    _, expected = torch.autograd.functional.jvp(module, (x,), (tangent,))
    jvp = onnx_jvp(model, inputs=[name])
    session = onnxruntime.InferenceSession(
        jvp.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    (got,) = session.run(None, {name: x.numpy(), f"{name}_tangent": tangent.numpy()})
    expected = expected.detach().numpy()
    assert np.abs(expected).max() > 1e-3
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
