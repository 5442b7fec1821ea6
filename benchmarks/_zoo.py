"""Benchmark models: torchvision-style resnet18 and squeezenet1_1, a tiny BERT, a tiny Llama.

torchvision is not a dependency: resnet18 and squeezenet1_1 are written here with the same
layers as torchvision's definitions (random weights). The transformers models use small
configurations with random weights; nothing is downloaded. Each model is exported by the
TorchScript exporter (``dynamo=False``) and by the dynamo exporter, in evaluation mode.
"""

from __future__ import annotations

import io
import warnings

import onnx


def _torch():
    import torch

    return torch


def resnet18(num_classes: int = 1000):
    """torchvision's resnet18 (BasicBlock x [2, 2, 2, 2])."""
    nn = _torch().nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )

        def forward(self, x):
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return self.relu(out + identity)

    layers = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(1), nn.Linear(512, num_classes)]
    return nn.Sequential(*layers)


def squeezenet1_1(num_classes: int = 1000):
    """torchvision's squeezenet1_1."""
    torch = _torch()
    nn = torch.nn

    class Fire(nn.Module):
        def __init__(self, cin, squeeze, e1, e3):
            super().__init__()
            self.squeeze = nn.Sequential(nn.Conv2d(cin, squeeze, 1), nn.ReLU(inplace=True))
            self.e1 = nn.Sequential(nn.Conv2d(squeeze, e1, 1), nn.ReLU(inplace=True))
            self.e3 = nn.Sequential(nn.Conv2d(squeeze, e3, 3, padding=1), nn.ReLU(inplace=True))

        def forward(self, x):
            x = self.squeeze(x)
            return torch.cat([self.e1(x), self.e3(x)], 1)

    return nn.Sequential(
        nn.Conv2d(3, 64, 3, 2),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, ceil_mode=True),
        Fire(64, 16, 64, 64),
        Fire(128, 16, 64, 64),
        nn.MaxPool2d(3, 2, ceil_mode=True),
        Fire(128, 32, 128, 128),
        Fire(256, 32, 128, 128),
        nn.MaxPool2d(3, 2, ceil_mode=True),
        Fire(256, 48, 192, 192),
        Fire(384, 48, 192, 192),
        Fire(384, 64, 256, 256),
        Fire(512, 64, 256, 256),
        nn.Dropout(0.5),
        nn.Conv2d(512, num_classes, 1),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(1),
    )


class _LogitsOnly:
    """Wraps a transformers model so that the export has one output, the logits."""

    def __new__(cls, model):
        nn = _torch().nn

        class Wrapper(nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, input_ids):
                return self.inner(input_ids=input_ids).logits

        return Wrapper(model)


def tiny_bert(vocab: int = 1000):
    """BertForSequenceClassification: 2 layers, hidden 64, 2 heads, random weights."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        num_labels=4,
        attn_implementation="eager",
    )
    return _LogitsOnly(BertForSequenceClassification(config))


def tiny_llama(vocab: int = 1000):
    """LlamaForCausalLM: 2 layers, hidden 64, 4 heads (2 key-value heads), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        attn_implementation="eager",
    )
    return _LogitsOnly(LlamaForCausalLM(config))


def export(module, example, dynamo: bool, opset: int = 18) -> onnx.ModelProto:
    """Export ``module`` (evaluation mode) with a dynamic batch axis; weights as initializers."""
    torch = _torch()
    module = module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            batch = torch.export.Dim("batch", min=1)
            program = torch.onnx.export(
                module,
                (example,),
                dynamo=True,
                opset_version=opset,
                dynamic_shapes=({0: batch},),
                input_names=["x"],
                output_names=["y"],
                verbose=False,
            )
            return program.model_proto
        buffer = io.BytesIO()
        torch.onnx.export(
            module,
            (example,),
            buffer,
            dynamo=False,
            opset_version=opset,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
            verbose=False,
        )
        return onnx.load_from_string(buffer.getvalue())


def benchmark_models(image: int = 64, batch: int = 4, tokens: int = 16):
    """``[(name, exporter, model, feeds)]`` for every model of the set (needs torch)."""
    torch = _torch()
    torch.manual_seed(0)
    image_input = torch.randn(batch, 3, image, image)
    ids = torch.randint(0, 1000, (batch, tokens))
    specs = [
        ("resnet18", resnet18, image_input),
        ("squeezenet1_1", squeezenet1_1, image_input),
        ("tiny-bert", tiny_bert, ids),
        ("tiny-llama", tiny_llama, ids),
    ]
    result = []
    for name, factory, example in specs:
        torch.manual_seed(0)
        module = factory()
        for dynamo in (False, True):
            exporter = "dynamo" if dynamo else "torchscript"
            try:
                model = export(module, example, dynamo)
            except Exception as exc:  # an exporter failure is a benchmark row, not a crash
                result.append((name, exporter, exc, None))
                continue
            result.append((name, exporter, model, {"x": example.numpy()}))
    return result
