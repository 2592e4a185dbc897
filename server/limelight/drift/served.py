"""What a sidecar's inline attributions come from besides the traffic, as a drift reference
records it (``limelight.drift.reference.ServedIdentity``)."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

from limelight.core.prediction import label_thresholds
from limelight.drift.reference import ServedIdentity
from limelight.models.explainer_head import head_dir
from limelight.models.lexicon_table import find_lexicon_dir
from limelight.models.loaded import LoadedModel
from limelight.settings import Settings


def served_identity(settings: Settings, model: LoadedModel, method: str) -> ServedIdentity:
    """The identity of ``method``'s attributions of ``model`` as ``settings`` serve them."""
    thresholds = None
    if model.is_multi_label:
        thresholds = tuple(
            label_thresholds(model.labels, settings.label_threshold, settings.label_thresholds)
        )
    return ServedIdentity(
        model_version=model.version,
        explainer_digest=explainer_digest(settings, model, method),
        thresholds=thresholds,
        max_tokens=min(settings.max_tokens or model.max_tokens, model.max_tokens),
    )


def explainer_digest(settings: Settings, model: LoadedModel, method: str) -> str:
    """A digest of the names (within their folder) and bytes of the files ``method``'s scores
    come from: the distilled head, the lexicon table served; "" for a method that reads none.
    The same files give the same digest wherever the model's folder lies."""
    if method == "distilled":
        folder: Path | None = head_dir(model)
    elif method == "lexicon_lookup":
        folder = find_lexicon_dir(model, settings.cache_dir)
    else:
        return ""
    if folder is None or not folder.is_dir():
        return ""
    digest = hashlib.blake2b(digest_size=16)
    for entry in sorted(p for p in folder.iterdir() if p.is_file()):
        digest.update(entry.name.encode() + b"\0")
        with contextlib.suppress(OSError):  # unreadable: the runtime's build says so
            digest.update(entry.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()
