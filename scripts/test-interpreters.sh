#!/usr/bin/env bash
# `make test-interpreters`: the ONE abi3 wheel that `make wheel` left in WHEEL_DIR, installed
# into a fresh venv of each CPython given (pyenv's), and part of the suite run there.
#
#   bash scripts/test-interpreters.sh WHEEL_DIR VENV_PARENT "3.10 3.12 3.13" [pytest args...]
#
# Each version is the newest ~/.pyenv/versions/<version>.* (or $PYENV_ROOT's). Its venv is
# VENV_PARENT/<version>: made once, the test extra's requirements installed into it once, the
# wheel reinstalled every run (--force-reinstall --no-deps: the wheel given, not a cached one).
# pytest runs from the venv's own script in the repository's root, so the source tree (which
# holds no extension) is never what `import genai_ratelimit` finds: a check says where it
# comes from first. Every interpreter runs even when one failed; the script fails when any did.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEEL_DIR=$1 VENV_PARENT=$2 VERSIONS=$3
shift 3
PYENV_VERSIONS=${PYENV_ROOT:-$HOME/.pyenv}/versions

fail() { echo "error: test-interpreters.sh: $*" >&2; exit 1; }

wheels=("$WHEEL_DIR"/genai_ratelimit-*-cp310-abi3-manylinux_*_x86_64.whl)
[ ${#wheels[@]} -eq 1 ] && [ -f "${wheels[0]}" ] || fail "expected one x86-64 abi3 wheel in $WHEEL_DIR: ${wheels[*]}"
wheel=$(realpath "${wheels[0]}")

status=0
table=()
for version in $VERSIONS; do
  interpreter=$(ls -d "$PYENV_VERSIONS/$version".* 2>/dev/null | sort -V | tail -1)
  [ -n "$interpreter" ] && [ -x "$interpreter/bin/python3" ] || fail "no CPython $version under $PYENV_VERSIONS"
  venv=$(realpath -m "$VENV_PARENT/$version")
  started=$(date +%s)
  echo "=== CPython $version ($interpreter) in $venv"
  if [ ! -f "$venv/.created" ] || [ "$(cat "$venv/.created")" != "$interpreter" ]; then
    rm -rf "$venv"
    "$interpreter/bin/python3" -m venv "$venv" || fail "venv of $version"
    "$venv/bin/python" -m pip install -q --upgrade pip || fail "pip of $version"
    echo "$interpreter" > "$venv/.created"
  fi
  # The test extra's requirements from the wheel's own metadata (pip resolves [test]), then the
  # wheel itself again without its dependencies, so a rebuilt wheel of the same version wins.
  "$venv/bin/python" -m pip install -q "$wheel[test]" || fail "pip install of the wheel on $version"
  "$venv/bin/python" -m pip install -q --force-reinstall --no-deps "$wheel" || fail "reinstall on $version"
  (cd / && "$venv/bin/python" -c 'import sys, genai_ratelimit._native as n
print("CPython", sys.version.split()[0], "imports", n.__file__)
assert n.__file__.endswith("_native.abi3.so") and "/site-packages/" in n.__file__, n.__file__') \
    || fail "the wheel's extension does not import on $version"
  "$venv/bin/pytest" -p no:cacheprovider "$@" 2>&1 | tee "$venv/pytest.log"
  result=${PIPESTATUS[0]}
  [ "$result" -eq 0 ] || status=1
  closing=$(grep -E '^=+ .*(passed|failed|error|no tests ran).* =+$' "$venv/pytest.log" | tail -1)
  table+=("$(printf 'CPython %-5s %4ss  exit %s  %s' "$version" $(( $(date +%s) - started )) "$result" "$closing")")
done
echo
echo "=== test-interpreters: $(basename "$wheel")"
printf '%s\n' "${table[@]}"
exit $status
