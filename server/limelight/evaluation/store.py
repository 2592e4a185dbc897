"""Stored attributions: an evaluation keeps the expensive explainers' answers beside its report.

SHAP or LIME at 500 evaluations, converged Shapley values and greedy searches take seconds per
text, and the same references are read again and again: after a head is retrained, when an
interrupted run is started over, when another sample overlaps this one. ``limelight eval``
therefore writes each such attribution to ``<out>/attributions/`` as it is computed, one JSON
line per text, and a later run with the same ``--out`` reads them back instead of recomputing
(``--fresh`` recomputes and replaces them). An answer is reused only for the same method with
the same parameters on the same model version (the weights' content hash), the same token ids
and the same explained class, under the same Limelight and peer-package versions; anything else
is a different file or a different line. The time recorded with an answer is the time it took
when computed, so the report's "ms / expl." stays the explainer's cost, not the file's.

Cheap explainers (the inline methods: one forward pass) are not stored: they are recomputed,
and they read files a retrained head replaces.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from limelight import __version__
from limelight.core.types import Encoded, FloatArray
from limelight.evaluation.runner import Explainer

FOLDER = "attributions"
"""The store's folder inside an evaluation's output folder."""


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def input_key(enc: Encoded, target: int) -> str:
    """What an attribution is of: the token ids (and segment ids) and the explained class."""
    return _digest([list(enc.input_ids), list(enc.token_type_ids or []), int(target)])[:32]


@dataclass
class StoredExplainer:
    """An explainer whose answers are appended to a JSON-lines file and read back from it.

    ``timed`` returns the scores and the seconds they took when they were computed; the
    evaluator uses it instead of timing the call (a stored answer takes microseconds)."""

    explain: Explainer
    path: Path
    reuse: bool = True
    reused: int = 0
    """Answers read back from the file (computed by an earlier run)."""
    repeated: int = 0
    """Answers to a text (the same tokens and class) met again in this run: its first answer."""
    computed: int = 0
    _known: dict[str, tuple[list[float], float]] | None = field(default=None, repr=False)
    _computed_now: set[str] = field(default_factory=set, repr=False)

    def _load(self) -> dict[str, tuple[list[float], float]]:
        if self._known is None:
            self._known = {}
            if self.reuse and self.path.exists():
                for line in self.path.read_text(encoding="utf-8").splitlines():
                    try:
                        entry = json.loads(line)
                        key, scores, seconds = entry["input"], entry["scores"], entry["seconds"]
                    except (ValueError, KeyError, TypeError):
                        continue  # the header, or a line cut short by an interrupted run
                    self._known[str(key)] = ([float(s) for s in scores], float(seconds))
        return self._known

    def timed(self, enc: Encoded, target: int) -> tuple[FloatArray, float]:
        key = input_key(enc, target)
        known = self._load().get(key)
        if known is not None and len(known[0]) == len(enc):
            if key in self._computed_now:
                self.repeated += 1
            else:
                self.reused += 1
            return np.asarray(known[0], dtype=np.float32), known[1]
        start = time.perf_counter()
        scores = np.asarray(self.explain(enc, target), dtype=np.float32)
        seconds = time.perf_counter() - start
        self.computed += 1
        values = [float(s) for s in scores]
        line = {"input": key, "scores": values, "seconds": seconds}
        # One write per line in append mode: a run cut short loses at most its last line.
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(line) + "\n")
        self._load()[key] = (values, seconds)
        self._computed_now.add(key)
        return scores, seconds

    def __call__(self, enc: Encoded, target: int) -> FloatArray:
        return self.timed(enc, target)[0]

    def summary(self, name: str) -> str | None:
        """A note for the report when answers were reused, else None."""
        total = self.reused + self.repeated + self.computed
        parts = []
        if self.reused:
            parts.append(
                f"{self.reused} of {total} attributions read from {self.path} (computed by an "
                "earlier run; their times are the recorded ones)"
            )
        if self.repeated:
            # A dataset may hold the same text twice: its second answer is its first one.
            parts.append(
                f"{self.repeated}{'' if self.reused else f' of {total}'} attribution"
                f"{'s' if self.repeated != 1 else ''} of a text that occurs again in this run "
                "(the same tokens and class): its first answer, with its time, reused"
            )
        return f"{name}: " + "; ".join(parts) if parts else None


@dataclass(frozen=True)
class AttributionStore:
    """Where an evaluation keeps its expensive attributions: ``<out>/attributions/``, one file
    per method, parameters and model version."""

    folder: Path
    model_version: str
    reuse: bool = True
    """False: recompute every attribution (``--fresh``); the new answers replace the old
    ones for later runs."""

    def wrap(self, method: str, params: Mapping[str, Any], explain: Explainer) -> StoredExplainer:
        """``explain`` with its answers stored under a key of everything that decides them."""
        key = {
            "method": method,
            "params": dict(params),
            "model": self.model_version,
            "limelight": __version__,
        }
        name = f"{method}-{_digest(key)[:12]}.jsonl"
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / name
        if not self.reuse:
            path.unlink(missing_ok=True)  # the answers computed now replace these
        if not path.exists():
            path.write_text(json.dumps({"key": key}) + "\n", encoding="utf-8")
        else:
            end_cut_line(path)
        return StoredExplainer(explain, path, reuse=self.reuse)


def end_cut_line(path: Path) -> None:
    """End the file's last line where a killed run cut it short (as the distillation's label
    cache does): the next answer appended would otherwise join it, and both be lost."""
    with path.open("rb+") as handle:
        size = handle.seek(0, os.SEEK_END)
        if size == 0:
            return
        handle.seek(size - 1)
        if handle.read(1) != b"\n":
            handle.write(b"\n")  # at the end: the read left the position there


def reuse_notes(explainers: Mapping[str, Explainer], names: Sequence[str]) -> list[str]:
    """The report's notes on attributions read from the store, in method order."""
    notes = []
    for name in names:
        explainer = explainers.get(name)
        if isinstance(explainer, StoredExplainer):
            note = explainer.summary(name)
            if note:
                notes.append(note)
    return notes
