"""The batch's predictions equal the row-by-row rule (``predict``) for every kind of head."""

from __future__ import annotations

import numpy as np
import pytest

from limelight.core.prediction import (
    MULTI_LABEL,
    REGRESSION,
    SINGLE_LABEL,
    ProblemType,
    predict,
    predict_rows,
)


@pytest.mark.parametrize(
    ("problem", "classes"),
    [(SINGLE_LABEL, 2), (SINGLE_LABEL, 7), (MULTI_LABEL, 5), (REGRESSION, 1)],
)
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_predict_rows_is_predict_per_row(problem: ProblemType, classes: int, rows: int) -> None:
    rng = np.random.default_rng(rows * 10 + classes)
    # Wide logits (softmax's shift matters), ties (the arg-max keeps the first).
    logits = (rng.standard_normal((rows, classes)) * 30).astype(np.float32)
    logits[0, -1] = logits[0, 0]
    thresholds = [0.5] * classes
    batch = predict_rows(logits, problem, thresholds)
    assert len(batch) == rows
    for row, got in zip(logits, batch, strict=True):
        want = predict(row, problem, thresholds)
        assert got.index == want.index and got.active == want.active
        assert got.probabilities.dtype == np.float32
        np.testing.assert_allclose(got.probabilities, want.probabilities, rtol=1e-6, atol=1e-7)
        if problem == SINGLE_LABEL:
            assert float(got.probabilities.sum()) == pytest.approx(1.0, abs=1e-6)
