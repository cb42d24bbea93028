"""The documentation pages' examples run as they are written. Every ```python block of every
page of docs/ is a complete program: it is copied into a fresh interpreter with REDIS_URL
pointing at the session's redis-server (as a user with Redis elsewhere would set it), on a
database flushed before it, and must exit 0. A new page's blocks are found by themselves; a
block that needs more than one redis-server carries a skip mark naming the test that runs it
(tests/helpers_docs.py). TOML and JSON blocks must parse.

Beside the examples, the facts that make the pages a site people can navigate: the README
stays a first screen (at most 200 lines) whose links reach existing pages, "the contract" is
defined once and linked where it is used, and the user guides name no private attribute."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import tomllib

from helpers_docs import DOCS, README, ROOT, CodeBlock, code_blocks, pages

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    pytest.mark.not_asan(reason="the documentation's examples run in interpreters of their own"),
    pytest.mark.no_hiredis1(reason="the documentation's examples run in interpreters of their own"),
]

DOC_PAGES = sorted(DOCS.glob("*.md"))
PYTHON_BLOCKS = [block for page in DOC_PAGES for block in code_blocks(page)
                 if block.language == "python"]
# Pages about the package's inside, for its developers: they may name private modules.
INTERNALS = {"architecture.md", "development.md", "fault-matrix.md", "changelog.md",
             "benchmarks.md"}


def run_block(block: CodeBlock, redis_url: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(block.code, encoding="utf-8")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "REDIS_URL": redis_url})
    assert result.returncode == 0, f"{block.name} ({block.heading}):\n{result.stderr}"


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[block.name for block in PYTHON_BLOCKS])
def test_the_docs_example_runs(block: CodeBlock, redis_url: str, redis_client: redis.Redis,
                               tmp_path: Path) -> None:
    if block.tested_by is not None:
        test_file = ROOT / block.tested_by
        assert test_file.is_file(), f"{block.name}: its skip mark names {block.tested_by}"
        assert block.page.name in test_file.read_text(encoding="utf-8"), (
            f"{block.name}: {block.tested_by} does not read {block.page.name}")
        pytest.skip(f"run by {block.tested_by}")
    run_block(block, redis_url, tmp_path)
    keys = {key.decode() for key in redis_client.keys("*")}
    if block.page.name == "in-flight.md" and block.heading.startswith("## Concurrency"):
        # Every lease was released (no leases key is left, and no lease's start in the hold
        # history, which stays): the script ran, loaded on NOSCRIPT.
        from genai_ratelimit import _native
        assert redis_client.script_exists(_native.LEASE_SHA1) == [True], "never reached Redis"
        assert keys == {"ratelimit:user_8421:leases:stats"}
        assert set(redis_client.hkeys("ratelimit:user_8421:leases:stats")) == {
            b"hold_ms", b"hold_sq", b"holds"}
    elif block.page.name == "tokens.md" and block.heading.startswith("## On the limiter"):
        # It reserved 1,200 tokens and reconciled them to 830.
        for seconds in (60, 86400):
            key = f"ratelimit:user_8421:{seconds}:tokens"
            assert int(redis_client.hget(f"{key}:w", "") or 0) + redis_client.zcard(key) == 830


def test_the_examples_reach_redis(redis_url: str, redis_client: redis.Redis,
                                  tmp_path: Path) -> None:
    """The pages' examples are not dry runs: those that decide leave their entries in the
    session's Redis (one per guide, each from the REDIS_URL it was given)."""
    for page, heading in (("limiter.md", "## Checks and windows"),
                          ("storage.md", "## Sorted sets or one string per window"),
                          ("scopes.md", "## On the limiter: `Scope`")):
        redis_client.flushdb()
        block = next(block for block in PYTHON_BLOCKS
                     if block.page.name == page and block.heading == heading)
        run_block(block, redis_url, tmp_path)
        assert redis_client.keys("ratelimit:user_8421:*"), f"{page}: nothing reached Redis"


def test_every_toml_and_json_block_parses() -> None:
    checked = 0
    for page in pages():
        for block in code_blocks(page):
            if block.language == "toml":
                tomllib.loads(block.code)
            elif block.language == "json":
                json.loads(block.code)
            else:
                continue
            checked += 1
    assert checked >= 2


def test_the_readme_is_a_first_screen_whose_links_reach_pages() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    for command in ("make demo", "make test", "make docs"):
        assert command in text
    links = re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)(#[\w-]+)?\)", text)
    assert len(links) >= 15
    for path, _anchor in links:
        assert (ROOT / path).is_file(), f"README links to {path}, which does not exist"
    for page in DOC_PAGES:   # every page is reachable from the README, or from docs/index.md
        if page.name != "index.md" and f"docs/{page.name}" not in text:
            assert f"({page.name})" in (DOCS / "index.md").read_text(encoding="utf-8"), page.name


def test_the_contract_is_defined_once_and_linked_where_it_is_named() -> None:
    definitions = [page.name for page in DOC_PAGES
                   if "\n## The contract\n" in page.read_text(encoding="utf-8")]
    assert definitions == ["concepts.md"]
    for page in [README, *DOC_PAGES]:
        text = page.read_text(encoding="utf-8")
        if page.name in INTERNALS | {"concepts.md"} or "contract's" not in text:
            continue
        assert "concepts.md#the-contract" in text, f"{page.name} says \"the contract's\" unlinked"


def test_the_user_guides_name_no_private_attribute() -> None:
    private = re.compile(r"(?<![\w.])\w*[./]_[a-z]\w*|`_[a-z]\w*")
    for page in DOC_PAGES:
        if page.name in INTERNALS:
            continue
        found = private.findall(page.read_text(encoding="utf-8"))
        assert not found, f"{page.name} names private attributes: {found}"


def test_the_cli_reference_is_what_help_prints() -> None:
    """docs/cli.md's reference section is the parser's own --help of every command
    (scripts/cli_reference.py --write remakes it), whitespace aside."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import cli_reference
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    page = cli_reference.page_section((DOCS / "cli.md").read_text(encoding="utf-8"))
    assert " ".join(page.split()) == " ".join(cli_reference.section().split()), (
        "docs/cli.md's reference is stale: run .venv/bin/python scripts/cli_reference.py --write")
