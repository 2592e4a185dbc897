"""Serving what is written beside the model after the sidecar loaded it.

A distilled head (`limelight distill`), a lexicon table (`limelight lexicon`) or an ONNX graph
(`limelight export-onnx`) may be written while a sidecar serves the model: by the user, by a
Kubernetes job on a shared volume, or by the demo build finishing in the background. The
reloader looks at those files every ``reload_interval_s`` (a few ``stat`` calls), and at once on
SIGHUP (``kill -HUP``: whoever wrote the files need not wait for the next look), and, when their
bytes changed (a moved ``stat`` is checked against a digest of the bytes: a file touched or
written again unchanged is not a new head), builds the runtime again off the event loop and
swaps it in between two batches with the default method and the drift monitor that go with it
(a new monitor only when the default method or the files its scores come from changed; with
``runtime=onnx``, building the runtime exports a graph that carries the new head into the
cache: not a watched file, so the export does not trigger a second reload). A build that fails
(a head trained for another model, a half-written file) is logged and the server keeps what it
serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from limelight.app import Application, build_drift, build_runtime, describe_model
from limelight.core.service import NORMXLOGIT, resolve_default_method
from limelight.errors import FailedPrecondition
from limelight.models.explainer_head import OUTPUT_NAME as HEAD_OUTPUT
from limelight.models.explainer_head import head_dir, inline_heads
from limelight.models.lexicon_table import OUTPUT_NAME as LEXICON_OUTPUT
from limelight.models.lexicon_table import cached_lexicon_dir, lexicon_dir
from limelight.models.loaded import LoadedModel
from limelight.runtimes.onnx_export import heads_mismatch
from limelight.runtimes.onnx_runtime import DEFAULT_GRAPH
from limelight.settings import Settings

log = logging.getLogger(__name__)

Fingerprint = tuple[tuple[str, int, int], ...]


def served_files(settings: Settings, model: LoadedModel) -> list[Path]:
    """The files (or directories of files) a runtime is built from, besides the model's weights."""
    return [head_dir(model), *_tables(settings, model), *_graph(settings, model)]


def _tables(settings: Settings, model: LoadedModel) -> list[Path]:
    return [lexicon_dir(model), cached_lexicon_dir(model, settings.cache_dir)]


def _graph(settings: Settings, model: LoadedModel) -> list[Path]:
    """The ONNX graph, when served."""
    if settings.runtime != "onnx":
        return []
    return [Path(settings.onnx_path or model.directory / DEFAULT_GRAPH)]


def pinned_graph_behind(settings: Settings, model: LoadedModel) -> str:
    """Why the graph the sidecar was told to serve (``onnx_path``) does not carry the heads
    beside the model, or "". The sidecar never exports over a graph it was given, so a new
    head is served only once that graph is exported again."""
    if settings.runtime != "onnx" or settings.onnx_path is None:
        return ""
    return heads_mismatch(Path(settings.onnx_path), inline_heads(model))


def method_files(settings: Settings, model: LoadedModel, method: str) -> list[Path]:
    """The served files ``method``'s scores come from: none for NormXLogit, the head for the
    distilled explainer, the tables for the lexicon lookup (and, with ONNX Runtime, the graph,
    which carries them); every served file for a method not known here."""
    if method == NORMXLOGIT:
        return []
    if method == "distilled":
        return [head_dir(model), *_graph(settings, model)]
    if method == "lexicon_lookup":
        return [*_tables(settings, model), *_graph(settings, model)]
    return served_files(settings, model)


def left_out(
    settings: Settings, model: LoadedModel, served: frozenset[str], built: frozenset[str]
) -> list[str]:
    """What a new runtime left out of the ``served`` outputs though its files are still there
    (the build refused them: a head or table made for another model, a card it cannot read)."""
    lost = served - built
    found = []
    if HEAD_OUTPUT in lost and (head_dir(model) / "card.json").exists():
        found.append(f"the distilled head in {head_dir(model)}")
    tables = [d for d in _tables(settings, model) if (d / "card.json").exists()]
    if LEXICON_OUTPUT in lost and tables:
        found.append(f"the lexicon table in {tables[0]}")
    return found


