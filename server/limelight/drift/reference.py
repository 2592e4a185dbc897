"""Drift reference files: a versioned JSON profile of a model's attributions on a dataset."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from limelight.drift.profile import Profile
from limelight.errors import FailedPrecondition

log = logging.getLogger(__name__)

FORMAT = "limelight-drift-reference"
VERSION = 1
NORMALISATION = "lowercase-strip-word-start-v1"
"""Token normalisation the profile was built with (see ``normalise_token``)."""


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

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "normalisation": NORMALISATION,
            "created_at": self.created_at,
            "model": {"name": self.model_name, "version": self.model_version},
            "labels": list(self.labels),
            "method": self.method,
            "source": self.source,
            "profile": self.profile.to_json(),
        }

    def save(self, path: Path) -> None:
        """Write atomically (temp file + rename), so a reader never sees half a file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)

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
        )
