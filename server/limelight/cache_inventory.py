"""What the cache directory holds, and which of it nothing serves any more.

Every demo recipe, model version and exported graph leaves a folder in ``LIMELIGHT_CACHE_DIR``
that later ones do not replace: a demo model whose recipe changed is built again beside the old
one, and each new version of a served model gets its own ONNX graph (and, for a read-only model
directory, its own lexicon table). The sidecar prunes the graphs it can prove unused as it
starts; ``limelight cache`` lists everything, and ``limelight cache prune`` removes what is
stale:

- a demo model built from an earlier recipe of its name (nothing builds or serves it again);
- a graph folder whose record of the model directories served from it lists only directories
  that are gone or whose weights changed since.

A graph or lexicon folder with no record of its user (graphs exported before the record was
kept; lexicon tables, which keep none) is in use when its version is that of a cached demo
model, and otherwise unknown: another model served from this cache may still need it, so prune
removes it only when asked to (``--unrecorded``). Nothing held by a build or export lock is
removed, nor anything a running sidecar, worker or CLI command uses (they hold a shared lock on
their model's demo build, graph and lexicon table: ``limelight.locks.InUse``).
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from limelight.demo.recipes import CARD_FILE, DEMO_NAMES, DemoBuildError, demo_model_dir
from limelight.locks import IN_USE_SUFFIX, held_elsewhere, in_use_lock
from limelight.models.fingerprint import fingerprint
from limelight.runtimes.graph_cache import served_from


class Use(enum.Enum):
    """Whether something in the cache is still needed."""

    IN_USE = "in use"
    STALE = "stale"  # prune removes it
    UNRECORDED = "unrecorded"  # prune removes it with --unrecorded
    BUSY = "busy"  # a build or export holds its lock right now


@dataclass(frozen=True)
class Entry:
    kind: str
    """``demo model``, ``ONNX graph``, ``lexicon table``, ``jobs journal`` or ``unreadable jobs
    journal``."""
    path: Path
    size: int
    """Bytes on disk (the files' sizes)."""
    use: Use
    why: str
    """Why it is or is not needed, for a person to read."""


def inventory(cache_dir: Path) -> list[Entry]:
    """Everything the sidecar keeps in ``cache_dir``, each with whether it is still needed."""
    cache_dir = Path(cache_dir).expanduser()
    demos = _demo_models(cache_dir)
    demo_versions = _versions_of([e.path for e in demos if e.use is not Use.STALE])
    # A graph served only from demo builds that prune removes goes in the same pass.
    pruned = {e.path.resolve() for e in demos if e.use is Use.STALE and not _used(e.path)}
    graphs = [_graph(folder, demo_versions, pruned) for folder in _folders(cache_dir / "onnx")]
    lexicons = [_lexicon(folder, demo_versions) for folder in _folders(cache_dir / "lexicons")]
    journal = cache_dir / "jobs.sqlite3"
    jobs = (
        [Entry("jobs journal", journal, _size(journal), Use.IN_USE, "the embedded job store")]
        if journal.exists()
        else []
    )
    unreadable = [
        Entry(
            "unreadable jobs journal",
            aside,
            sum(_size(f) for f in _with_wal(aside)),
            Use.STALE,
            "moved aside as unreadable when the sidecar started (it began an empty journal); "
            "kept only to recover from it (`sqlite3 FILE .recover`)",
        )
        for aside in sorted(cache_dir.glob("jobs.sqlite3.corrupt-*[0-9]Z"))
    ]
    return [_kept_while_used(e) for e in (*demos, *graphs, *lexicons)] + [*jobs, *unreadable]


def prune(entries: Iterable[Entry], unrecorded: bool = False) -> list[Entry]:
    """Remove the stale entries (and with ``unrecorded`` the unrecorded ones); returns them.
    Locks are looked at again just before each removal: a build may have started since."""
    removed = []
    for entry in entries:
        if entry.use is Use.STALE or (unrecorded and entry.use is Use.UNRECORDED):
            if _locked(entry):
                continue
            if entry.path.is_dir():
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                for path in _with_wal(entry.path):
                    path.unlink(missing_ok=True)
            if entry.kind == "demo model":  # its build log and progress files
                for leftover in entry.path.parent.glob(f".{entry.path.name}.*"):
                    if leftover.is_file() and not held_elsewhere(leftover):
                        leftover.unlink(missing_ok=True)
            else:
                in_use_lock(entry.path).unlink(missing_ok=True)
            removed.append(entry)
    return removed


def sweep_marks(cache_dir: Path) -> int:
    """Remove the in-use marks (empty lock files) of folders that do not exist, which no
    process holds: each process marks its model's graph and lexicon folders whether or not it
    ever makes them. Returns how many went."""
    swept = 0
    for kind in ("models", "onnx", "lexicons"):
        for mark in (Path(cache_dir).expanduser() / kind).glob(f".*{IN_USE_SUFFIX}"):
            folder = mark.with_name(mark.name[1 : -len(IN_USE_SUFFIX)])
            if not folder.exists() and not held_elsewhere(mark):
                mark.unlink(missing_ok=True)
                swept += 1
    return swept


def _with_wal(database: Path) -> list[Path]:
    """An SQLite file and its write-ahead log files, those that exist."""
    return [
        p
        for p in (database.with_name(database.name + s) for s in ("", "-wal", "-shm"))
        if p.exists()
    ]


#: The recipe part of a demo build's folder name.
_RECIPE = re.compile(r"[0-9a-f]{12}")


def _demo_models(cache_dir: Path) -> list[Entry]:
    current: dict[str, str] = {}
    unknown: set[str] = set()  # demos whose current recipe cannot be worked out here
    for demo in DEMO_NAMES:
        try:
            current[demo_model_dir(demo, cache_dir).name] = demo
        except DemoBuildError:  # a recipe names its data packages' versions: not installed
            unknown.add(demo)
    entries = []
    for folder in _folders(cache_dir / "models"):
        name, _, recipe = folder.name.rpartition("-")
        if not _RECIPE.fullmatch(recipe):
            # A demo build's folder is "<demo>-<12 hex digits of its recipe>"; anything else
            # ("bert-tiny-sst2", a user's model kept here) is no build of ours.
            name = ""
        size = _size(folder)
        if _locked_demo(folder):
            use, why = Use.BUSY, "being built right now"
        elif folder.name in current:
            complete = (folder / CARD_FILE).exists()
            use, why = Use.IN_USE, f"the current {name} recipe" + ("" if complete else " (partial)")
        elif name in unknown:
            use, why = (
                Use.IN_USE,
                (
                    f"a {name} build; its recipe cannot be checked without the demo's data "
                    "packages (not installed here): left alone"
                ),
            )
        elif name in DEMO_NAMES:
            use, why = Use.STALE, f"an earlier recipe of {name}: nothing builds or serves it again"
        else:
            use, why = Use.IN_USE, "not a demo model of this version of Limelight: left alone"
        entries.append(Entry("demo model", folder, size, use, why))
    return entries


def _graph(folder: Path, demo_versions: Callable[[], dict[str, Path]], pruned: set[Path]) -> Entry:
    """``pruned``: the (resolved) demo builds that prune removes: users that do not count."""
    size, version = _size(folder), folder.name
    if held_elsewhere(folder / ".export.lock"):
        return Entry("ONNX graph", folder, size, Use.BUSY, "being exported right now")
    listed = [Path(d) for d in served_from(folder)]
    if listed:
        users = [d for d in listed if d.is_dir() and fingerprint(d) == version]
        staying = [d for d in users if d.resolve() not in pruned]
        if staying:
            return Entry("ONNX graph", folder, size, Use.IN_USE, _served(staying))
        if users:
            return Entry(
                "ONNX graph",
                folder,
                size,
                Use.STALE,
                f"{_served(users)}, an earlier demo recipe that prune removes with it",
            )
        return Entry(
            "ONNX graph",
            folder,
            size,
            Use.STALE,
            f"{_served(listed)}, {'gone' if len(listed) == 1 else 'each gone'} or changed since",
        )
    return _by_version("ONNX graph", folder, size, demo_versions)


def _lexicon(folder: Path, demo_versions: Callable[[], dict[str, Path]]) -> Entry:
    return _by_version("lexicon table", folder, _size(folder), demo_versions)


def _by_version(
    kind: str, folder: Path, size: int, demo_versions: Callable[[], dict[str, Path]]
) -> Entry:
    demo = demo_versions().get(folder.name)
    if demo is not None:
        return Entry(kind, folder, size, Use.IN_USE, f"version of the demo model {demo.name}")
    return Entry(
        kind,
        folder,
        size,
        Use.UNRECORDED,
        "no record of the model it belongs to, and no cached demo model has its version",
    )


def _served(directories: list[Path]) -> str:
    shown = ", ".join(str(d) for d in directories[:2])
    more = f" and {len(directories) - 2} more" if len(directories) > 2 else ""
    return f"served from {shown}{more}"


def _versions_of(directories: list[Path]) -> Callable[[], dict[str, Path]]:
    """The demo models' versions, hashed only if a folder without a record asks for them."""

    @cache
    def versions() -> dict[str, Path]:
        return {fingerprint(d): d for d in directories}

    return versions


def _locked(entry: Entry) -> bool:
    if _used(entry.path):
        return True
    if entry.kind == "demo model":
        return _locked_demo(entry.path)
    return held_elsewhere(entry.path / ".export.lock")


def _used(folder: Path) -> bool:
    """A running process (sidecar, worker, CLI command) uses ``folder`` right now."""
    return held_elsewhere(in_use_lock(folder))


def _kept_while_used(entry: Entry) -> Entry:
    """``entry`` as listed: what prune would remove is in use while a process uses it."""
    if entry.use in (Use.STALE, Use.UNRECORDED) and _used(entry.path):
        return Entry(
            entry.kind,
            entry.path,
            entry.size,
            Use.IN_USE,
            f"a running sidecar, worker or command uses it ({entry.why})",
        )
    return entry


def _locked_demo(folder: Path) -> bool:
    """A build of this model or of its heads holds one of the locks beside it."""
    return any(
        held_elsewhere(lock)
        for lock in folder.parent.glob(f".{folder.name}*.lock")
        if not lock.name.endswith(IN_USE_SUFFIX)
    )


def _folders(root: Path) -> list[Path]:
    """The entries' folders: hidden ones are staging folders, locks and logs."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # removed while we looked
                total += (Path(folder) / name).lstat().st_size
    return total