def _entries(paths: list[Path]) -> list[Path]:
    """The files at ``paths``, one level into each directory, in a stable order."""
    found: list[Path] = []
    for path in paths:
        with contextlib.suppress(OSError):  # absent, or removed meanwhile
            found.extend(sorted(path.iterdir()) if path.is_dir() else [path])
    return found


def fingerprint(paths: list[Path]) -> Fingerprint:
    """Name, size and modification time of every file at ``paths`` (one level into each
    directory): it changes when one is written, replaced or removed."""
    found: list[tuple[str, int, int]] = []
    for entry in _entries(paths):
        with contextlib.suppress(OSError):  # absent, or removed between the two calls
            stat = entry.stat()
            found.append((str(entry), stat.st_size, stat.st_mtime_ns))
    return tuple(found)


def content_digest(paths: list[Path]) -> str:
    """A digest of the names and bytes of every file at ``paths`` (as :func:`fingerprint` finds
    them): unchanged when a file is only touched or written again with the same bytes."""
    digest = hashlib.blake2b(digest_size=16)
    for entry in _entries(paths):
        with contextlib.suppress(OSError), entry.open("rb") as f:
            digest.update(str(entry).encode() + b"\0")
            while chunk := f.read(1 << 20):
                digest.update(chunk)
            digest.update(b"\0")
    return digest.hexdigest()


def content_digests(paths: list[Path]) -> dict[str, str]:
    """:func:`content_digest` of each of ``paths`` on its own."""
    return {str(path): content_digest([path]) for path in paths}


@dataclass(frozen=True)
class FilesSeen:
    """What the reloader last saw of the served files: their fingerprint (a few ``stat`` calls,
    read at every look) and the digest of each path's bytes (read only when the fingerprint
    moved)."""

    stats: Fingerprint
    digests: dict[str, str]

    @classmethod
    def of(cls, paths: list[Path]) -> FilesSeen:
        return cls(fingerprint(paths), content_digests(paths))


