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
(a head trained for another model, a half-written file, a file it may not read) is logged and
the server keeps what it serves; a build that raised is tried again on SIGHUP and on later
looks (one poll later, then less and less often), since what fixes it (a ``chmod``, a cache
made writable) need not move a watched file's bytes.

What a rebuild would serve the same way is not rebuilt: a head beside the model while the
served ONNX graph is one the sidecar serves as it is (``onnx_path``, or the graph beside the
model with ``LIMELIGHT_ONNX_EXPORT`` off) is said, not reloaded; nor is a graph written beside
the model that the build does not serve either (the sidecar serving its own export from the
cache): a warning says why it is not served. A default method named in the
settings (``--default-method distilled``) whose head or table went away (or is refused) stays
served with the one loaded before, until one that can be served is back; the other files beside
the model are served as they change.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from limelight.app import Application, build_drift, build_runtime, describe_model
from limelight.core.service import NORMXLOGIT, ExplanationService, resolve_default_method
from limelight.errors import FailedPrecondition, InvalidArgument, LimelightError
from limelight.methods.base import ExtraOutputMethod
from limelight.models.explainer_head import OUTPUT_NAME as HEAD_OUTPUT
from limelight.models.explainer_head import (
    check_card,
    check_head_readable,
    head_dir,
    inline_heads,
    read_card,
)
from limelight.models.lexicon_table import OUTPUT_NAME as LEXICON_OUTPUT
from limelight.models.lexicon_table import (
    cached_lexicon_dir,
    lexicon_dir,
    lexicon_unavailable_reason,
)
from limelight.models.loaded import LoadedModel
from limelight.runtimes.base import Runtime
from limelight.runtimes.lexicon import LexiconRuntime
from limelight.runtimes.onnx_export import graph_mismatch, heads_mismatch
from limelight.runtimes.onnx_runtime import DEFAULT_GRAPH, cached_graph
from limelight.settings import Settings

log = logging.getLogger(__name__)

#: Name, size, modification and status-change time of each file (``st_ctime`` moves with a
#: ``chmod`` or ``chown`` too: a file made readable is looked at again).
Fingerprint = tuple[tuple[str, int, int, int], ...]
#: Longest wait before a build that failed is tried again with no file changed (SIGHUP: at once).
RETRY_MAX_S = 300.0


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


def graph_behind(settings: Settings, model: LoadedModel) -> tuple[Path, str] | None:
    """The graph a build would serve as it is though it does not carry the heads beside the
    model, and why: the one given with ``onnx_path`` (the sidecar never exports over a graph it
    was given), or, with ``onnx_export`` off, the graph beside the model when no graph carries
    those heads. None when a build serves the heads beside the model (or fails: said there)."""
    if settings.runtime != "onnx":
        return None
    heads = inline_heads(model)
    if settings.onnx_path is not None:
        graph = Path(settings.onnx_path)
        why = heads_mismatch(graph, heads) if graph.exists() else ""
        return (graph, why) if why else None
    if settings.onnx_export:
        return None
    beside = model.directory / DEFAULT_GRAPH
    why = graph_mismatch(beside, model, heads)
    if not why or not beside.exists():
        return None
    if not graph_mismatch(cached_graph(model, settings.cache_dir), model, heads):
        return None  # the cache holds one that carries them
    return beside, why


def graph_beside(settings: Settings, model: LoadedModel) -> Path | None:
    """The graph beside the model when it is watched though a build may serve another one (the
    graph it exports into the cache): with ONNX Runtime and no ``onnx_path``."""
    if settings.runtime != "onnx" or settings.onnx_path is not None:
        return None
    return model.directory / DEFAULT_GRAPH


def served_graph(runtime: Runtime) -> Path | None:
    """The ONNX graph ``runtime`` serves, if any."""
    inner = runtime.inner if isinstance(runtime, LexiconRuntime) else runtime
    graph = getattr(inner, "graph", None)
    return None if graph is None else Path(graph)


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


def output_files(settings: Settings, model: LoadedModel, output: str) -> list[Path]:
    """The served files the runtime's extra ``output`` is computed from: the lexicon table's
    for the lookup (a layer around the rest), the head's and the graph's for the others."""
    if output == LEXICON_OUTPUT:
        return _tables(settings, model)
    return [head_dir(model), *_graph(settings, model)]


def keeping(old: Runtime, new: Runtime, output: str) -> Runtime | None:
    """``new``, but computing ``output`` as ``old`` does (None when that cannot be done): the
    lexicon lookup is a table around the rest of the runtime, the rest is the model's pass."""
    if output == LEXICON_OUTPUT:
        if not isinstance(old, LexiconRuntime):
            return None
        return LexiconRuntime(new.inner if isinstance(new, LexiconRuntime) else new, old.table)
    inner = old.inner if isinstance(old, LexiconRuntime) else old
    if output not in inner.head_names:
        return None
    return LexiconRuntime(inner, new.table) if isinstance(new, LexiconRuntime) else inner


