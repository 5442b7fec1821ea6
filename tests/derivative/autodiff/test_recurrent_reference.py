"""The numpy RNN/GRU/LSTM kernels that serve as the float64 oracle of the recurrent rule
table compute what onnxruntime's kernels compute (float32), for every table entry.

onnxruntime supports no ``layout=1``: those entries run there as their ``layout=0``
equivalent (inputs and outputs transposed)."""

from dataclasses import replace

import numpy as np
import onnxruntime
import pytest

from tests.derivative.autodiff.cases_recurrent import CASES, reference
from tests.derivative.autodiff.gradcheck import case_model

FIRST_ORDER = [c for c in CASES if c.graph is None]
_BATCH_FIRST = {"X": (1, 0, 2), "initial_h": (1, 0, 2), "initial_c": (1, 0, 2)}


def _time_first(case):
    """The ``layout=0`` case computing the same values, and how to transpose its outputs."""
    if not case.attrs.get("layout"):
        return case, [None] * case.n_outputs
    inputs = {
        k: v if v is None or k not in _BATCH_FIRST else v.transpose(_BATCH_FIRST[k])
        for k, v in case.inputs.items()
    }
    attrs = {k: v for k, v in case.attrs.items() if k != "layout"}
    perms = [(2, 0, 1, 3)] + [(1, 0, 2)] * (case.n_outputs - 1)
    return replace(case, inputs=inputs, attrs=attrs), perms


@pytest.mark.parametrize("case", FIRST_ORDER, ids=[c.id for c in FIRST_ORDER])
def test_reference_kernel_matches_onnxruntime(case):
    model64, feeds64 = case_model(case, np.float64)
    got = reference(model64).run(None, feeds64)
    time_first, perms = _time_first(case)
    model32, feeds32 = case_model(time_first, np.float32)
    expected = onnxruntime.InferenceSession(
        model32.SerializeToString(), providers=["CPUExecutionProvider"]
    ).run(None, feeds32)
    for k, (value, oracle, perm) in enumerate(zip(got, expected, perms)):
        oracle = oracle if perm is None else oracle.transpose(perm)
        np.testing.assert_allclose(value, oracle, rtol=1e-4, atol=1e-5, err_msg=f"output {k}")