class InlineReloader:
    """Swaps in a runtime built from the files beside the model when they change."""

    def __init__(
        self,
        app: Application,
        interval_s: float,
        seen: FilesSeen | None = None,
        on_reload: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``seen``: the files as they were before ``app`` was built from them (default: now).
        ``on_reload``: awaited after each new runtime is served (the server's health)."""
        self.app = app
        self._on_reload = on_reload
        self.interval_s = interval_s
        self._paths = served_files(app.settings, app.model)
        self._seen = FilesSeen.of(self._paths) if seen is None else seen
        # The bytes the served runtime was built from: unlike ``_seen``, not moved by a build
        # that failed, so files put back as they were after one are no change to what is served.
        self._served = dict(self._seen.digests)
        self.reloads = 0
        self._checking: asyncio.Lock | None = None  # made in the running loop, at first use

    async def run(self) -> None:
        """Check every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check()

    async def check(self) -> bool:
        """Reload when the files changed since the last check; whether a new runtime is served.
        One check at a time: a SIGHUP during a poll's reload waits for it, then finds the files
        already seen instead of building the same runtime twice."""
        if self._checking is None:
            self._checking = asyncio.Lock()
        async with self._checking:
            now = fingerprint(self._paths)
            if now == self._seen.stats:
                return False
            digests = await asyncio.get_running_loop().run_in_executor(
                None, content_digests, self._paths
            )
            moved = {p for p, d in digests.items() if d != self._seen.digests.get(p)}
            self._seen = FilesSeen(now, digests)  # a failed build is tried again on the next change
            changed = {p for p, d in digests.items() if d != self._served.get(p)}
            if not moved or not changed:
                # Touched, written again with the same bytes, or put back as served after a
                # failed build: rebuilding the runtime (and, with its default method's head,
                # the drift reference) would gain nothing.
                log.info(
                    "the files beside the model are %s: nothing to reload",
                    "rewritten unchanged" if not moved else "back to what is served",
                )
                return False
            reloaded = await self.reload(changed)
            if reloaded:
                self._served = digests
                if self._on_reload is not None:
                    await self._on_reload()
            return reloaded

    async def reload(self, changed: set[str] | None = None) -> bool:
        """Build the runtime again and serve it. ``changed``: the served paths whose bytes
        changed (None: unknown, any may have)."""
        app, service = self.app, self.app.service
        settings, model = app.settings, app.model
        before = service.default_method.name
        loop = asyncio.get_running_loop()
        try:
            behind = await loop.run_in_executor(None, pinned_graph_behind, settings, model)
            if behind:
                # Rebuilding would serve the same graph and log a reload that changed nothing.
                log.warning(
                    "%s; the sidecar keeps serving %s as it is (default method %s): export it "
                    "again (`limelight export-onnx --model %s --out %s`) to serve the new head",
                    behind,
                    settings.onnx_path,
                    before,
                    model.directory,
                    settings.onnx_path,
                )
                return False
            runtime = await loop.run_in_executor(None, build_runtime, settings, model)
            unserved = left_out(settings, model, service.runtime.head_names, runtime.head_names)
            if unserved:
                # A head or table that is there but not for this model (logged as it was left
                # out): serving without it would quietly downgrade the default method.
                log.error(
                    "%s beside %s could not be served (see the warning above); still serving %s",
                    " and ".join(unserved),
                    model.directory,
                    before,
                )
                return False
            method = resolve_default_method(settings.default_method, runtime)
            # The default method's monitor keeps its window and reference while the files its
            # scores come from are unchanged (NormXLogit reads none); a new head or table gets
            # a new monitor (and reference), or drift would report the explainer's change as
            # the traffic's.
            own = {str(p) for p in method_files(settings, model, method)}
            kept = method == before and changed is not None and not own & changed
            try:
                drift = (
                    service.drift
                    if kept or method == before == NORMXLOGIT
                    else build_drift(settings, model, app.metrics, method)
                )
            except FailedPrecondition as exc:
                if method == before:
                    # The reference file is gone or unreadable: the new head is served all the
                    # same, judged by a reference of the first requests.
                    log.warning("%s; the reference is built from the first requests instead", exc)
                    unfiled = settings.model_copy(update={"drift_reference": None})
                    drift = build_drift(unfiled, model, app.metrics, method)
                else:
                    # A drift reference file of the method served so far: the new outputs are
                    # served to requests that name them, the default (and its monitor) stays.
                    log.warning("%s; the default inline method stays %s", exc, before)
                    method, drift = before, service.drift
            lost = sorted(service.runtime.head_names - runtime.head_names)
            await service.swap_runtime(runtime, drift, default_method=method)
        except Exception:
            log.exception(
                "the files beside %s changed, but the runtime could not be built from them; "
                "still serving %s",
                model.directory,
                before,
            )
            return False
        self.reloads += 1
        describe_model(app.metrics, model, runtime, method)
        if lost:
            # Outputs that went away (deleted, pruned, a folder moved): worth an operator's
            # look, unlike a head that came or changed.
            log.warning(
                "%s beside %s %s gone%s; the default inline method is %s%s",
                " and ".join(lost),
                model.directory,
                "is" if len(lost) == 1 else "are",
                "" if model.directory.is_dir() else " (the model's directory itself is gone)",
                method,
                f" (was {before})" if method != before else "",
            )
            return True
        log.info(
            "reloaded the inline outputs of %s (%s): the default inline method is %s%s",
            model.name,
            ", ".join(sorted(runtime.head_names)) or "no extra outputs",
            method,
            f" (was {before})" if method != before else "",
        )
        return True
