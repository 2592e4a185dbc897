"""`limelight cache`: what the cache directory holds, and `prune` for what nothing needs."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from limelight.cli.common import EXIT_USAGE, fail

if TYPE_CHECKING:
    from limelight.cache_inventory import Entry


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "cache",
        help="list what the cache directory holds; prune what nothing serves any more",
        description="Demo models of earlier recipes and the ONNX graphs of earlier model "
        "versions stay in the cache directory (LIMELIGHT_CACHE_DIR) until removed. `limelight "
        "cache` lists every entry with its size and whether it is still needed; `limelight "
        "cache prune` removes the stale ones. Nothing that a build or an export holds is "
        "removed.",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    listing = actions.add_parser(
        "list", help="every entry, its size and whether it is needed (default)"
    )
    prune = actions.add_parser("prune", help="remove the stale entries")
    for parser in (p, listing, prune):  # before or after the action
        parser.add_argument(
            "--cache-dir",
            type=Path,
            default=argparse.SUPPRESS,
            help="the cache directory (default: LIMELIGHT_CACHE_DIR, else ~/.cache/limelight)",
        )
        parser.add_argument(
            "--json",
            action="store_true",
            default=argparse.SUPPRESS,
            help="print JSON: the entries (kind, path, size in bytes, use, why) and, for "
            "prune, what was removed",
        )
    prune.add_argument(
        "--dry-run", action="store_true", help="say what would be removed, remove nothing"
    )
    prune.add_argument(
        "--unrecorded",
        action="store_true",
        help="also remove graphs and lexicon tables with no record of their model and no "
        "cached demo model of their version (a model served from this cache that is not "
        "running now may need them: it rebuilds them at its next start; what a running "
        "sidecar uses is kept)",
    )
    for parser in (p, listing, prune):
        parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from limelight.cache_inventory import inventory, prune, sweep_marks
    from limelight.settings import Settings

    given = getattr(args, "cache_dir", None)
    settings = Settings(**({"cache_dir": given} if given else {}))
    root = Path(settings.cache_dir).expanduser()
    named = f"--cache-dir {root}" if given else f"the cache directory {root} (LIMELIGHT_CACHE_DIR)"
    if root.exists() and not root.is_dir():
        return fail(args, f"{named} is a file, not a directory", EXIT_USAGE)
    as_json = bool(getattr(args, "json", False))
    pruning = getattr(args, "action", None) == "prune"
    if not root.exists():
        # Nothing cached yet (or a misspelt path): say so rather than list it as empty.
        if as_json:
            print(_json(root, [], [] if pruning else None, dry_run=False))
            return 0
        what = "nothing to prune" if pruning else "nothing cached"
        print(f"cache: {root} does not exist: {what}")
        return 0
    entries = inventory(root)
    if not pruning:
        print(_json(root, entries, None, dry_run=False) if as_json else listing(root, entries))
        return 0
    unrecorded = bool(args.unrecorded)
    if args.dry_run:
        chosen = [e for e in entries if _prunable(e, unrecorded)]
        verb = "would remove"
    else:
        chosen = prune(entries, unrecorded=unrecorded)
        sweep_marks(root)  # empty files: not worth a line
        verb = "removed"
    if as_json:
        after = entries if args.dry_run else inventory(root)
        print(_json(root, after, chosen, dry_run=bool(args.dry_run)))
        return 0
    for entry in chosen:
        print(f"{verb} {entry.kind} {entry.path} ({human(entry.size)}): {entry.why}")
    print(f"{verb} {_count(chosen)}, {human(sum(e.size for e in chosen))}")
    return 0


def _json(
    root: Path, entries: Sequence[Entry], pruned: Sequence[Entry] | None, *, dry_run: bool
) -> str:
    """``--json``: the entries as they are now and, for prune, those it removed (or, with
    ``--dry-run``, would remove)."""
    import json

    def entry(e: Entry) -> dict[str, object]:
        return {
            "kind": e.kind,
            "path": str(e.path),
            "size": e.size,
            "use": e.use.value,
            "why": e.why,
        }

    out: dict[str, object] = {
        "cache_dir": str(root),
        "exists": root.is_dir(),
        "size": sum(e.size for e in entries),
        "entries": [entry(e) for e in entries],
    }
    if pruned is not None:
        out["would_remove" if dry_run else "removed"] = [entry(e) for e in pruned]
    return json.dumps(out, indent=2)


def listing(root: Path, entries: Sequence[Entry]) -> str:
    """The table ``limelight cache`` prints, and what prune would do."""
    from limelight.cache_inventory import Use

    total = sum(e.size for e in entries)
    lines = [f"cache: {root} ({human(total)})"]
    if not entries:
        return "\n".join([*lines, "empty"])
    rows = [(e.kind, e.path.name, human(e.size), e.use.value, e.why) for e in entries]
    header = ("kind", "name", "size", "use", "why")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    lines.append("")
    for row in [header, *rows]:
        cells = [row[i].ljust(widths[i]) if i != 2 else row[i].rjust(widths[i]) for i in range(4)]
        lines.append("  ".join([*cells, row[4]]).rstrip())
    stale = [e for e in entries if e.use is Use.STALE]
    unknown = [e for e in entries if e.use is Use.UNRECORDED]
    lines.append("")
    if stale:
        lines.append(
            f"{_count(stale)} ({human(sum(e.size for e in stale))}) nothing needs any more: "
            "`limelight cache prune` removes them (--dry-run to see the list first)"
        )
    if unknown:
        lines.append(
            f"{_count(unknown)} ({human(sum(e.size for e in unknown))}) of no recorded model: "
            "`limelight cache prune --unrecorded` removes them too"
        )
    if not stale and not unknown:
        lines.append("nothing to prune")
    return "\n".join(lines)


def _prunable(entry: Entry, unrecorded: bool) -> bool:
    from limelight.cache_inventory import Use

    return entry.use is Use.STALE or (unrecorded and entry.use is Use.UNRECORDED)


def _count(entries: Sequence[Entry]) -> str:
    return f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"


def human(size: int) -> str:
    """Bytes as a person reads them: 512 B, 48 kB, 17.5 MB, 1.2 GB."""
    value = float(size)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit in ("B", "kB") else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")
