"""Reads the memcheck logs of `make test-valgrind` (one per process: forked children write
their own) and prints what they found. Exits 1 when a process had memory errors left after
the suppressions, or when a block definitely lost was allocated with our extension on the
stack (genai_ratelimit/_native*.so, csrc/*.c). Definite leaks that only CPython or the test
tools allocated are listed as CPython's, not counted against us.

  python scripts/valgrind_report.py build/valgrind/memcheck.*.log
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# The extension (_native.abi3.so: the stable-ABI build) or a frame in one of csrc/'s files.
CSRC_FILES = sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "csrc").glob("*.c"))
OURS = re.compile(r"_native\.(?:abi3|cpython)|/csrc/|\((?:" + "|".join(CSRC_FILES) + r")\.c:\d+\)")
RECORD_START = re.compile(r"^==\d+== (\S[^\n]* are definitely lost in loss record [\d,]+ of [\d,]+)$")
ERROR_SUMMARY = re.compile(r"ERROR SUMMARY: ([\d,]+) errors from ([\d,]+) contexts")
COMMAND = re.compile(r"^==\d+== Command: (.*)$")


def leak_records(lines: list[str]) -> list[tuple[str, list[str]]]:
    """(headline, stack lines) of every 'definitely lost' loss record."""
    records = []
    i = 0
    while i < len(lines):
        match = RECORD_START.match(lines[i])
        if match is None:
            i += 1
            continue
        stack = []
        i += 1
        while i < len(lines) and re.match(r"^==\d+==\s+(at|by) ", lines[i]):
            stack.append(lines[i].split("== ", 1)[1].strip())
            i += 1
        records.append((match.group(1), stack))
    return records


def main(paths: list[str]) -> int:
    if not paths:
        print("valgrind_report: no memcheck logs given", file=sys.stderr)
        return 1
    failed = False
    processes = 0
    cpython_leaks = 0
    for path in sorted(paths):
        text = Path(path).read_text(errors="replace")
        lines = text.splitlines()
        command = next((m.group(1) for m in map(COMMAND.match, lines) if m), "?")
        summary = ERROR_SUMMARY.findall(text)
        if not summary:
            continue  # a fork child that exec'd another program: nothing was checked
        processes += 1
        errors = int(summary[-1][0].replace(",", ""))
        if errors:
            failed = True
            print(f"{path}: {errors} memory errors ({command})")
            # Print the error reports themselves (everything before the heap summary).
            body = text.split("HEAP SUMMARY", 1)[0]
            print("\n".join(line for line in body.splitlines()[6:] if line.strip("=0123456789 ")))
        for headline, stack in leak_records(lines):
            if any(OURS.search(frame) for frame in stack):
                failed = True
                print(f"{path}: LEAK in genai_ratelimit._native: {headline}")
                print("    " + "\n    ".join(stack))
            else:
                cpython_leaks += 1
    print(f"valgrind: {processes} processes checked; "
          f"{'FAILED' if failed else 'no memory errors, no definite leak from the extension'}"
          f"; {cpython_leaks} definite-leak records from CPython/test tools, ignored")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
