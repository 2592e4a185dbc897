"""Evaluation datasets: the packaged ones and user files, with gold labels in the model's space.

Evidence annotations (JSONL only), in the field named by ``evidence_field`` (default
``"evidence"``), in either form:

- a list of ``[start, end]`` character spans of ``text`` (end exclusive), e.g.
  ``{"text": "a dull, lifeless film", "label": 0, "evidence": [[2, 6], [8, 16]]}``;
- a list of 0/1 flags, one per whitespace-separated word of ``text``, e.g.
  ``{"text": "a dull, lifeless film", "label": 0, "evidence": [0, 1, 1, 0]}``.

A model token is evidence when its character span overlaps an evidence span.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from limelight.demo import datasets as D
from limelight.errors import InvalidArgument
from limelight.evaluation.runner import EvalExample

BUILTIN: tuple[str, ...] = ("rotten_tomatoes", "drugscom")


@dataclass
class LoadedData:
    """Sampled examples and what was done to get them (for the report)."""

    name: str
    examples: list[EvalExample]
    total: int
    notes: list[str]


def parse_evidence(value: Any, text: str, where: str) -> tuple[tuple[int, int], ...] | None:
    """Character spans from either evidence form (see the module docstring)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidArgument(f"{where}: evidence must be a list")
    if not value:
        return ()
    if all(isinstance(v, list | tuple) and len(v) == 2 for v in value):
        if not all(_whole(x) for pair in value for x in pair):  # int("a") was a traceback
            raise InvalidArgument(f"{where}: evidence spans must be integer [start, end] pairs")
        spans = tuple((int(a), int(b)) for a, b in value)
        for a, b in spans:
            if not 0 <= a < b <= len(text):
                raise InvalidArgument(f"{where}: evidence span [{a}, {b}) outside the text")
        return spans
    if all(v in (0, 1) and not isinstance(v, float) for v in value):
        words = [m.span() for m in re.finditer(r"\S+", text)]
        if len(words) != len(value):
            raise InvalidArgument(
                f"{where}: {len(value)} evidence flags for {len(words)} whitespace words"
            )
        return tuple(span for span, flag in zip(words, value, strict=True) if flag)
    raise InvalidArgument(f"{where}: evidence is neither [start, end] spans nor 0/1 word flags")


