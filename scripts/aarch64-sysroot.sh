#!/usr/bin/env bash
# `make wheel ARCH=aarch64`: the cross compiler (gcc-aarch64-linux-gnu, with its glibc for
# arm64) and a sysroot of Debian 12's arm64 packages that the extension builds against:
# hiredis, libuuid, OpenSSL (their -dev packages and the libraries), and the Python headers
# of libpython3.11-dev (their pyconfig.h is aarch64's). The arm64 packages are downloaded with
# `apt-get download` and unpacked into the sysroot with dpkg-deb -x: nothing of the machine's
# own (amd64) packages changes. Needs `dpkg --add-architecture arm64` (done here, once).
#
#   bash scripts/aarch64-sysroot.sh [DIR]     build into DIR (default build/aarch64-sysroot)
#
# Idempotent: a stamp records this script's text; a second run does nothing.
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.."

SYSROOT=${1:-$PWD/build/aarch64-sysroot}
PACKAGES="libhiredis-dev libhiredis0.14 uuid-dev libuuid1 libssl-dev libssl3 libpython3.11-dev
          libpython3.11 libpython3.11-stdlib"

stamp="$SYSROOT/.aarch64-sysroot-stamp"
want=$(sha256sum < "$SELF")
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "arm64 sysroot already in $SYSROOT"
  exit 0
fi

# The cross compiler and its glibc for arm64 (a Recommends of the compiler, so named here).
bash scripts/ensure-debian-packages.sh gcc-aarch64-linux-gnu libc6-dev-arm64-cross
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  dpkg --add-architecture arm64
  apt-get -o DPkg::Lock::Timeout=600 update -qq
fi
debs="$SYSROOT.debs"
rm -rf "$SYSROOT" "$debs"
mkdir -p "$debs" "$SYSROOT"
# shellcheck disable=SC2046
(cd "$debs" && apt-get download -qq $(for p in $PACKAGES; do echo "$p:arm64"; done))
for deb in "$debs"/*.deb; do
  dpkg-deb -x "$deb" "$SYSROOT"
done
rm -rf "$debs"
echo "$want" > "$stamp"
echo "arm64 sysroot in $SYSROOT: $(cd "$SYSROOT" && ls usr/lib/aarch64-linux-gnu | tr '\n' ' ')"
