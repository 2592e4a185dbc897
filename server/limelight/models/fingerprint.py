"""A model directory's version: a content hash of its weights and config. It names the caches
and binds the heads, graphs and tables built for one model (no torch here: listing the cache
reads it)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


def fingerprint(model_dir: Path) -> str:
    """Content hash of the weights and config: binds caches and heads to one model. Shards
    (``model-00001-of-00002.safetensors``) are hashed whole too: fine-tuned weights keep every
    shard's size, and a version from names and sizes kept serving the old weights' graph."""
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        path = model_dir / name
        if path.exists():
            _hash_file(digest, path)
    for shard in sorted(model_dir.glob("model-*.safetensors")):
        digest.update(shard.name.encode())
        _hash_file(digest, shard)
    return digest.hexdigest()[:16]


def _hash_file(digest: hashlib._Hash, path: Path) -> None:
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)


class ModelIdentity(Protocol):
    """What binds a head, graph or table to one model: its directory and its fingerprint. A
    loaded model is one; :class:`ModelFiles` is one without loading the weights."""

    @property
    def directory(self) -> Path: ...

    @property
    def version(self) -> str: ...


@dataclass(frozen=True)
class ModelFiles:
    """A model directory and its fingerprint, read from the files alone: enough to find what
    was built for the model (a start that only checks whether its head is current)."""

    directory: Path
    version: str

    @classmethod
    def of(cls, model_dir: Path) -> ModelFiles:
        model_dir = model_dir.resolve()  # as load_model names it
        return cls(model_dir, fingerprint(model_dir))
