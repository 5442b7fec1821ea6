"""A classifier fine-tuned with LoRA from its deployed int8 form (``quantize_dynamic``)
reaches the held-out accuracy of the same fine-tuning from its float32 form within 0.02.

The classifier is an MLP trained by torch on scikit-learn's handwritten digits, then
fine-tuned on the digits transposed (a domain shift its accuracy drops on): same adapters
(rank, seed), optimizer, learning rate, steps and data for both forms, trained by
``generate_artifacts`` and plain onnxruntime steps, scored by onnxruntime running the
merged checkpoint."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")
datasets = pytest.importorskip("sklearn.datasets")

HIDDEN, RANK, STEPS, LR = 64, 4, 120, 0.01


def _digits():
    """``(x_train, x_test, y_train, y_test)``: 1,100 training and 697 held-out images."""
    from sklearn.model_selection import train_test_split

    x, y = datasets.load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return train_test_split(x, y, train_size=1100, random_state=0, stratify=y)


def _transposed(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.reshape(-1, 8, 8).transpose(0, 2, 1).reshape(-1, 64))


class _MLP(torch.nn.Module):
    """``relu(relu(x W1 + b1) W2 + b2) W3 + b3``, written with ``matmul`` so that the export
    has ``MatMul`` nodes (``quantize_dynamic`` quantizes those, not ``Gemm``)."""

    def __init__(self):
        super().__init__()
        sizes = [(64, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, 10)]
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(k, n) / k**0.5) for k, n in sizes
        )
        self.biases = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(n)) for _, n in sizes)

    def forward(self, x):
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            x = torch.matmul(x, w) + b
            if i < len(self.weights) - 1:
                x = torch.relu(x)
        return x


def _pretrained(path, x, y) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _trained_and_exported(path, x, y)
    finally:
        torch.set_num_threads(threads)


def _trained_and_exported(path, x, y) -> None:
    torch.manual_seed(0)
    model = _MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    inputs, labels = torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(200):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model.eval(),
            (inputs[:2],),
            str(path),
            input_names=["x"],
            output_names=["logits"],
            opset_version=17,
            dynamo=False,
            dynamic_axes={"x": {0: "batch"}},
        )


def _accuracy(model, x, y) -> float:
    from tests.normalize.kernels import run

    return float((run(model, {"x": x})[0].argmax(axis=1) == y).mean())


def _fine_tuned(path, x, y, folder) -> onnx.ModelProto:
    """LoRA fine-tuning of the file at ``path`` on ``(x, y)``: full-batch Adam steps run by
    onnxruntime, the checkpoint merged (the int8 form's adapters kept over its weights)."""
    import onnxruntime as ort

    from onnxgrad import add_lora
    from onnxgrad.training import (
        Checkpoint,
        generate_artifacts,
        load_train_step,
        merge_checkpoint,
        save_checkpoint,
    )

    adapted = add_lora(onnx.load(path), rank=RANK, seed=0)
    art = generate_artifacts(
        adapted, loss="cross_entropy_logits", optimizer="adam", artifact_directory=folder
    )
    step = load_train_step(folder)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(
        str(art.path("training_model.onnx")), options, providers=["CPUExecutionProvider"]
    )
    label = next(i for i in session.get_inputs() if i.name == "label")
    labels = y.astype(np.int64).reshape([-1] + [1] * (len(label.shape) - 1))
    values = {**art.checkpoint.weights, **art.checkpoint.optimizer_state}
    rate = np.array(LR, np.float32)
    for _ in range(STEPS):
        feeds = {"x": x, "label": labels, "learning_rate": rate, **values}
        _, *new = session.run([step.loss, *step.new_weights, *step.new_state], feeds)
        values = dict(zip([*step.weights, *step.state], new, strict=True))
    trained = Checkpoint({w: values[w] for w in step.weights}, {s: values[s] for s in step.state})
    save_checkpoint(trained, folder / "trained.json")
    return merge_checkpoint(folder, folder / "trained.json")


def test_int8_fine_tuning_matches_float32_accuracy(tmp_path):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from onnxgrad.graph.lora import lora_adapters

    x_train, x_test, y_train, y_test = _digits()
    _pretrained(tmp_path / "float32.onnx", x_train, y_train)
    quantize_dynamic(tmp_path / "float32.onnx", tmp_path / "int8.onnx", weight_type=QuantType.QInt8)
    x_train, x_test = _transposed(x_train), _transposed(x_test)
    accuracy = {}
    for form in ("float32", "int8"):
        deployed = onnx.load(tmp_path / f"{form}.onnx")
        before = _accuracy(deployed, x_test, y_test)
        tuned = _fine_tuned(tmp_path / f"{form}.onnx", x_train, y_train, tmp_path / form)
        accuracy[form] = (before, _accuracy(tuned, x_test, y_test))
        if form == "int8":  # the adapters stay over the int8 weights quantize_dynamic wrote
            products = {n.input[1] for n in deployed.graph.node if n.op_type == "MatMulInteger"}
            assert {a["weight"] for a in lora_adapters(tuned)} == products
    (start32, end32), (start8, end8) = accuracy["float32"], accuracy["int8"]
    assert start32 < 0.6 and end32 > start32 + 0.25 and end8 > start8 + 0.25, accuracy
    assert abs(end8 - end32) <= 0.02, accuracy
