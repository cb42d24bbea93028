#!/usr/bin/env bash
# Installs the Debian packages named on the command line that are not installed yet
# (e.g. valgrind for `make test-valgrind`). Root installs directly; otherwise sudo when it
# works without a prompt; failing that, prints the apt-get line to run and fails.
set -euo pipefail

missing=()
for package in "$@"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -eq 0 ]; then
  SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  SUDO="sudo -n"
else
  echo "error: these Debian packages are needed: ${missing[*]}" >&2
  echo "       install them with: sudo apt-get install ${missing[*]}" >&2
  exit 1
fi
echo "Installing missing system packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# Another install may be running (CI's parallel waves, a second make): wait for its lock
# rather than fail.
LOCK_WAIT=(-o DPkg::Lock::Timeout=600)
$SUDO apt-get "${LOCK_WAIT[@]}" update -qq
$SUDO apt-get "${LOCK_WAIT[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "Installed: ${missing[*]}"
