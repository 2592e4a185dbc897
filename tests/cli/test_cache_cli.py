"""`limelight cache` and `limelight cache prune` as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from limelight.cli.cache import human
from limelight.demo.recipes import CARD_FILE, demo_model_dir
from limelight.runtimes.graph_cache import write_served_from


def limelight(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "limelight.cli.main", "cache", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LIMELIGHT_CACHE_DIR": str(cache)},
    )


def make_cache(root: Path) -> tuple[Path, Path, Path]:
    demo = demo_model_dir("minilm", root)
    demo.mkdir(parents=True)
    (demo / "model.safetensors").write_bytes(b"w" * 2000)
    (demo / CARD_FILE).write_text("{}")
    earlier = root / "models" / "minilm-aaaaaaaaaaaa"
    earlier.mkdir()
    (earlier / "model.safetensors").write_bytes(b"w" * 3_000_000)
    graph = root / "onnx" / "0123456789abcdef"
    graph.mkdir(parents=True)
    (graph / "limelight.onnx").write_bytes(b"g" * 1500)
    write_served_from(graph, [str(root / "a model directory that is gone")])
    return demo, earlier, graph


def test_list_then_prune(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    demo, earlier, graph = make_cache(root)

    listed = limelight(cache=root)
    assert listed.returncode == 0, listed.stderr
    out = listed.stdout
    assert out.startswith(f"cache: {root} (")
    assert "kind" in out and "size" in out and "why" in out  # a header row
    rows = {line.split()[2]: line for line in out.splitlines() if line.startswith(("demo", "ONNX"))}
    assert "the current minilm recipe" in rows[demo.name]
    assert "3.0 MB" in rows[earlier.name] and "stale" in rows[earlier.name]
    assert "stale" in rows[graph.name] and "gone or changed since" in rows[graph.name]
    assert "2 entries" in out and "`limelight cache prune` removes them" in out

    dry = limelight("prune", "--dry-run", cache=root)
    assert dry.returncode == 0, dry.stderr
    assert f"would remove demo model {earlier}" in dry.stdout
    assert "would remove 2 entries" in dry.stdout
    assert earlier.exists() and graph.exists()

    pruned = limelight("prune", cache=root)
    assert pruned.returncode == 0, pruned.stderr
    assert f"removed ONNX graph {graph}" in pruned.stdout and "removed 2 entries" in pruned.stdout
    assert not earlier.exists() and not graph.exists() and demo.exists()
    assert "nothing to prune" in limelight("--cache-dir", str(root), cache=tmp_path).stdout


def test_an_empty_cache(tmp_path: Path) -> None:
    (tmp_path / "never used").mkdir()  # one that does not exist is said so (below)
    out = limelight(cache=tmp_path / "never used")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"cache: {tmp_path / 'never used'} (0 B)", "empty"]


def test_sizes_read_as_people_write_them() -> None:
    assert [human(n) for n in (0, 999, 48_000, 17_500_000, 1_200_000_000)] == [
        "0 B",
        "999 B",
        "48 kB",
        "17.5 MB",
        "1.2 GB",
    ]


def test_a_cache_directory_that_does_not_exist_is_said_so(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    for action in ((), ("prune",)):
        shown = limelight(*action, "--cache-dir", str(missing), cache=tmp_path / "unused")
        assert shown.returncode == 0, shown.stderr
        assert f"{missing} does not exist" in shown.stdout
        assert "empty" not in shown.stdout
    assert not missing.exists()  # listing creates nothing


def test_a_cache_directory_that_is_a_file_is_refused(tmp_path: Path) -> None:
    taken = tmp_path / "cache.txt"
    taken.write_text("mine")
    shown = limelight("--cache-dir", str(taken), cache=tmp_path / "unused")
    assert shown.returncode == 2
    assert shown.stderr.strip() == (
        f"limelight cache: error: --cache-dir {taken} is a file, not a directory"
    )
    # Named by the environment, the error names the variable.
    shown = limelight("prune", cache=taken)
    assert shown.returncode == 2
    assert "(LIMELIGHT_CACHE_DIR) is a file, not a directory" in shown.stderr
    assert taken.read_text() == "mine"


def test_json_for_scripts(tmp_path: Path) -> None:
    """`--json` (before or after the action) gives what the table says, sizes in bytes; prune
    adds what it removed (or, dry, would remove) and lists what is left."""
    import json

    root = tmp_path / "cache"
    demo, earlier, graph = make_cache(root)
    listed = json.loads(limelight("--json", cache=root).stdout)
    assert listed["cache_dir"] == str(root) and listed["exists"]
    uses = {e["path"]: e["use"] for e in listed["entries"]}
    assert uses[str(earlier)] == uses[str(graph)] == "stale" and uses[str(demo)] != "stale"
    sizes = {e["path"]: e["size"] for e in listed["entries"]}
    assert sizes[str(earlier)] >= 3_000_000 and listed["size"] == sum(sizes.values())

    dry = json.loads(limelight("prune", "--dry-run", "--json", cache=root).stdout)
    assert sorted(e["path"] for e in dry["would_remove"]) == sorted([str(earlier), str(graph)])
    assert earlier.exists() and "removed" not in dry

    pruned = json.loads(limelight("prune", "--json", cache=root).stdout)
    assert sorted(e["path"] for e in pruned["removed"]) == sorted([str(earlier), str(graph)])
    assert [e["path"] for e in pruned["entries"]] == [str(demo)]
    missing = json.loads(limelight("--json", cache=tmp_path / "none").stdout)
    assert missing == {
        "cache_dir": str(tmp_path / "none"),
        "exists": False,
        "size": 0,
        "entries": [],
    }
