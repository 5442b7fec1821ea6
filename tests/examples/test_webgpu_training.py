"""The artifacts generated with ``target="webgpu"`` train in headless Chromium on
onnxruntime-web's WebGPU provider with the losses of its WASM provider (float32 tolerance),
no node of their models falling back to the CPU (``examples/js/webgpu_fallbacks.py``).

The first loss is also checked against torch's own prediction of the model. The adapter is
SwiftShader's (a CPU emulation of Vulkan, Debian's chromium); the tests skip, printing what
the page reported, only where Chromium gives no WebGPU adapter.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest

from onnxgrad.training import generate_artifacts
from onnxgrad.training.artifacts.checkpoint import save_tensors
from tests.examples.test_js_training import (  # noqa: F401 (fixtures)
    CASES,
    EXAMPLE,
    _load,
    js_env,
    server,
)

ROWS, BATCH = 16, 8


def _lora_case():
    """LoRA (rank 2) on every MatMul of a 2-layer Llama-like decoder exported by torch."""
    pytest.importorskip("transformers")
    import onnx
    import onnxruntime as ort

    from onnxgrad import add_lora
    from tests.normalize.deployed import export_llama

    path = _lora_case.folder / "llama.onnx"
    export_llama(path)
    rng = np.random.default_rng(0)
    X = rng.standard_normal((4, 5, 32)).astype(np.float32)
    y = rng.standard_normal((4, 5, 50)).astype(np.float32)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    first = float(np.sum((session.run(None, {"inputs_embeds": X[:2]})[0] - y[:2]) ** 2))
    return add_lora(onnx.load(path), None, rank=2), "adam", X, y, first


def _run_page(base: str, name: str, provider: str, batch: int) -> dict:
    url = f"{base}/index.html?artifacts=/artifacts/{name}/&epochs=1&batch={batch}&ep={provider}"
    command = ["node", str(EXAMPLE / "run-browser.mjs"), url, "--webgpu", "--timeout", "240"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=EXAMPLE)
    assert result.stdout.strip(), result.stderr[-4000:]
    return json.loads(result.stdout)


@pytest.mark.parametrize(
    "name",
    [
        "cnn",
        pytest.param("attention", marks=pytest.mark.slow),
        pytest.param("lora", marks=pytest.mark.slow),
    ],
)
def test_webgpu_trains_like_wasm(server, name, tmp_path_factory):  # noqa: F811
    served, base = server
    if name == "lora":
        _lora_case.folder = tmp_path_factory.mktemp("llama")
        model, optimizer, X, y, first = _lora_case()
        batch = 2
    else:
        model, optimizer, X, y, first = CASES[name]()
        X, y, batch = X[:ROWS], y[:ROWS], BATCH
    folder = served / f"{name}-webgpu"
    art = generate_artifacts(
        model, optimizer=optimizer, learning_rate=0.01, folder=folder, target="webgpu"
    )
    save_tensors({art.train_step.features[0]: X, art.train_step.label: y}, folder / "data.json")

    placements = _load("webgpu_fallbacks").webgpu_placements(folder)
    if "error" in placements:
        pytest.skip(
            "Chromium (--enable-unsafe-webgpu --use-webgpu-adapter=swiftshader, page on "
            f"localhost) gave no WebGPU session: {placements['error']}"
        )
    assert set(placements) == {"training_model.onnx", "eval_model.onnx", "inference_model.onnx"}
    for file, placement in placements.items():
        assert placement.fallbacks == [], (file, placement.fallbacks)
        assert placement.on_gpu > 0, file

    wasm = _run_page(base, folder.name, "wasm", batch)
    webgpu = _run_page(base, folder.name, "webgpu", batch)
    assert "error" not in wasm and "error" not in webgpu, (wasm, webgpu)
    assert wasm["provider"] == "wasm" and webgpu["provider"] == "webgpu", webgpu["fallback"]
    steps = -(-len(X) // batch)
    assert len(webgpu["losses"]) == len(wasm["losses"]) == steps
    np.testing.assert_allclose(wasm["losses"][0], first, rtol=1e-5)
    np.testing.assert_allclose(webgpu["losses"], wasm["losses"], rtol=1e-4)


def test_default_attention_falls_back_on_webgpu(server):  # noqa: F811
    """Without the WebGPU target the tiled attention's Loops run on the CPU: the tool sees
    them (the rewrite above is what brings the count to zero)."""
    served, _ = server
    model, optimizer, *_ = CASES["attention"]()
    folder = served / "attention-default"
    generate_artifacts(model, optimizer=optimizer, folder=folder)
    placements = _load("webgpu_fallbacks").webgpu_placements(folder)
    if "error" in placements:
        pytest.skip(f"no WebGPU session: {placements['error']}")
    fallbacks = placements["training_model.onnx"].fallbacks
    assert sorted(op for op, _ in fallbacks) == ["Loop", "Loop"], fallbacks
    shutil.rmtree(folder)
