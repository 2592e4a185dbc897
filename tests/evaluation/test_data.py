"""Gold labels of `limelight eval`'s data files: names, indices and the label map."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from limelight.errors import InvalidArgument
from limelight.evaluation.data import load_examples

LABELS = ["rotten", "fresh"]


def _csv(tmp_path: Path, rows: list[tuple[str, str]]) -> str:
    path = tmp_path / "data.csv"
    path.write_text(
        "text,label\n" + "".join(f'"{t}",{label}\n' for t, label in rows), encoding="utf-8"
    )
    return str(path)


def test_numeric_labels_are_indices_and_mapped_by_their_digits(tmp_path: Path) -> None:
    data = _csv(tmp_path, [("good", "1"), ("bad", "0"), ("meh", "2")])
    plain = load_examples(data, LABELS)
    assert [e.gold for e in plain.examples] == [1, 0, None]  # 2: no such class
    # a map keyed by the digits the file holds (flipped here, and 2 -> no gold label)
    mapped = load_examples(data, LABELS, label_map={"1": "rotten", "0": "fresh", "2": "none"})
    assert [e.gold for e in mapped.examples] == [0, 1, None]
    assert not any("label map" in note for note in mapped.notes)


def test_named_labels_and_a_key_that_matches_nothing_is_noted(tmp_path: Path) -> None:
    data = _csv(tmp_path, [("good", "positive"), ("bad", "negative")])
    loaded = load_examples(data, LABELS, label_map={"positive": "fresh", "negativ": "rotten"})
    assert [e.gold for e in loaded.examples] == [1, None]
    assert any(
        "label map key(s) 'negativ' match no gold label of data.csv" in note
        and "negative, positive" in note
        for note in loaded.notes
    ), loaded.notes
    with pytest.raises(InvalidArgument, match="'nope' is not a model label"):
        load_examples(data, LABELS, label_map={"positive": "nope"})


def test_gold_labels_the_model_does_not_have_are_noted(tmp_path: Path) -> None:
    """Labels named otherwise than the model's were dropped without a word: the table showed
    "–" for accuracy and the games, and nothing said why."""
    data = _csv(tmp_path, [("good", "positive"), ("bad", "negative"), ("ok", "fresh")])
    loaded = load_examples(data, LABELS)
    assert [e.gold for e in loaded.examples] == [None, None, 1]
    assert any(
        "gold label(s) 'negative', 'positive' of data.csv match no label of the model "
        "(rotten, fresh)"
        in note
        and "--label-map" in note
        for note in loaded.notes
    ), loaded.notes
    mapped = load_examples(data, LABELS, label_map={"positive": "fresh", "negative": "none"})
    assert not any("gold label(s)" in note for note in mapped.notes)
    unlabelled = load_examples(data, LABELS, label_field="nolabel")
    assert any("has no gold labels (field 'nolabel')" in n for n in unlabelled.notes)


def test_evidence_rows_keep_their_texts_line_separators(tmp_path: Path) -> None:
    """The evidence column was read again with str.splitlines, which also cuts at U+2028: a
    valid JSONL file failed with a JSONDecodeError."""
    path = tmp_path / "data.jsonl"
    rows = [
        {"text": "good\u2028film", "label": 1, "evidence": [[0, 4]]},
        {"text": "bad", "label": 0},
    ]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    loaded = load_examples(str(path), LABELS)
    assert [e.text for e in loaded.examples] == ["good\u2028film", "bad"]
    assert [e.gold for e in loaded.examples] == [1, 0]
    assert loaded.examples[0].evidence == ((0, 4),)


def test_an_unknown_drugscom_split_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="drugscom has a train and a test split, not 'valid"):
        load_examples("drugscom", LABELS, split="validation")


def test_a_multi_label_model_is_told_nothing_about_gold_labels(tmp_path: Path) -> None:
    """A multi-label run scores each predicted label and uses no gold label: drugsCom's
    sentiment ratings matching none of the demo's tags is no reason to suggest --label-map."""
    tags = ["negative", "side_effects", "mental_health", "birth_control"]
    single = load_examples("drugscom", tags)  # as a single-label model's data: noted
    assert any("gold label(s) 'neutral', 'positive'" in note for note in single.notes)
    for source in ("drugscom", _csv(tmp_path, [("good", "positive")])):
        loaded = load_examples(source, tags, n=6, multi_label=True)
        assert not any("gold label" in note or "--label-map" in note for note in loaded.notes)
    # two tags are no binary sentiment model: no drugsCom ratings are mapped onto them
    two = load_examples("drugscom", ["toxic", "spam"], n=6, multi_label=True)
    assert [e.gold for e in two.examples] == [None] * 6
    assert two.notes == ["6 of 379 examples sampled with seed 0"]


@pytest.mark.parametrize("spans", [[["a", "b"]], [[0, 2.5]], [[True, 3]], [[None, 3]]])
def test_evidence_spans_that_are_not_whole_numbers_are_refused(spans: list[object]) -> None:
    """`[["a", "b"]]` ended `limelight eval` in a ValueError traceback from int()."""
    from limelight.evaluation.data import parse_evidence

    with pytest.raises(
        InvalidArgument,
        match=r"^data.jsonl:3: evidence spans must be integer \[start, end\] pairs$",
    ):
        parse_evidence(spans, "a good film", "data.jsonl:3")
    assert parse_evidence([[2, 6.0]], "a good film", "data.jsonl:3") == ((2, 6),)
