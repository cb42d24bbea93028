#!/usr/bin/env bash
# Builds, once, the minimal Debian 12 root that `make test-wheel` installs the wheel into:
# debootstrap's minbase variant plus python3 and python3-venv, and nothing else (no compiler,
# no pkg-config, no -dev package, no libhiredis): the machine of a user who has no
# toolchain. tests/debian_root.py runs commands in it without ever writing to it.
#
#   bash scripts/debian-root.sh [DIR]      build into DIR (default build/debian-root)
#   ARCH=arm64 bash scripts/debian-root.sh DIR   an arm64 root (for the aarch64 wheel):
#       debootstrap --foreign, then its second stage run in the root under qemu-user-static
#       (binfmt_misc, mounted here when missing, runs the arm64 binaries)
#
# Mirror: $DEBIAN_MIRROR, else the first mirror of the bookworm suite configured for apt
# (/etc/apt/sources.list, sources.list.d), else http://deb.debian.org/debian.
# Idempotent: a stamp records the suite, the packages and this script's text; a second run
# with the same ones does nothing. The root is built beside DIR and moved into place only
# when debootstrap succeeded, so an interrupted run never leaves a half root that passes.
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.."

SUITE=bookworm
INCLUDE=python3,python3-venv
ROOT=${1:-$PWD/build/debian-root}
ARCH=${ARCH:-$(dpkg --print-architecture)}

fail() { echo "error: debian-root.sh: $*" >&2; exit 1; }

# The first URI of a bookworm source: one-line (.list) and deb822 (.sources) formats.
configured_mirror() {
  local file
  for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$file" ] || continue
    awk -v suite="$SUITE" '$1 == "deb" { for (i = 2; i < NF; i++) if ($i ~ /^https?:/ && $(i + 1) == suite) { print $i; exit } }' "$file"
  done
  for file in /etc/apt/sources.list.d/*.sources; do
    [ -f "$file" ] || continue
    awk -v suite="$SUITE" 'BEGIN { RS = "" }
      { uri = ""; ok = 0; n = split($0, lines, "\n")
        for (i = 1; i <= n; i++) {
          if (lines[i] ~ /^URIs:/) { split(lines[i], w, /[ \t]+/); uri = w[2] }
          if (lines[i] ~ /^Suites:/) { m = split(lines[i], s, /[ \t]+/); for (j = 2; j <= m; j++) if (s[j] == suite) ok = 1 }
        }
        if (ok && uri ~ /^https?:/) { print uri; exit } }' "$file"
  done
}

# Never delete a root that something has mounted into (tests mount only inside mount
# namespaces of their own, so this is a guard against a hand-made mount).
refuse_if_mounted() {
  local dir; dir=$(realpath -m "$1")
  if awk -v d="$dir" '$5 == d || index($5, d "/") == 1 { found = 1 } END { exit !found }' /proc/self/mountinfo; then
    fail "something is mounted under $dir; unmount it first"
  fi
}

want="$SUITE $ARCH minbase +$INCLUDE, $(sha256sum < "$SELF")"
stamp="$ROOT/.debian-root-stamp"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "Debian $SUITE root already in $ROOT"
  exit 0
fi

command -v debootstrap >/dev/null || bash scripts/ensure-debian-packages.sh debootstrap
mirror=${DEBIAN_MIRROR:-$(configured_mirror | head -1)}
mirror=${mirror:-http://deb.debian.org/debian}

partial="$ROOT.partial"
refuse_if_mounted "$ROOT"
refuse_if_mounted "$partial"
rm -rf "$partial"
mkdir -p "$(dirname "$ROOT")"
echo "debootstrap --variant=minbase --include=$INCLUDE $SUITE from $mirror"
started=$(date +%s)
if [ "$ARCH" = "$(dpkg --print-architecture)" ]; then
  debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$partial" "$mirror" \
    > "$ROOT.debootstrap.log" 2>&1 || { tail -20 "$ROOT.debootstrap.log" >&2; fail "debootstrap failed (log: $ROOT.debootstrap.log)"; }
else
  command -v qemu-aarch64-static >/dev/null || bash scripts/ensure-debian-packages.sh qemu-user-static binfmt-support
  [ -f /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  [ -f /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
  debootstrap --arch="$ARCH" --foreign --variant=minbase --include="$INCLUDE" "$SUITE" "$partial" "$mirror" \
    > "$ROOT.debootstrap.log" 2>&1 || { tail -20 "$ROOT.debootstrap.log" >&2; fail "debootstrap --foreign failed (log: $ROOT.debootstrap.log)"; }
  chroot "$partial" /debootstrap/debootstrap --second-stage >> "$ROOT.debootstrap.log" 2>&1 \
    || { tail -20 "$ROOT.debootstrap.log" >&2; fail "debootstrap's second stage failed (log: $ROOT.debootstrap.log)"; }
fi
rm -f "$partial"/var/cache/apt/archives/*.deb   # the downloaded packages: 60 MB nobody reads
echo "$want" > "$partial/.debian-root-stamp"
rm -rf "$ROOT"
mv "$partial" "$ROOT"
echo "Debian $SUITE root in $ROOT ($(du -sh "$ROOT" | cut -f1), $(( $(date +%s) - started )) s)"
