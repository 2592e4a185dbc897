"""The classifier's lexicon table on disk, beside the model it was built from.

A float32 array [vocabulary, classes]: each entry's change in every class's value (log-odds)
when the text is that one token alone, against the empty text; special tokens' rows are 0.
``limelight lexicon`` builds it (``limelight.methods.lexicon``); the serving runtime looks a
batch's tokens up in it (``limelight.runtimes.lexicon``). A card binds it to the model's
fingerprint, as the distilled head's card does.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from limelight.core.types import FloatArray
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
    return model.directory / LEXICON_DIRNAME


def save_lexicon(table: FloatArray, card: LexiconCard, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    np.save(directory / "table.npy", np.asarray(table, dtype=np.float32))
    # The card last: a directory with a card is a complete table.
    (directory / "card.json").write_text(json.dumps(asdict(card), indent=2) + "\n")
    return directory


def lexicon_unavailable_reason(model: LoadedModel) -> str:
    """Empty when a table built for ``model`` lies beside it; otherwise why not and what to do."""
    path = lexicon_dir(model) / "card.json"
    build = f"`limelight lexicon --model {model.directory}`"
    if not path.exists():
        return f"no lexicon table beside the model; build one with {build}"
    try:
        card = LexiconCard(**json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
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
    return ""


def load_lexicon(model: LoadedModel) -> FloatArray | None:
    """The table beside ``model``, or None when there is none or it belongs to another model
    (logged: the model is then served without it)."""
    reason = lexicon_unavailable_reason(model)
    if reason:
        if (lexicon_dir(model) / "card.json").exists():
            log.warning("not loading the lexicon table: %s", reason)
        return None
    table = np.load(lexicon_dir(model) / "table.npy", allow_pickle=False)
    if table.ndim != 2 or table.shape[1] != model.num_labels:
        log.warning("not loading the lexicon table: its shape %s is not [V, classes]", table.shape)
        return None
    return np.asarray(table, dtype=np.float32)
