"""The README's Python examples run as they are written, copied into a fresh interpreter with
REDIS_URL pointing at the session's redis-server (as a user with Redis elsewhere would set
it). Every ```python block of README.md is a complete program; one that stops running fails
the suite. (The documentation pages' blocks: tests/test_docs_examples.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from helpers_docs import README, CodeBlock, code_blocks, python_blocks

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    pytest.mark.not_asan(reason="the README's examples run in interpreters of their own"),
    pytest.mark.no_hiredis1(reason="the README's examples run in interpreters of their own"),
]

BLOCKS = [block for block in code_blocks(README) if block.language == "python"]

__all__ = ["python_blocks"]  # the section reader, for tests that run one section's example


@pytest.mark.parametrize("block", BLOCKS, ids=[block.heading.lstrip("# ") for block in BLOCKS])
def test_the_readme_example_runs(block: CodeBlock, redis_url: str, redis_client: redis.Redis,
                                 tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(block.code, encoding="utf-8")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "REDIS_URL": redis_url})
    assert result.returncode == 0, f"{block.name} ({block.heading}):\n{result.stderr}"
    if block.heading == "## Use":
        assert redis_client.zcard("ratelimit:user_8421:60") == 2, "the example never reached Redis"
        assert redis_client.zcard("ratelimit:user_8421:86400") == 1


def test_the_readme_has_its_examples() -> None:
    """The first screen shows a check and a FastAPI route, both run above."""
    assert [block.heading for block in BLOCKS] == ["## Use", "## FastAPI"]
    assert python_blocks("## Quick start") == []
