#!/usr/bin/env bash
# Builds hiredis 1.x from source into a private prefix, so the extension can be built and
# tested against it (make test-hiredis1) while the system keeps its own hiredis (Debian's
# libhiredis-dev is 0.14).
#
#   bash scripts/build-hiredis1.sh [PREFIX]          build + install (default build/hiredis1/prefix)
#   bash scripts/build-hiredis1.sh check PYTHON [PREFIX]
#                      fails unless the genai_ratelimit._native installed for PYTHON loads
#                      the libhiredis of PREFIX and reports that hiredis's version
#
# Where the source comes from: the `hiredis` Python package's sdist vendors the hiredis C
# library under vendor/hiredis. The sdist is pinned (version and sha256) and fetched with
# pip; the vendored version is read back from its hiredis.h and must be the one expected.
# Nothing of it is committed: it lives under build/ (git-ignored), and `make clean` drops it.
#
# Idempotent: a stamp in the prefix records what was installed; a second run with the same
# pins (and the same script) does nothing.
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.."

# The newest sdist whose vendored hiredis is 1.x (hiredis-py 3.5.0 vendors hiredis 1.5.0).
SDIST_VERSION=3.5.0
SDIST_SHA256=c227592cc56b7df247abe4755c26723965be68972be2149fa441ac33d82131ba
EXPECTED_HIREDIS=1.5.0

PYTHON=${PYTHON:-python3}
CC=${CC:-cc}
DEFAULT_PREFIX="$PWD/build/hiredis1/prefix"

fail() { echo "error: build-hiredis1.sh: $*" >&2; exit 1; }

# Prints "major.minor.patch" from a hiredis.h.
header_version() {
  awk '/^#define HIREDIS_(MAJOR|MINOR|PATCH) /{v[$2]=$3}
       END{if (v["HIREDIS_MAJOR"]=="" || v["HIREDIS_MINOR"]=="" || v["HIREDIS_PATCH"]=="") exit 1;
           print v["HIREDIS_MAJOR"] "." v["HIREDIS_MINOR"] "." v["HIREDIS_PATCH"]}' "$1"
}

build() {
  local prefix=$1
  local work; work=$(dirname "$prefix")
  local stamp="$prefix/.installed"
  # The pins and this script's own text: a change to either rebuilds.
  local want
  want="hiredis-py $SDIST_VERSION (sha256 $SDIST_SHA256) -> hiredis $EXPECTED_HIREDIS, $(sha256sum < "$SELF")"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] &&
     [ -f "$prefix/lib/pkgconfig/hiredis.pc" ] && [ -f "$prefix/include/hiredis/hiredis.h" ]; then
    echo "hiredis $EXPECTED_HIREDIS already installed in $prefix"
    return
  fi

  local downloads="$work/downloads"
  local sdist="$downloads/hiredis-$SDIST_VERSION.tar.gz"
  mkdir -p "$downloads"
  if [ ! -f "$sdist" ] || ! echo "$SDIST_SHA256  $sdist" | sha256sum --check --status; then
    rm -f "$sdist"
    "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps --dest "$downloads" \
      "hiredis==$SDIST_VERSION"
  fi
  [ -f "$sdist" ] || fail "pip did not leave $sdist"
  echo "$SDIST_SHA256  $sdist" | sha256sum --check --status ||
    fail "$sdist does not have the pinned sha256 $SDIST_SHA256"

  local src="$work/src"
  rm -rf "$src" && mkdir -p "$src"
  tar -xzf "$sdist" -C "$src" --strip-components=1
  local vendor="$src/vendor/hiredis"
  [ -f "$vendor/hiredis.h" ] || fail "the sdist has no vendor/hiredis/hiredis.h"
  local version; version=$(header_version "$vendor/hiredis.h") ||
    fail "no HIREDIS_MAJOR/MINOR/PATCH in $vendor/hiredis.h"
  [ "$version" = "$EXPECTED_HIREDIS" ] ||
    fail "hiredis-py $SDIST_VERSION vendors hiredis $version, expected $EXPECTED_HIREDIS"
  # hiredis's own soname (major.minor.patch since 1.1), so it never passes for the system's.
  local soname_version
  soname_version=$(awk '/^#define HIREDIS_SONAME /{print $3}' "$vendor/hiredis.h")
  soname_version=${soname_version:-$version}
  local soname="libhiredis.so.$soname_version"

  # The library as hiredis's own Makefile builds it (no ssl.c: TLS is ours, not hiredis's;
  # dict.c is included by async.c). Asserts stay on: a misuse aborts instead of passing.
  local objdir="$work/obj"
  rm -rf "$objdir" "$prefix" && mkdir -p "$objdir" "$prefix/lib/pkgconfig" "$prefix/include/hiredis"
  local objects=()
  for name in alloc async hiredis net read sds sockcompat; do
    "$CC" -std=c99 -O2 -g -fPIC -D_FILE_OFFSET_BITS=64 -c "$vendor/$name.c" -o "$objdir/$name.o"
    objects+=("$objdir/$name.o")
  done
  "$CC" -shared -Wl,-soname,"$soname" -o "$prefix/lib/$soname" "${objects[@]}"
  ln -sf "$soname" "$prefix/lib/libhiredis.so"
  for header in hiredis.h async.h read.h sds.h alloc.h sockcompat.h; do
    [ -f "$vendor/$header" ] && cp "$vendor/$header" "$prefix/include/hiredis/"
  done
  cp -r "$vendor/adapters" "$prefix/include/hiredis/" 2>/dev/null || true
  cat > "$prefix/lib/pkgconfig/hiredis.pc" <<EOF