def left_out(
    settings: Settings, model: LoadedModel, served: frozenset[str], built: frozenset[str]
) -> list[str]:
    """What a new runtime left out of the ``served`` outputs though its files are still there,
    and why (the build refused them: a head or table made for another model, a card it cannot
    read; or they changed while it read them)."""
    lost = served - built
    found = []
    if HEAD_OUTPUT in lost and (head_dir(model) / "card.json").exists():
        found.append(f"the distilled head in {head_dir(model)} ({_head_reason(model)})")
    tables = [d for d in _tables(settings, model) if (d / "card.json").exists()]
    if LEXICON_OUTPUT in lost and tables:
        reason = lexicon_unavailable_reason(model, settings.cache_dir) or _UNSETTLED
        found.append(f"the lexicon table in {tables[0]} ({reason})")
    return found


_UNSETTLED = "it was not whole when the runtime was built from it: read again when it changes"


def _head_reason(model: LoadedModel) -> str:
    card = read_card(head_dir(model))  # a card cut short: one whose check says so
    return (check_card(card, model) if card is not None else "") or _UNSETTLED


def _entries(paths: list[Path]) -> list[Path]:
    """The files at ``paths``, one level into each directory, in a stable order. A directory
    that cannot be listed (its permissions) stands for its files."""
    found: list[Path] = []
    for path in paths:
        try:
            found.extend(sorted(path.iterdir()) if path.is_dir() else [path])
        except (FileNotFoundError, NotADirectoryError):  # removed meanwhile
            pass
        except OSError:
            found.append(path)
    return found


def fingerprint(paths: list[Path]) -> Fingerprint:
    """Name, size, modification and status-change time of every file at ``paths`` (one level
    into each directory): it changes when one is written, replaced, removed, or has its
    permissions changed."""
    found: list[tuple[str, int, int, int]] = []
    for entry in _entries(paths):
        with contextlib.suppress(OSError):  # absent, or removed between the two calls
            stat = entry.stat()
            found.append((str(entry), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns))
    return tuple(found)


def content_digest(paths: list[Path]) -> str:
    """A digest of the names and bytes of every file at ``paths`` (as :func:`fingerprint` finds
    them): unchanged when a file is only touched or written again with the same bytes. A file
    that cannot be read counts as such (not as absent): once readable, it is a change."""
    digest = hashlib.blake2b(digest_size=16)
    for entry in _entries(paths):
        name = str(entry).encode() + b"\0"
        try:
            f = entry.open("rb")
        except FileNotFoundError:  # removed since it was listed: as the fingerprint has it
            continue
        except OSError as exc:
            digest.update(name + _unreadable(exc))
            continue
        with f:
            digest.update(name)
            try:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
            except OSError as exc:
                digest.update(_unreadable(exc))
            digest.update(b"\0")
    return digest.hexdigest()


def _unreadable(exc: OSError) -> bytes:
    return f"\0unreadable: {type(exc).__name__} {exc.errno}\0".encode()


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

    def looked_again(self, paths: list[Path], fresh: list[Path]) -> FilesSeen:
        """These files as seen, but the ``fresh`` ones among ``paths`` as they are now (what a
        build wrote itself and serves: not a change to reload)."""
        stats: list[tuple[str, int, int, int]] = []
        for path in paths:
            if path in fresh:
                stats.extend(fingerprint([path]))
            else:
                inside = str(path) + os.sep
                stats.extend(e for e in self.stats if e[0] == str(path) or e[0].startswith(inside))
        digests = {**self.digests, **content_digests([p for p in paths if p in fresh])}
        return FilesSeen(tuple(stats), digests)


