"""docs/tokens-and-identity.md: every ```python block runs as it is written, in a fresh
interpreter with REDIS_URL pointing at the session's redis-server, and prints what the page
says it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    pytest.mark.not_asan(reason="the page's examples run in interpreters of their own"),
    pytest.mark.no_hiredis1(reason="the page's examples run in interpreters of their own"),
]

PAGE = Path(__file__).resolve().parent.parent / "docs" / "tokens-and-identity.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", PAGE.read_text(encoding="utf-8"), re.S | re.M)


# What each block prints, in order.
PRINTED = [
    lambda out: out.splitlines()[0].isdigit() and int(out.splitlines()[0]) > 1024 + 250 + 5
    and "max_tokens must be a positive whole number" in out.splitlines()[1],
    lambda out: out.split() == [str(100_000 - 105), str(100_000 - 30_012 - 105)],
    lambda out: out.split() == [str(100_000 - 1_005 * 2), str(100_000 - 9 - 1_005)],
    lambda out: out.splitlines()[:3] == ["2001:db8:1:2::/64", "2001:db8:1:200::/56",
                                         "203.0.113.7 203.0.113.0/24"],
    lambda out: "unix_socket=True" in out,
]


def test_the_page_has_the_blocks_this_test_knows() -> None:
    assert len(python_blocks()) == len(PRINTED)


@pytest.mark.parametrize("index", range(len(PRINTED)))
def test_each_example_runs_and_prints_what_the_page_says(index: int, redis_url: str,
                                                         redis_client: redis.Redis,
                                                         tmp_path: Path) -> None:
    source = python_blocks()[index]
    script = tmp_path / "example.py"
    script.write_text(source, encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "REDIS_URL": redis_url,
                                           "GENAI_RATELIMIT_TIERS": "", "RATE_LIMIT_DISABLED": ""})
    assert done.returncode == 0, done.stderr
    assert PRINTED[index](done.stdout), done.stdout