def _whole(value: Any) -> bool:
    """A JSON integer (``2`` or ``2.0``); not a bool, a string or a fraction."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _map_label(
    name: str | None, index: int | None, model_labels: Sequence[str], label_map: Mapping[str, str]
) -> int | None:
    key = name if name is not None else (str(index) if index is not None else None)
    if key is not None and key in label_map:  # a numeric label is mapped by its digits
        target = label_map[key]
        if target in ("", "none", "None"):
            return None
        if target not in model_labels:
            raise InvalidArgument(f"label map target {target!r} is not a model label")
        return list(model_labels).index(target)
    if name is not None and name in model_labels:
        return list(model_labels).index(name)
    if index is not None and 0 <= index < len(model_labels):
        return index
    return None


def _gold_label_notes(
    name: str,
    seen: set[str],
    model_labels: Sequence[str],
    label_map: Mapping[str, str],
    label_field: str,
) -> list[str]:
    """Say so when gold labels are missing or match none of the model's: the accuracy and the
    games then go without them, which a "–" in the table alone does not explain."""
    if not seen:
        return [f"{name} has no gold labels (field {label_field!r}): no accuracy, no games"]
    unmatched = sorted(
        label
        for label in seen
        if label not in label_map
        and _map_label(label, int(label) if label.isdigit() else None, model_labels, {}) is None
    )
    if not unmatched:
        return []
    shown = ", ".join(map(repr, unmatched[:10])) + (" …" if len(unmatched) > 10 else "")
    return [
        f"gold label(s) {shown} of {name} match no label of the model "
        f"({', '.join(model_labels)}): those rows count as unlabelled; map them with "
        "--label-map NAME=LABEL"
    ]


def load_examples(
    source: str,
    model_labels: Sequence[str],
    n: int | None = None,
    seed: int = 0,
    split: str = "test",
    text_field: str = "text",
    label_field: str = "label",
    evidence_field: str = "evidence",
    label_map: Mapping[str, str] | None = None,
    multi_label: bool = False,
) -> LoadedData:
    """Read ``source`` (a built-in name or a CSV/TSV/JSONL path) and sample ``n`` examples.

    ``multi_label``: the model's evaluation uses no gold labels (it scores each predicted
    label), so none are mapped onto its labels and none missing or unmatched is noted."""
    label_map = dict(label_map or {})
    asked = set(label_map)  # the caller's keys, not the defaults added below
    notes: list[str] = []
    rows: list[EvalExample] = []
    seen: set[str] = set()  # every gold label name (or index, as digits) in the data
    if source == "rotten_tomatoes":
        for ex in D.rotten_tomatoes(split):  # type: ignore[arg-type]
            seen.add(ex.label_name if ex.label_name is not None else str(ex.label))
            rows.append(
                EvalExample(ex.text, _map_label(ex.label_name, ex.label, model_labels, label_map))
            )
        name = f"rotten_tomatoes ({split})"
    elif source == "drugscom":
        binary = len(model_labels) == 2 and not multi_label
        if binary and not set(D.DRUGSCOM_LABELS) <= set(model_labels):
            # A binary sentiment model: negative -> class 0, positive -> class 1, neutral has
            # no counterpart (no gold label; still used for AOPC on the predicted class).
            for k, v in (("negative", model_labels[0]), ("positive", model_labels[1])):
                label_map.setdefault(k, v)
            label_map.setdefault("neutral", "none")
            notes.append(
                f"drugsCom labels mapped onto the binary model: negative -> {model_labels[0]}, "
                f"positive -> {model_labels[1]}, neutral -> no gold label (games skip it)"
            )
        if split not in ("train", "test"):
            raise InvalidArgument(f"drugscom has a train and a test split, not {split!r}")
        for ex in D.drugscom(split):  # type: ignore[arg-type]
            seen.add(str(ex.label_name))
            rows.append(
                EvalExample(ex.text, _map_label(ex.label_name, None, model_labels, label_map))
            )
        name = f"drugscom ({split})"
    else:
        path = Path(source)
        examples = D.read_labelled(path, text_field, label_field)
        evidence: list[Any] = [None] * len(examples)
        lines = [line_no for line_no, _ in D.read_records(path)]
        if path.suffix.lower() in (".jsonl", ".ndjson", ".json"):
            evidence = [r.get(evidence_field) for _, r in D.read_records(path)]
        for ex, ev, line_no in zip(examples, evidence, lines, strict=True):
            name_, index = ex.label_name, ex.label
            if index is None and name_ is not None and name_.lstrip("-").isdigit():
                index = int(name_)
            if name_ is not None or index is not None:
                seen.add(name_ if name_ is not None else str(index))
            rows.append(
                EvalExample(
                    ex.text,
                    _map_label(name_, index, model_labels, label_map),
                    ex.text_pair,
                    parse_evidence(ev, ex.text, f"{path}:{line_no}"),
                )
            )
        name = path.name
    unmatched = sorted(asked - seen)
    if unmatched:  # a misspelt key leaves its rows with another gold label: say so
        have = ", ".join(sorted(seen)[:20]) or "none"
        notes.append(
            f"label map key(s) {', '.join(map(repr, unmatched))} match no gold label of "
            f"{name} (its labels: {have})"
        )
    if not multi_label:  # a multi-label run uses no gold label: nothing to say about them
        notes.extend(_gold_label_notes(name, seen, model_labels, label_map, label_field))
    total = len(rows)
    rows = [dataclasses.replace(row, source_index=i) for i, row in enumerate(rows)]
    if n is not None and n < total:
        rows = random.Random(seed).sample(rows, n)
        notes.append(f"{n} of {total} examples sampled with seed {seed}")
    return LoadedData(name=name, examples=rows, total=total, notes=notes)
