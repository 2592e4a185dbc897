"""A model directory's version: a content hash of its weights and config. It names the caches
and binds the heads, graphs and tables built for one model (no torch here: listing the cache
reads it)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def fingerprint(model_dir: Path) -> str:
    """Content hash of the weights and config: binds caches and heads to one model."""
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        path = model_dir / name
        if path.exists():
            with path.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(chunk)
    for shard in sorted(model_dir.glob("model-*.safetensors")):
        digest.update(shard.name.encode())
        digest.update(str(shard.stat().st_size).encode())
    return digest.hexdigest()[:16]