prefix=$prefix
libdir=\${prefix}/lib
includedir=\${prefix}/include
pkgincludedir=\${includedir}/hiredis

Name: hiredis
Description: hiredis $version from the hiredis-py $SDIST_VERSION sdist (build-hiredis1.sh)
Version: $version
Libs: -L\${libdir} -lhiredis
Cflags: -I\${pkgincludedir} -I\${includedir} -D_FILE_OFFSET_BITS=64
EOF
  echo "$want" > "$stamp"
  echo "hiredis $version installed in $prefix ($soname)"
}

check() {
  local python prefix=$2
  python="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"   # absolute, the venv's own
  local so; so=$("$python" scripts/native_build.py path)
  local lib; lib=$(ldd "$so" | awk '$1 ~ /^libhiredis\.so/ {print $3}')
  [ -n "$lib" ] || fail "$so does not link libhiredis (ldd: $(ldd "$so" | tr '\n' ' '))"
  case "$(realpath "$lib")" in
    "$(realpath "$prefix")"/lib/*) ;;
    *) fail "$so loads $lib, not the hiredis in $prefix/lib" ;;
  esac
  readelf -d "$so" | grep -E '\((RUNPATH|RPATH)\)' | grep -qF "$prefix/lib" ||
    fail "$so has no RUNPATH to $prefix/lib: $(readelf -d "$so" | grep -E 'R(UN)?PATH' || echo none)"
  local want; want=$(header_version "$prefix/include/hiredis/hiredis.h")
  # Imported from / so that the source tree's genai_ratelimit (no .so) is not the one found.
  local got
  got=$(cd / && "$python" -c 'from genai_ratelimit import _native; print(_native.HIREDIS_VERSION)')
  [ "$got" = "$want" ] || fail "_native.HIREDIS_VERSION is $got, expected $want"
  case "$got" in 1.*) ;; *) fail "_native.HIREDIS_VERSION is $got, not a 1.x" ;; esac
  echo "$so: hiredis $got from $(realpath "$lib")"
}

case "${1:-}" in
  check)
    [ $# -ge 2 ] || fail "usage: $0 check PYTHON [PREFIX]"
    check "$2" "${3:-$DEFAULT_PREFIX}"
    ;;
  *)
    build "${1:-$DEFAULT_PREFIX}"
    ;;
esac
