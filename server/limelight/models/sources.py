"""Where a served model comes from: a local directory, or a Hugging Face model id found in the
local Hugging Face cache.

Limelight never downloads at run time: an id resolves only to a snapshot already in the cache
(``huggingface_hub.snapshot_download(..., local_files_only=True)``, the same lookup as with
``HF_HUB_OFFLINE=1``). The cache is ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``, read when the model is loaded. Fetch ahead with the hub's CLI
(``hf download org/name``); in Kubernetes, mount a volume holding the cache and point
``HF_HUB_CACHE`` at it (docs/deploy.md).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from limelight.errors import ModelLoadError

#: ``name``, ``org/name`` or either with ``@revision`` (a branch, tag or commit hash).
_HUB_ID = re.compile(
    r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9_.\-]*(?:/[A-Za-z0-9][A-Za-z0-9_.\-]*)?)"
    r"(?:@(?P<revision>[A-Za-z0-9_.\-/]+))?$"
)
DEPLOY_DOC = "docs/deploy.md#models-from-the-hugging-face-cache"


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: the directory to load and the name to serve it under."""

    path: Path
    name: str
    hub_id: str | None = None
    """The Hugging Face model id it was resolved from (None for a directory)."""


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, as the hub's own tools find it (read now, not at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def parse_hub_id(source: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``source`` reads as a model id rather than a path."""
    if source.startswith((".", "/", "~")) or (os.sep != "/" and os.sep in source):
        return None
    match = _HUB_ID.match(source)
    if match is None or source.endswith((".json", ".safetensors")):
        return None
    return match["repo"], match["revision"]


def resolve_model_source(source: str | Path, cache_dir: Path | None = None) -> ModelSource:
    """A local directory as is; otherwise a model id looked up in the Hugging Face cache.

    A path that exists always wins. Anything that cannot be a model id is returned as a path
    (``check_model_directory`` then says what is wrong with it). ``cache_dir`` overrides the
    hub cache (tests)."""
    path = Path(source).expanduser()
    if path.exists():
        return ModelSource(path, path.resolve().name)
    parsed = parse_hub_id(str(source))
    if parsed is None:
        return ModelSource(path, path.name)
    repo_id, revision = parsed
    cache = cache_dir or hub_cache_dir()
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = snapshot_download(
            repo_id, revision=revision, cache_dir=cache, local_files_only=True
        )
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        at = f"@{revision}" if revision else ""
        fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
        raise ModelLoadError(
            f"--model {source}: no such directory, and model {repo_id}{at} is not in the "
            f"Hugging Face cache {cache} (Limelight never downloads); fetch it ahead with "
            f"`{fetch}` (HF_HUB_CACHE or HF_HOME choose the cache), or in Kubernetes mount "
            f"a volume holding the cache and set HF_HUB_CACHE to it ({DEPLOY_DOC})"
        ) from None
    return ModelSource(Path(snapshot), repo_id.rsplit("/", 1)[-1], repo_id)
