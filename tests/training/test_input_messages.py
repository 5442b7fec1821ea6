"""Data a float32 model cannot hold: a finite float64 value past float32's range is named as
an overflow, not as an infinity the user never wrote."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.training.test_estimators import linear_data, linear_estimator


def test_a_value_that_overflows_float32_is_named_as_such():
    X, y = linear_data()
    big = X.astype(np.float64)
    big[7, 2] = 1e40
    assert np.isinf(np.float32(1e40)) and np.isfinite(big).all()
    limit = re.escape(f"{np.finfo(np.float32).max:.4g}")
    with pytest.raises(ValueError, match=rf"X\[7, 2\] = 1e\+40 overflows float32 .*{limit}"):
        linear_estimator().fit(big, y)
    y_big = y.astype(np.float64)
    y_big[4] = -1e39
    with pytest.raises(ValueError, match=r"y\[4\] = -1e\+39 overflows float32"):
        linear_estimator().fit(X, y_big)
    bad = X.copy()
    bad[7, 2] = np.inf  # a real infinity keeps its message
    with pytest.raises(ValueError, match=r"X holds inf at row 7 \(X\[7, 2\]\)"):
        linear_estimator().fit(bad, y)