@dataclass(frozen=True)
class _Failure:
    """A build that raised: what it said, and when it is tried again with no file changed."""

    said: str
    delay_s: float
    retry_at: float


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
        self._failure: _Failure | None = None  # the last build raised: tried again
        self.reloads = 0
        self._checking: asyncio.Lock | None = None  # made in the running loop, at first use

    async def run(self) -> None:
        """Check every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check()

    async def check(self, force: bool = False) -> bool:
        """Reload when the files changed since the last check; whether a new runtime is served.
        After a build that raised, it is tried again though no file moved: with ``force`` (a
        SIGHUP) at once, otherwise once its retry is due. One check at a time: a SIGHUP during
        a poll's reload waits for it, then finds the files already seen instead of building
        the same runtime twice."""
        if self._checking is None:
            self._checking = asyncio.Lock()
        async with self._checking:
            now = fingerprint(self._paths)
            failure = self._failure
            retry = failure is not None and (force or time.monotonic() >= failure.retry_at)
            if now == self._seen.stats and not retry:
                return False
            digests = await asyncio.get_running_loop().run_in_executor(
                None, content_digests, self._paths
            )
            moved = {p for p, d in digests.items() if d != self._seen.digests.get(p)}
            self._seen = FilesSeen(now, digests)
            changed = {p for p, d in digests.items() if d != self._served.get(p)}
            if not changed or not (moved or retry):
                # Touched, written again with the same bytes, or put back as served after a
                # failed build: rebuilding the runtime (and, with its default method's head,
                # the drift reference) would gain nothing.
                if not changed:
                    self._failure = None  # what is served is what is there: nothing to retry
                log.info(
                    "the files beside the model are %s: nothing to reload",
                    "back to what is served" if moved and not changed else "rewritten unchanged",
                )
                return False
            kept = await self._reload(changed)
            if kept is None:
                return False
            # The bytes served now: those read, but where the runtime kept computing an output
            # as before (a head gone that a default named in the settings needs, a graph that
            # carries the earlier head), those it was built from.
            self._served = {**digests, **{p: self._served[p] for p in kept if p in self._served}}
            if self._on_reload is not None:
                await self._on_reload()
            return True

    async def reload(self, changed: set[str] | None = None) -> bool:
        """Build the runtime again and serve it. ``changed``: the served paths whose bytes
        changed (None: unknown, any may have)."""
        return await self._reload(changed) is not None

    async def _reload(self, changed: set[str] | None) -> set[str] | None:
        """:meth:`reload`: None when nothing new is served; else the served paths whose bytes
        the new runtime did not read (it computes their output as the runtime before it)."""
        app, service = self.app, self.app.service
        settings, model = app.settings, app.model
        before = service.default_method.name
        loop = asyncio.get_running_loop()
        changed = {str(p) for p in self._paths} if changed is None else changed
        kept: set[str] = set()
        notes: list[str] = []
        try:
            behind = await loop.run_in_executor(None, graph_behind, settings, model)
            if behind is not None and served_graph(service.runtime) == behind[0]:
                graph, why = behind
                if str(graph) not in changed:
                    # The graph served carries the heads it was exported with: a head beside
                    # the model is served once the graph is exported again.
                    kept = {str(head_dir(model))}
                    if not changed - kept:
                        # Rebuilding would serve the same graph and log a reload that changed
                        # nothing (and start a new drift monitor for nothing).
                        self._failure = None
                        log.warning(
                            "%s; the sidecar keeps serving %s as it is (default method %s%s): "
                            "export it again (`limelight export-onnx --model %s%s`) to serve "
                            "the new head",
                            why,
                            graph,
                            before,
                            "" if settings.onnx_path else "; LIMELIGHT_ONNX_EXPORT is off",
                            model.directory,
                            f" --out {graph}" if settings.onnx_path else "",
                        )
                        return None
                    notes.append(f"{graph} still carries the heads it was exported with")
            named = _named_default(settings, service)
            why, own = "", set()
            if named is not None:
                # A head or table the default method named in the settings needs: without it
                # the sidecar would serve no request that names no method.
                why = await loop.run_in_executor(None, named.check_model, model)
                own = {str(p) for p in output_files(settings, model, named.output)}
                if why and not changed - own - kept:
                    self._failure = None
                    log.warning("%s", _held(why, named))
                    return None
            runtime = await loop.run_in_executor(None, build_runtime, settings, model)
            if HEAD_OUTPUT in service.runtime.head_names - runtime.head_names:
                # The build leaves out a head it cannot read, as a start does (and serves the
                # model without it); the served head cut short by a copy not done, or not
                # readable yet, is a failed build here, tried again, not a head gone.
                await loop.run_in_executor(None, check_head_readable, model)
            if await self._same_graph(runtime, changed - kept, before):
                return None
            if named is not None and named.output not in runtime.head_names:
                held = keeping(service.runtime, runtime, named.output)
                why = why or await loop.run_in_executor(None, named.check_model, model)
                if held is None:
                    self._failure = None
                    log.warning("%s", _held(why or _UNSETTLED, named))
                    return None
                log.warning(
                    "%s; the other files beside the model are reloaded",
                    _held(why or _UNSETTLED, named),
                )
                runtime, kept = held, kept | own
            unserved = left_out(settings, model, service.runtime.head_names, runtime.head_names)
            if unserved:
                # A head or table that is there but not for this model: serving without it
                # would quietly downgrade the default method.
                self._failure = None
                log.error(
                    "%s beside %s could not be served; still serving %s",
                    " and ".join(unserved),
                    model.directory,
                    before,
                )
                return None
            method = resolve_default_method(settings.default_method, runtime)
            # The default method's monitor keeps its window and reference while the files its
            # scores come from are unchanged (NormXLogit reads none; files whose output the new
            # runtime computes as the old one did count as unchanged); a new head or table gets
            # a new monitor (and reference), or drift would report the explainer's change as
            # the traffic's.
            scored = {str(p) for p in method_files(settings, model, method)}
            same = method == before and not scored & (changed - kept)
            try:
                drift = (
                    service.drift
                    if same or method == before == NORMXLOGIT
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
        except Exception as exc:
            self._failed(exc, before)
            return None
        self._failure = None
        self.reloads += 1
        app.metrics.inline_reloads.labels(outcome="reloaded").inc()
        describe_model(app.metrics, model, runtime, method, settings)
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
            return kept
        log.info(
            "reloaded the inline outputs of %s (%s): the default inline method is %s%s%s",
            model.name,
            ", ".join(sorted(runtime.head_names)) or "no extra outputs",
            method,
            f" (was {before})" if method != before else "",
            "".join(f"; {note}" for note in notes),
        )
        return kept

    async def _same_graph(self, runtime: Runtime, changed: set[str], before: str) -> bool:
        """Whether ``runtime`` serves the graph served now and the only ``changed`` file is the
        graph beside the model, which neither serves (said once, in a warning): swapping it in
        would change nothing served, yet log a reload and start a new drift monitor."""
        settings, model = self.app.settings, self.app.model
        beside = graph_beside(settings, model)
        graph = served_graph(self.app.service.runtime)
        if (
            beside is None
            or graph is None
            or graph == beside
            or changed - {str(beside)}
            or served_graph(runtime) != graph
        ):
            return False
        self._failure = None
        if not beside.exists():
            log.info(
                "%s was removed; it was not served (the sidecar serves %s): nothing to reload",
                beside,
                graph,
            )
            return True
        # Why the build did not take it (damaged, another model's, not carrying the heads).
        why = await asyncio.get_running_loop().run_in_executor(
            None, lambda: graph_mismatch(beside, model, inline_heads(model))
        )
        log.warning(
            "%s changed, but it is not served (%s): the sidecar keeps serving %s, its own "
            "export of the model (default method %s); the graph beside the model is served "
            "only when it is an inline graph of this model carrying the heads beside it "
            "(`limelight export-onnx --model %s` writes one)",
            beside,
            why or "the build chose the cached graph",
            graph,
            before,
            model.directory,
        )
        return True

    def _failed(self, exc: Exception, before: str) -> None:
        """Log a build that raised, and set when it is tried again: at the next look, then
        twice as late each time it fails the same way (at most :data:`RETRY_MAX_S`)."""
        said = f"{type(exc).__name__}: {exc}"
        self.app.metrics.inline_reloads.labels(outcome="failed").inc()
        previous = self._failure
        delay = self.interval_s if previous is None else previous.delay_s * 2
        delay = min(delay, max(RETRY_MAX_S, self.interval_s))
        self._failure = _Failure(said, delay, time.monotonic() + delay)
        directory = self.app.model.directory
        when = (
            f"tried again in {delay:g} s, or at once on SIGHUP"
            if self.interval_s > 0
            else "tried again on SIGHUP"
        )
        if previous is not None and previous.said == said:
            log.error(
                "the runtime still cannot be built from the files beside %s (%s); still "
                "serving %s; %s",
                directory,
                said,
                before,
                when,
            )
            return
        if _expected(exc):
            # The message names the file and what to do; a traceback would only bury it.
            log.error(
                "the files beside %s changed, but the runtime could not be built from them "
                "(%s); still serving %s; %s",
                directory,
                said,
                before,
                when,
            )
            return
        log.error(
            "the files beside %s changed, but the runtime could not be built from them; "
            "still serving %s; %s",
            directory,
            before,
            when,
            exc_info=exc,
        )


def _expected(exc: BaseException) -> bool:
    """A failure the files beside the model explain (half-written, unreadable, damaged, made for
    another model), not a bug: safetensors' error by name (its module is torch's business)."""
    if isinstance(exc, OSError | ValueError | LimelightError):
        return True
    return any(cls.__name__ == "SafetensorError" for cls in type(exc).__mro__)


def _named_default(settings: Settings, service: ExplanationService) -> ExtraOutputMethod | None:
    """The default inline method named in the settings (not ``auto``) when it returns an extra
    output that the served runtime computes."""
    if settings.default_method == "auto":
        return None
    try:
        method = service.methods.get(settings.default_method)
    except InvalidArgument:
        return None
    if isinstance(method, ExtraOutputMethod) and method.output in service.runtime.head_names:
        return method
    return None


def _held(why: str, method: ExtraOutputMethod) -> str:
    return (
        f"{why}; the default inline method {method.name} (named in the settings) stays served "
        f"with {method.needs} loaded before, until one beside the model can be served"
    )
