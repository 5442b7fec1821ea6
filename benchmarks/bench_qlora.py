"""LoRA fine-tuning step time and peak memory of a small Llama-like LM in the forms people
deploy (float32, int8 ``quantize_dynamic``, 4-bit ``MatMulNBits``) against PyTorch with
PEFT-style adapters, one thread each.

Two steps, since torch and the current onnxruntime live in different environments here::

    python benchmarks/bench_qlora.py export FOLDER      # torch: the float32 file, torch timing
    python benchmarks/bench_qlora.py onnx FOLDER        # onnxruntime: the forms, their timing

Each measurement runs in a child process so that its peak resident memory is its own.
Measured (2-core shared machine, two runs each): step 56-68 ms float32, 55-57 ms int4
(MatMulNBits, blocks of 32), 52-77 ms PyTorch; peak RSS 279 MB, 288 MB, 508 MB; files 10.1 MB
float32, 1.8 MB int4. The int8 form (``MatMulInteger``, its adapters over the
``DequantizeLinear`` of the frozen int8 weights), measured beside float32 as the CPU time of the
one-thread step (the machine's load at 8, wall times too noisy; three runs each): 41-42 ms int8,
34-35 ms float32; peak RSS 253 MB int8, 271-277 MB float32; file 2.8 MB int8.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

HIDDEN, LAYERS, HEADS, SEQ, BATCH, RANK, STEPS = 256, 4, 8, 32, 4, 8, 20


def _config():
    import transformers

    return transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS // 2,
        max_position_embeddings=2 * SEQ,
        attn_implementation="eager",
    )


def export(folder: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.normalize import deployed

    deployed.HIDDEN, deployed.SEQ, deployed.BATCH = HIDDEN, SEQ, BATCH
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config()).eval()

    class LanguageModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, inputs_embeds):
            mask = torch.ones(inputs_embeds.shape[:2], dtype=torch.int64)
            return self.model(inputs_embeds=inputs_embeds, attention_mask=mask).logits

    deployed._export(LanguageModel(), (torch.randn(BATCH, SEQ, HIDDEN),), ["inputs_embeds"],
                     folder / "float32.onnx")  # fmt: skip


def torch_step() -> dict:
    """PEFT-style LoRA (frozen Linear, trainable A, B on every projection), Adam, MSE."""
    import torch
    import transformers

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config())
    for p in model.parameters():
        p.requires_grad_(False)
    adapters = []
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear) and name != "lm_head":
                a = torch.nn.Parameter(
                    torch.randn(child.in_features, RANK) / child.in_features**0.5
                )
                b = torch.nn.Parameter(torch.zeros(RANK, child.out_features))
                adapters += [a, b]

                def forward(x, base=child.forward, a=a, b=b):
                    return base(x) + (x @ a) @ b

                child.forward = forward
    optimizer = torch.optim.Adam(adapters, lr=1e-3)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    target = torch.randn(BATCH, SEQ, 512)
    return _timed(lambda: _torch_update(model, optimizer, x, target))


def _torch_update(model, optimizer, x, target):
    optimizer.zero_grad()
    loss = ((model(inputs_embeds=x).logits - target) ** 2).sum()
    loss.backward()
    optimizer.step()


def onnx_step(path: Path) -> dict:
    import numpy as np
    import onnx
    import onnxruntime as ort

    from onnxgrad import add_lora
    from onnxgrad.training import generate_artifacts, load_train_step

    folder = path.parent / f"{path.stem}_art"
    art = generate_artifacts(add_lora(onnx.load(path), rank=RANK), artifact_directory=folder)
    step = load_train_step(folder)
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(art.path("training_model.onnx")), options)
    rng = np.random.default_rng(0)
    values = {**art.checkpoint.weights, **art.checkpoint.optimizer_state}
    feeds = {
        "inputs_embeds": rng.standard_normal((BATCH, SEQ, HIDDEN)).astype(np.float32),
        "label": rng.standard_normal((BATCH, SEQ, 512)).astype(np.float32),
        "learning_rate": np.array(1e-3, np.float32),
    }
    names = [step.loss, *step.new_weights, *step.new_state]

    def update():
        nonlocal values
        out = session.run(names, {**feeds, **values})
        values = dict(zip([*step.weights, *step.state], out[1:]))

    return _timed(update)


def _timed(update) -> dict:
    update()
    start = time.perf_counter()
    for _ in range(STEPS):
        update()
    step_ms = (time.perf_counter() - start) / STEPS * 1000
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"step_ms": round(step_ms, 2), "peak_rss_mb": round(peak_mb, 1)}


def make_forms(folder: Path) -> None:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    source = folder / "float32.onnx"
    quantize_dynamic(source, folder / "int8.onnx", weight_type=QuantType.QInt8)
    quantizer = MatMulNBitsQuantizer(onnx.load(source), block_size=32, is_symmetric=False)
    quantizer.process()
    quantizer.model.save_model_to_file(str(folder / "int4.onnx"))


def main(argv: list[str]) -> None:
    what, folder = argv[0], Path(argv[1])
    if what in ("export", "onnx"):
        folder.mkdir(parents=True, exist_ok=True)
    if what == "child-torch":
        print(json.dumps(torch_step()))
    elif what == "child-onnx":
        print(json.dumps(onnx_step(folder)))
    elif what == "export":
        export(folder)
        print("torch + PEFT-style LoRA:", _child("child-torch", folder))
    elif what == "onnx":
        make_forms(folder)
        for form in ("float32", "int8", "int4"):
            print(f"onnxgrad LoRA, {form}:", _child("child-onnx", folder / f"{form}.onnx"))


def _child(what: str, path: Path) -> str:
    result = subprocess.run(
        [sys.executable, __file__, what, str(path)], capture_output=True, text=True, check=False
    )
    return (
        result.stdout.strip().splitlines()[-1] if result.returncode == 0 else result.stderr[-400:]
    )


if __name__ == "__main__":
    main(sys.argv[1:])
