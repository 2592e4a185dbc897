"""Writing a file that another process may be reading: a running sidecar reloads heads, tables
and graph records when they change on disk, and must see the old file or the new one whole."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, data: bytes | str) -> None:
    """Write ``data`` beside ``path`` and move it into place (a rename within the folder is
    atomic); a write that fails leaves the old file and no partial one."""
    path = Path(path)
    partial = path.with_name(f".{os.getpid()}.{path.name}")
    try:
        if isinstance(data, str):
            partial.write_text(data, encoding="utf-8")
        else:
            partial.write_bytes(data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
