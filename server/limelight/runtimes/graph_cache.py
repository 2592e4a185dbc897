"""The record, in each model version's folder of the ONNX graph cache, of the model
directories served from it: what lets the sidecar (and `limelight cache prune`) tell a graph
still in use from one that nothing serves any more. No torch here: listing the cache reads it."""

from __future__ import annotations

from pathlib import Path

from limelight.files import write_atomically

#: In each model version's folder of the graph cache: the model directories served from it.
SERVED_FROM = "served-from.txt"


def served_from(folder: Path) -> list[str]:
    """The model directories recorded as served from a version's folder of the graph cache."""
    path = folder / SERVED_FROM
    return path.read_text().splitlines() if path.exists() else []


def write_served_from(folder: Path, directories: list[str]) -> None:
    """Replace the record at once (written beside it, then moved into place)."""
    write_atomically(folder / SERVED_FROM, "".join(f"{d}\n" for d in directories))
