"""The metric functions against values computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from limelight.errors import InvalidArgument
from limelight.evaluation import metrics as M
from limelight.evaluation.data import parse_evidence

# NormXLogit paper (arXiv 2411.16252), appendix A.4: "Karla thinks about it", evidence =
# "Karla" (index 0). The paper's attribution values were lost in the text conversion; what
# survives is their ranking [2, 0, 1, 3] ("about" first, "Karla" second). Any vector with that
# ranking reproduces it.
KARLA_EVIDENCE = [1, 0, 0, 0]
KARLA_SCORES = [0.3, 0.2, 0.4, 0.1]


def test_worked_example_average_precision_is_one_half() -> None:
    assert M.average_precision(KARLA_EVIDENCE, KARLA_SCORES) == pytest.approx(0.5)


def test_worked_example_dot_product_is_the_score_of_karla() -> None:
    assert M.dot_product(KARLA_EVIDENCE, KARLA_SCORES) == pytest.approx(0.3)


def test_worked_example_alternatives_from_the_paper() -> None:
    # "if the evidence index were 2 (ranked first) AP would be 1; if 1 (ranked third) ~0.33"
    assert M.average_precision([0, 0, 1, 0], KARLA_SCORES) == pytest.approx(1.0)
    assert M.average_precision([0, 1, 0, 0], KARLA_SCORES) == pytest.approx(1 / 3)


def test_average_precision_with_two_evidence_tokens() -> None:
    # ranking: idx 3 (ev), 0, 2 (ev), 1 -> precisions 1/1 and 2/3
    assert M.average_precision([0, 0, 1, 1], [0.5, 0.1, 0.4, 0.9]) == pytest.approx((1 + 2 / 3) / 2)


def test_average_precision_ties_keep_token_order_and_needs_evidence() -> None:
    assert M.average_precision([0, 1], [0.0, 0.0]) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        M.average_precision([0, 0], [1.0, 2.0])


def test_aopc_is_the_mean_drop() -> None:
    assert M.aopc(0.9, [0.5, 0.3]) == pytest.approx(0.5)
    assert M.aopc(0.2, [0.4]) == pytest.approx(-0.2)


def test_auc_trapezoid() -> None:
    assert M.auc([0, 0.5, 1], [1, 0.5, 0]) == pytest.approx(0.5)
    assert M.auc([0, 1], [1, 1]) == pytest.approx(1.0)
    assert M.auc([0, 0.25, 1], [0, 1, 1]) == pytest.approx(0.125 + 0.75)
    with pytest.raises(ValueError):
        M.auc([0, 0], [1, 1])


def test_accuracy_curve() -> None:
    preds = np.array([[1, 0, 0], [0, 0, 1]])
    assert M.accuracy_curve(preds, [1, 0]) == pytest.approx([1.0, 0.5, 0.0])


def test_fraction_count() -> None:
    assert M.fraction_count(10, 0.3) == 3
    assert M.fraction_count(4, 0.1) == 0
    assert M.fraction_count(4, 0.1, at_least_one=True) == 1
    assert M.fraction_count(7, 1.0) == 7
    assert M.fraction_count(0, 0.5, at_least_one=True) == 0


def test_token_overlap_by_hand() -> None:
    top = {0: ["a", "b", "c"], 1: ["b", "c", "d"]}
    assert M.token_overlap(top, 3) == pytest.approx(2 / 3)
    assert M.token_overlap(top, 1) == pytest.approx(0.0)
    assert M.token_overlap(top, 2) == pytest.approx(1 / 2)  # {a,b} vs {b,c}
    three = {0: ["a", "b"], 1: ["a", "c"], 2: ["a", "b"]}
    # pairs: (0,1) 1 shared, (0,2) 2, (1,2) 1 -> 4 / (3 pairs * 2)
    assert M.token_overlap(three, 2) == pytest.approx(4 / 6)
    assert M.token_overlap({0: ["a"]}, 1) is None
    assert M.overlapping_tokens(top, 3) == ["b", "c"]


def test_class_token_importance_by_hand() -> None:
    items = [
        (1, ["good", "film"], [2.0, 1.0]),  # normalised: good 1.0, film 0.5
        (1, ["good", "plot"], [1.0, -3.0]),  # good 1.0, plot clipped to 0
        (0, ["bad", "film"], [0.5, 0.5]),  # bad 1.0, film 1.0
    ]
    idf = {"good": 2.0, "film": 1.0}
    imp = M.class_token_importance(items, idf)
    assert imp[1] == pytest.approx({"good": 4.0, "film": 0.5})
    assert imp[0] == pytest.approx({"bad": 1.0, "film": 1.0})  # "bad" not in idf -> weight 1
    assert M.top_tokens(imp[1], 1) == ["good"]
    assert M.top_tokens(imp[0], 2) == ["bad", "film"]  # tie broken alphabetically


def test_inverse_document_frequency() -> None:
    idf = M.inverse_document_frequency([["a", "b"], ["a"], ["a", "a"]])
    assert idf["a"] == pytest.approx(math.log(4 / 4) + 1)
    assert idf["b"] == pytest.approx(math.log(4 / 2) + 1)


def test_evidence_from_spans() -> None:
    # [CLS] "karla"(0,5) "thinks"(6,12) "about"(13,18) [SEP]
    offsets = [(0, 0), (0, 5), (6, 12), (13, 18), (0, 0)]
    special = [True, False, False, False, True]
    assert M.evidence_from_spans(offsets, special, [(0, 5)]) == [0, 1, 0, 0, 0]
    assert M.evidence_from_spans(offsets, special, [(4, 7)]) == [0, 1, 1, 0, 0]
    assert M.evidence_from_spans(offsets, special, []) == [0, 0, 0, 0, 0]


def test_parse_evidence_forms() -> None:
    text = "a dull, lifeless film"
    assert parse_evidence([[2, 6]], text, "x") == ((2, 6),)
    assert parse_evidence([0, 1, 1, 0], text, "x") == ((2, 7), (8, 16))
    assert parse_evidence(None, text, "x") is None
    with pytest.raises(InvalidArgument):
        parse_evidence([0, 1], text, "x")
    with pytest.raises(InvalidArgument):
        parse_evidence([[5, 100]], text, "x")
