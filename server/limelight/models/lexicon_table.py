"""The classifier's lexicon table on disk, beside the model it was built from.

A float32 array [vocabulary, classes]: each entry's change in every class's value (log-odds)
when the text is that one token alone, against the empty text; special tokens' rows are 0.
``limelight lexicon`` builds it (``limelight.methods.lexicon``); the serving runtime looks a
batch's tokens up in it (``limelight.runtimes.lexicon``). A card binds it to the model's
fingerprint, as the distilled head's card does.

It lies beside the model, or, where the model's directory is read-only (a Kubernetes model
volume), in the cache directory under the model's version: the sidecar builds it there at
start-up with ``LIMELIGHT_LEXICON_BUILD``. The table beside the model wins.
"""

from __future__ import annotations

import io
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.lib.format as npy

from limelight.core.types import FloatArray
from limelight.files import write_atomically
from limelight.models.loaded import LoadedModel

log = logging.getLogger(__name__)

LEXICON_DIRNAME = "limelight_lexicon"
OUTPUT_NAME = "lexicon"
"""The runtime's extra output (``InlineOutputs.extra``) holding each token's row."""
CARD_FORMAT = "limelight-lexicon/1"


@dataclass
class LexiconCard:
    model_version: str
    vocabulary: int
    num_labels: int
    reference: str
    """``empty text`` (the tokenizer's special tokens alone) or ``vocabulary mean``."""
    seconds: float = 0.0
    """How long the build took."""
    format: str = CARD_FORMAT


def lexicon_dir(model: LoadedModel) -> Path:
    """Beside the model."""
    return model.directory / LEXICON_DIRNAME


def cached_lexicon_dir(model: LoadedModel, cache_dir: Path) -> Path:
    """In the cache directory, for a model whose own directory is read-only."""
    return cache_dir / "lexicons" / model.version


def lexicon_output_dir(model: LoadedModel, cache_dir: Path) -> Path:
    """Where to save a new table: beside the model, or in the cache when the model's directory
    is read-only."""
    if os.access(model.directory, os.W_OK):
        return lexicon_dir(model)
    return cached_lexicon_dir(model, cache_dir)


def _candidates(model: LoadedModel, cache_dir: Path | None) -> list[Path]:
    beside = lexicon_dir(model)
    return [beside] if cache_dir is None else [beside, cached_lexicon_dir(model, cache_dir)]


def find_lexicon_dir(model: LoadedModel, cache_dir: Path | None = None) -> Path | None:
    """Where a table built for ``model`` lies: beside it, else in ``cache_dir``; None when
    neither holds one."""
    for directory in _candidates(model, cache_dir):
        if not _unavailable_reason(model, directory):
            return directory
    return None


def save_lexicon(table: FloatArray, card: LexiconCard, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    # Each file replaced whole, the card last: a directory with a card is a complete table,
    # and a sidecar serving the old one reloads the new one, never half of it.
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(table, dtype=np.float32))
    write_atomically(directory / "table.npy", buffer.getvalue())
    write_atomically(directory / "card.json", json.dumps(asdict(card), indent=2) + "\n")
    return directory


def lexicon_unavailable_reason(model: LoadedModel, cache_dir: Path | None = None) -> str:
    """Empty when a table built for ``model`` lies beside it (or in ``cache_dir``); otherwise
    why not and what to do."""
    candidates = _candidates(model, cache_dir)
    present = [d for d in candidates if (d / "card.json").exists()]
    if not present:
        where = "beside the model" if cache_dir is None else f"beside the model or in {cache_dir}"
        return (
            f"no lexicon table {where}; build one with `limelight lexicon --model "
            f"{model.directory}` (or let the sidecar build it at start-up: "
            "LIMELIGHT_LEXICON_BUILD=true)"
        )
    reasons = [_unavailable_reason(model, d) for d in present]
    # Every table there is stale or broken: the first one's fault is the one to fix.
    return "" if not all(reasons) else reasons[0]


def _unavailable_reason(model: LoadedModel, directory: Path) -> str:
    path = directory / "card.json"
    build = f"`limelight lexicon --model {model.directory}`"
    if not path.exists():
        return f"no lexicon table in {directory}"
    try:
        card = LexiconCard(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as exc:
        return f"the lexicon card {path} cannot be read ({exc}); run {build} again"
    if card.format != CARD_FORMAT:
        return f"the lexicon table has format {card.format!r}, not {CARD_FORMAT!r}; run {build}"
    if card.model_version != model.version:
        return (
            f"the lexicon table was built for model version {card.model_version}, but this model "
            f"is {model.version}; run {build} again"
        )
    if card.num_labels != model.num_labels:
        return f"the lexicon table has {card.num_labels} classes, the model {model.num_labels}"
    problem = _table_problem(directory / "table.npy")
    if problem:
        # --force: `limelight lexicon` takes a table whose card fits for a current one.
        return (
            f"{problem}; run `limelight lexicon --model {model.directory} --force` again, or "
            "restore the file"
        )
    return ""


def _table_problem(path: Path) -> str:
    """Why the table at ``path`` cannot be loaded (missing, unreadable, cut short: a copy not
    done), from its header and its size alone; empty when it looks whole."""
    try:
        with path.open("rb") as f:
            version = npy.read_magic(f)
            if version not in ((1, 0), (2, 0)):  # np.save writes 1.0: no such table here
                return ""  # np.load says what is wrong, if anything
            read = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
            shape, _, dtype = read(f)
            header = f.tell()
        size = path.stat().st_size
    except (OSError, ValueError, EOFError) as exc:
        return f"the lexicon table {path} cannot be read ({type(exc).__name__}: {exc})"
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(shape) != 2 or size != expected:
        return (
            f"the lexicon table {path} is not a whole [vocabulary, classes] table: shape "
            f"{list(shape)}, {size:,} bytes where its header says {expected:,} (a copy cut short?)"
        )
    return ""


def load_lexicon(model: LoadedModel, cache_dir: Path | None = None) -> FloatArray | None:
    """The table beside ``model`` (else in ``cache_dir``), or None when there is none, it
    belongs to another model, or it cannot be read (a copy cut short): logged, naming the file,
    and the model is then served without it."""
    directory = find_lexicon_dir(model, cache_dir)
    if directory is None:
        if any((d / "card.json").exists() for d in _candidates(model, cache_dir)):
            log.warning(
                "not loading the lexicon table: %s", lexicon_unavailable_reason(model, cache_dir)
            )
        return None
    path = directory / "table.npy"
    try:
        table = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:  # changed since it was checked
        log.warning(
            "not loading the lexicon table: %s cannot be read (%s: %s); run `limelight lexicon "
            "--model %s --force` again, or restore the file",
            path,
            type(exc).__name__,
            exc,
            model.directory,
        )
        return None
    if table.ndim != 2 or table.shape[1] != model.num_labels:
        log.warning("not loading the lexicon table: its shape %s is not [V, classes]", table.shape)
        return None
    return np.asarray(table, dtype=np.float32)
