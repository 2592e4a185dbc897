"""Drift reference files: a versioned JSON profile of a model's attributions on a dataset."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from limelight.drift.profile import Profile
from limelight.errors import FailedPrecondition
from limelight.files import write_atomically

log = logging.getLogger(__name__)

FORMAT = "limelight-drift-reference"
VERSION = 1
NORMALISATION = "lowercase-strip-word-start-v1"
"""Token normalisation the profile was built with (see ``normalise_token``)."""


@dataclass(frozen=True)
class ServedIdentity:
    """What a sidecar's inline attributions come from besides the traffic: a reference built
    from anything else differs from them on the same texts."""

    model_version: str = ""
    """Fingerprint of the model's weights and config."""
    explainer_digest: str = ""
    """Digest of the files the method's scores come from (a distilled head, a lexicon table;
    "" for NormXLogit, which reads none)."""
    thresholds: tuple[float, ...] | None = None
    """Multi-label: the label thresholds predictions are made at (None: single-label)."""
    max_tokens: int | None = None
    """The token limit per text (None: the model's own)."""


@dataclass
class ReferenceFile:
    """A reference profile with where it came from."""

    profile: Profile
    labels: list[str]
    model_name: str = ""
    model_version: str = ""
    """Fingerprint of the model's weights and config (``limelight.models.loaded.fingerprint``)."""
    method: str = "normxlogit"
    source: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    served: ServedIdentity | None = None
    """What the attributions were computed with (None: a file from before it was recorded;
    only its model version is known)."""

    def model_difference(self, model_version: str) -> list[str]:
        """How the model this reference was built with differs from ``model_version``."""
        if self.model_version and model_version and model_version != self.model_version:
            return [f"model version {self.model_version} (serving {model_version})"]
        return []

    def differences(self, served: ServedIdentity) -> list[str]:
        """How what this reference was built from differs from ``served`` (what a file does not
        record is not compared)."""
        out = self.model_difference(served.model_version)
        mine = self.served
        if mine is None:  # a file from before the rest was recorded
            if served.explainer_digest:
                out.append(f"{self.method} files it does not record (an older reference file)")
            return out
        if mine.explainer_digest != served.explainer_digest:
            out.append(
                f"other {self.method} files (digest {mine.explainer_digest or 'none'}; serving "
                f"{served.explainer_digest or 'none'})"
            )
        if mine.thresholds != served.thresholds:
            out.append(f"label thresholds {mine.thresholds} (serving {served.thresholds})")
        if mine.max_tokens != served.max_tokens:
            out.append(
                f"max_tokens {mine.max_tokens or 'the model limit'} (serving "
                f"{served.max_tokens or 'the model limit'})"
            )
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "normalisation": NORMALISATION,
            "created_at": self.created_at,
            "model": {"name": self.model_name, "version": self.model_version},
            "labels": list(self.labels),
            "method": self.method,
            **({} if self.served is None else {"served": _served_json(self.served)}),
            "source": self.source,
            "profile": self.profile.to_json(),
        }

    def save(self, path: Path) -> None:
        """Write atomically (temp file + rename), so a reader never sees half a file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> ReferenceFile:
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FailedPrecondition(f"drift reference {path} does not exist") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FailedPrecondition(f"drift reference {path} is unreadable: {exc}") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise FailedPrecondition(f"{path} is not a Limelight drift reference")
        if data.get("version") != VERSION:
            raise FailedPrecondition(
                f"{path} has reference format version {data.get('version')}; this Limelight "
                f"reads version {VERSION} (rebuild it with `limelight drift-reference build`)"
            )
        if data.get("normalisation") != NORMALISATION:
            raise FailedPrecondition(
                f"{path} was built with token normalisation {data.get('normalisation')!r}; "
                "rebuild it with this Limelight"
            )
        try:
            profile = Profile.from_json(data["profile"])
            model = data.get("model") or {}
            labels = [str(x) for x in data["labels"]]
            served = _served_of(data["served"]) if "served" in data else None
        except (KeyError, TypeError, ValueError) as exc:
            raise FailedPrecondition(f"drift reference {path} is malformed: {exc}") from exc
        if list(profile.label_counts) != labels:
            raise FailedPrecondition(f"drift reference {path}: profile labels differ from labels")
        return cls(
            profile=profile,
            labels=labels,
            model_name=str(model.get("name", "")),
            model_version=str(model.get("version", "")),
            method=str(data.get("method", "")),
            source=dict(data.get("source") or {}),
            created_at=float(data.get("created_at", 0.0)),
            served=served,
        )


def _served_json(served: ServedIdentity) -> dict[str, Any]:
    return {
        "explainer_digest": served.explainer_digest,
        "thresholds": None if served.thresholds is None else list(served.thresholds),
        "max_tokens": served.max_tokens,
    }


def _served_of(data: Any) -> ServedIdentity:
    thresholds = data["thresholds"]
    max_tokens = data["max_tokens"]
    return ServedIdentity(
        explainer_digest=str(data["explainer_digest"]),
        thresholds=None if thresholds is None else tuple(float(x) for x in thresholds),
        max_tokens=None if max_tokens is None else int(max_tokens),
    )
