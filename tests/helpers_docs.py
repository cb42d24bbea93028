"""The code blocks of README.md and of the documentation pages (docs/*.md), read the way the
tests run them: every ```python block is a complete program.

A block that cannot run on the session's single redis-server is marked on the line right
above its fence with `<!-- docs-test: skip: tested by tests/<file>.py ... -->`: the named test
runs it (against a Redis Cluster, say), and test_docs_examples checks that the file exists and
reads that page."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
SKIP_MARK = re.compile(r"^<!-- docs-test: skip: tested by (tests/[\w/]+\.py)\b.*-->$")


@dataclass(frozen=True)
class CodeBlock:
    page: Path      # the Markdown file
    line: int       # the line of the opening fence (1-based)
    language: str   # the fence's info string ("python", "sh", "" ...)
    heading: str    # the heading the block is under ("" before the first)
    code: str       # the block's text, without the fences
    tested_by: str | None  # a skip mark's test file, else None

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """README.md and every page of docs/, in a stable order."""
    return [README, *sorted(DOCS.glob("*.md"))]


def code_blocks(page: Path) -> list[CodeBlock]:
    """Every fenced block of a page. A fence may be indented (a block inside a list item): its
    lines lose that indentation."""
    return _scan(page)[0]


def headings(page: Path) -> list[tuple[int, str]]:
    """(line, text) of every heading of a page (lines inside fences are never headings)."""
    return _scan(page)[1]


def _scan(page: Path) -> tuple[list[CodeBlock], list[tuple[int, str]]]:
    blocks: list[CodeBlock] = []
    found: list[tuple[int, str]] = []
    heading = ""
    lines = page.read_text(encoding="utf-8").splitlines()
    fence: tuple[int, str, int, str | None] | None = None  # (line, language, indent, tested_by)
    body: list[str] = []
    previous = ""
    for number, line in enumerate(lines, start=1):
        stripped = line.lstrip()
        if fence is None:
            if stripped.startswith("```"):
                mark = SKIP_MARK.match(previous.strip())
                fence = (number, stripped[3:].strip(), len(line) - len(stripped),
                         mark.group(1) if mark else None)
                body = []
            elif re.match(r"^#{1,6} ", line):
                heading = line
                found.append((number, line))
            if line.strip():
                previous = line
            continue
        if stripped.strip() == "```":
            start, language, indent, tested_by = fence
            blocks.append(CodeBlock(page, start, language, heading,
                                    "\n".join(text[indent:] for text in body) + "\n", tested_by))
            fence, previous = None, ""
            continue
        body.append(line)
    assert fence is None, f"{page.name}: the fence opened on line {fence[0]} is never closed"
    return blocks, found


def python_blocks(heading: str, page: Path = README) -> list[str]:
    """The ```python blocks of one section of a page: from that heading to the next heading of
    its level or above."""
    level = len(heading.split(" ")[0])
    starts = [line for line, text in headings(page) if text == heading]
    assert len(starts) == 1, f"{page.name} has {len(starts)} headings {heading!r}"
    ends = [line for line, text in headings(page)
            if line > starts[0] and len(text.split(" ")[0]) <= level]
    end = ends[0] if ends else 1 << 30
    return [block.code for block in code_blocks(page)
            if starts[0] < block.line < end and block.language == "python"]
