"""Reads a Dockerfile as its instructions: for tests/test_wheel_install.py, which replays
examples/Dockerfile in a Debian root, and tests/test_examples_docker.py, which checks it
against examples/compose.yaml. Enough for that file (no parser directives, no heredocs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class Instruction:
    keyword: str
    arguments: str


def dockerfile_instructions(path: Path) -> list[Instruction]:
    """The instructions of a Dockerfile, continuation lines joined, comments dropped."""
    instructions: list[Instruction] = []
    pending = ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).strip().partition(" ")
        instructions.append(Instruction(keyword.upper(), arguments.strip()))
        pending = ""
    return instructions
