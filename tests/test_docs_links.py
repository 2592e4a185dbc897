"""Links between the project's Markdown files land: the file exists and so does the heading.

Moving a section to another file, or renaming a heading, silently breaks the links that point at
it; GitHub renders them as plain dead links.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [
        ROOT / "README.md",
        *ROOT.glob("docs/**/*.md"),
        *ROOT.glob("bench/*.md"),
        *ROOT.glob("k8s/**/*.md"),
    ]
)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]*)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)


def prose(text: str) -> str:
    """The page without its fenced code blocks (a `# comment` in a shell block is no heading)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: Counter[str] = Counter()
    found = set()
    for heading in HEADING.findall(prose(page.read_text())):
        base = slug(heading)
        found.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return found


def local_links(page: Path) -> list[tuple[str, str]]:
    """(path, anchor) of each link to a file of this repository or a heading of one."""
    out = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        out.append((path, anchor))
    return out


def test_slugs_follow_github() -> None:
    assert slug("5. Alerts") == "5-alerts"
    assert slug("Idle latency (issue #14), busy machine") == "idle-latency-issue-14-busy-machine"
    assert slug("`limelight bench` and **ONNX**") == "limelight-bench-and-onnx"
    page = ROOT / "docs" / "deploy.md"
    assert "5-alerts" in anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_land(page: Path) -> None:
    broken = []
    for path, anchor in local_links(page):
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{path}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{path}#{anchor}: no such heading in {target.relative_to(ROOT)}")
    assert not broken, broken
