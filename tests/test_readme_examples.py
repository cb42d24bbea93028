"""The README's Python examples run as they are written, copied into a fresh interpreter with
REDIS_URL pointing at the session's redis-server (as a user with Redis elsewhere would set
it). A section listed here whose example stops running fails the suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    pytest.mark.not_asan(reason="the README's examples run in interpreters of their own"),
    pytest.mark.no_hiredis1(reason="the README's examples run in interpreters of their own"),
]

README = Path(__file__).resolve().parent.parent / "README.md"

# The sections whose ```python blocks are complete programs.
SECTIONS = ["## Use", "### Weights, tokens, reserve → reconcile",
            "### Scopes: upstream caps, route and model budgets",
            "### Upstream caps, route and model budgets",
            "### Error formats, provider headers and retry hints",
            "### Concurrency: in-flight leases",
            "### Shadow mode: roll a new budget out without refusing",
            "### IETF `RateLimit-Policy` and `RateLimit` headers"]


def python_blocks(heading: str) -> list[str]:
    """The ```python blocks of one section (up to the next heading of its level or above;
    lines inside fences are never headings)."""
    level = len(heading.split(" ")[0])
    blocks: list[str] = []
    inside = fenced = False
    block: list[str] | None = None
    for line in README.read_text(encoding="utf-8").splitlines():
        if not fenced and line.startswith("#"):
            marks = len(line) - len(line.lstrip("#"))
            if line == heading:
                inside = True
                continue
            if inside and marks <= level and line[marks:marks + 1] == " ":
                break
        if line.startswith("```"):
            if fenced:
                if block is not None:
                    blocks.append("\n".join(block) + "\n")
                fenced, block = False, None
            else:
                fenced = True
                block = [] if inside and line == "```python" else None
            continue
        if block is not None:
            block.append(line)
    return blocks


@pytest.mark.parametrize("heading", SECTIONS)
def test_the_readme_example_runs(heading: str, redis_url: str, redis_client: redis.Redis,
                                 tmp_path: Path) -> None:
    blocks = python_blocks(heading)
    assert blocks, f"README.md has no python example under {heading!r}"
    for number, block in enumerate(blocks):
        script = tmp_path / f"example_{number}.py"
        script.write_text(block, encoding="utf-8")
        result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                                text=True, timeout=60,
                                env={**os.environ, "REDIS_URL": redis_url})
        assert result.returncode == 0, f"{heading} example {number}:\n{result.stderr}"
    if "leases" in heading:
        # Every lease was released (no key is left): the script ran, loaded on NOSCRIPT.
        from genai_ratelimit import _native
        assert redis_client.script_exists(_native.LEASE_SHA1) == [True], "never reached Redis"
        assert redis_client.keys("ratelimit:user_8421:*") == []
        return
    assert redis_client.keys("ratelimit:user_8421:*"), "the example never reached Redis"
    if "reserve" in heading:
        # It reserved 1,200 tokens and reconciled them to 830.
        for seconds in (60, 86400):
            key = f"ratelimit:user_8421:{seconds}:tokens"
            assert int(redis_client.hget(f"{key}:w", "") or 0) + redis_client.zcard(key) == 830
