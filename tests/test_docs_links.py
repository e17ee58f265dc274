"""README.md and docs/ point at things that exist: every relative link and `#anchor` resolves,
every `make` target named is in the Makefile, every benchmark script and saved result named is in
the repository, and no path leads outside it. Docs were split and moved more than once; a link left behind is found here, not
by a reader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
MAKE = re.compile(r"(?:^|`)make ([a-z][a-z0-9-]*)", re.M)
REPO_FILE = re.compile(r"\bbenchmarks/(?:results/[\w.-]*\w|\w+\.py)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces
    to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors a page's headings make, with GitHub's `-1`, `-2` suffixes for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(FENCE.sub("", text)):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return out


def broken_links(page: Path) -> list[str]:
    """The relative links of `page` (outside code blocks) whose file or anchor is missing."""
    bad = []
    for m in LINK.finditer(FENCE.sub("", page.read_text())):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page.resolve()
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{target}: no heading makes #{anchor}")
    return bad


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.M))


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_targets_and_files_exist(page: Path) -> None:
    text = page.read_text()
    missing_targets = sorted(set(MAKE.findall(text)) - make_targets())
    missing_files = sorted({f for f in REPO_FILE.findall(text) if not (ROOT / f).exists()})
    assert (missing_targets, missing_files) == ([], [])


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_paths_outside_the_repository(page: Path) -> None:
    """A reader has the repository, not the machine the docs were written on."""
    assert re.findall(r"\.\./shared\b|(?<![\w.])/work/\S*", page.read_text()) == []


def test_checker_finds_what_is_broken(tmp_path: Path) -> None:
    """The checks above can fail: a missing file, a missing anchor, a repeated heading's suffix."""
    (tmp_path / "other.md").write_text("# Title\n\n## Two words: `code`\n\n## Again\n## Again\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[a](other.md#two-words-code) [b](other.md#again-1) [c](https://x.io/y#z)\n"
        "[d](gone.md) [e](other.md#nowhere) [f](#title)\n"
        "```\n[g](inside-a-fence.md)\n```\n"
    )
    assert broken_links(page) == [
        "gone.md: no such file",
        "other.md#nowhere: no heading makes #nowhere",
        "#title: no heading makes #title",
    ]
    assert slug("Planning ahead (`--plan-ahead N`)") == "planning-ahead---plan-ahead-n"
