#!/usr/bin/env bash
# Installs the Debian packages the build and the tests need, when they are missing:
# a C compiler, pkg-config, Python headers, hiredis, libuuid, OpenSSL and redis-server.
# Root installs directly; otherwise sudo is used when it works without a password prompt
# in a non-interactive shell, and failing that we print exactly what to install.
set -euo pipefail

PYTHON=${PYTHON:-python3}
missing=()

have_pkgconfig_module() { command -v pkg-config >/dev/null 2>&1 && pkg-config --exists "$1"; }

command -v gcc >/dev/null 2>&1 || command -v cc >/dev/null 2>&1 || missing+=(gcc)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
have_pkgconfig_module hiredis || [ -f /usr/include/hiredis/hiredis.h ] || missing+=(libhiredis-dev)
have_pkgconfig_module uuid || [ -f /usr/include/uuid/uuid.h ] || missing+=(uuid-dev)
have_pkgconfig_module openssl || [ -f /usr/include/openssl/ssl.h ] || missing+=(libssl-dev)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)   # the TLS tests make certificates
if ! "$PYTHON" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null; then
  missing+=(python3-dev)
fi
if ! "$PYTHON" -c 'import venv, ensurepip' >/dev/null 2>&1; then
  missing+=(python3-venv)
fi

[ ${#missing[@]} -eq 0 ] && exit 0

echo "Installing missing system packages: ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then
  SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  SUDO="sudo -n"
else
  echo "error: these Debian packages are needed: ${missing[*]}" >&2
  echo "       install them with: sudo apt-get install ${missing[*]}" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "error: no apt-get here; install the equivalents of: ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "Installed: ${missing[*]}"
