"""The password never outlives its use in the extension's memory: every buffer that held the
AUTH command (the formatted command, the engine's output buffer, the pool's copy of the
password, the bytes the asyncio limiter hands its transport) is wiped with explicit_bzero
before it is freed or used again (docs/security.md: "Credentials in memory").

Each case runs in a child process (tests/helpers_wipe.py) that uses a password and exits,
and is seen two ways:

- in every build but ASan's, the child then reads its own writable memory for the password
  between CRLFs, the shape it has in the RESP text of AUTH and in nothing else (the URL
  holds it between ':' and '@', a str object after its header, and those are the caller's):
  none may be left, while the limiter is connected and after it closed. (Under ASan the
  address space is terabytes of reserved shadow and heap, too much to read.)
- in the debug and sanitized builds (RL_DEBUG_HOOKS), right before freeing any buffer that
  may have held the password the extension looks for the wipe canary in what was ever
  written to it, and aborts naming the buffer when it is there. The children's passwords
  hold the canary, so a wipe left out anywhere kills the child: one case per path that
  frees such a buffer, and these cases run under make test-asan.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from genai_ratelimit import _native
from helpers_core import PasswordRedisServer

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CANARY = getattr(_native, "_debug_wipe_canary", None)
UNDER_ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")
HOOKS_MISSING = ("this build has no wipe check (_native._debug_wipe_canary): only the debug and "
                 "sanitized builds do (make install-debug / install-asan; make test-asan runs "
                 "these cases)")
SCAN_UNDER_ASAN = ("under ASan the address space is terabytes of reserved shadow and heap, too "
                   "much to read: the sanitized build checks every wipe at free time instead "
                   "(the cases that need the wipe check)")


@pytest.fixture(scope="module")
def password() -> str:
    """Random, so that nothing but this module's children ever held it; with the canary
    when the build checks wipes."""
    return f"{CANARY or 'secret'}-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def password_url(password: str) -> Iterator[str]:
    with PasswordRedisServer(password) as server:  # started by the with
        yield f"redis://:{password}@127.0.0.1:{server.port}/0"


def run_child(scenario: str, password: str, url: str = "", scan: bool = False
              ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GENAI_RATELIMIT_TEST_PASSWORD": password,
           "GENAI_RATELIMIT_TEST_URL": url, "GENAI_RATELIMIT_TEST_SCAN": "1" if scan else "0"}
    env.pop("RATE_LIMIT_DISABLED", None)
    return subprocess.run([sys.executable, str(HERE / "helpers_wipe.py"), scenario], env=env,
                          cwd=HERE, capture_output=True, text=True, timeout=120)


def assert_clean(result: subprocess.CompletedProcess[str], scenario: str) -> None:
    assert result.returncode == 0, (
        f"{scenario}: exit {result.returncode}\nstdout: {result.stdout[-2000:]}\n"
        f"stderr: {result.stderr[-4000:]}")
    assert "without being wiped" not in result.stderr, result.stderr


# ------------------------------------------------------------- the memory of the process

@pytest.mark.skipif(UNDER_ASAN, reason=SCAN_UNDER_ASAN)
def test_no_copy_of_the_auth_command_is_left_in_the_process_memory(limiter_kind: str, password: str,
                                                                    password_url: str) -> None:
    """Connected (after the first check) and closed: on every limiter kind, the password
    is nowhere between CRLFs in the process's memory."""
    assert_clean(run_child(limiter_kind, password, password_url, scan=True), limiter_kind)


@pytest.mark.skipif(UNDER_ASAN, reason=SCAN_UNDER_ASAN)
def test_no_copy_of_a_refused_auth_command_is_left_in_the_process_memory(
        limiter_kind: str, password_url: str) -> None:
    """The server refuses the password: the connection goes before INFO's answer (on
    asyncio, the handshake's bytes are zeroed when the transport lets the connection go)."""
    refused = f"{CANARY or 'secret'}-refused-{uuid.uuid4().hex}"
    url = password_url.replace(password_url.split("@")[0], f"redis://:{refused}")
    scenario = f"{limiter_kind}-refused"
    assert_clean(run_child(scenario, refused, url, scan=True), scenario)


def test_the_memory_scan_finds_a_copy_left_behind(password: str) -> None:
    """The scan can fail: a bytearray holding an AUTH command, left unwiped, is found."""
    code = ("import helpers_wipe, os\n"
            "left = bytearray(b'*2\\r\\n$4\\r\\nAUTH\\r\\n$%d\\r\\n' % len(helpers_wipe.PASSWORD)"
            " + helpers_wipe.PASSWORD.encode() + b'\\r\\n')\n"
            "print(len(helpers_wipe.framed_copies(helpers_wipe.PASSWORD.encode())))\n")
    env = {**os.environ, "GENAI_RATELIMIT_TEST_PASSWORD": password}
    if UNDER_ASAN:
        pytest.skip(SCAN_UNDER_ASAN)
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=HERE,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) >= 1, result.stdout


# ------------------------------------------------------ the wipe check (debug builds)

needs_hooks = pytest.mark.skipif(CANARY is None, reason=HOOKS_MISSING)


@needs_hooks
@pytest.mark.parametrize("scenario", ["pipeline-dropped", "pipeline-grown", "pipeline-written",
                                      "pipeline-failed", "cluster-config"])
def test_every_buffer_that_held_the_password_is_wiped_before_it_is_freed(scenario: str,
                                                                         password: str) -> None:
    """The engine's paths, no server needed: the handshake queued then dropped (its output
    buffer freed with the command in it), grown (AUTH's buffer replaced by a larger one),
    written (the buffer used again), failed (every entry dropped), and the copies of the
    credentials a cluster limiter's seed nodes hold."""
    assert_clean(run_child(scenario, password), scenario)


@needs_hooks
def test_every_buffer_of_a_connected_limiter_is_wiped_before_it_is_freed(
        limiter_kind: str, password: str, password_url: str) -> None:
    assert_clean(run_child(limiter_kind, password, password_url), limiter_kind)


@needs_hooks
def test_the_wipe_check_aborts_on_a_buffer_that_still_holds_the_canary(password: str) -> None:
    """The check can fail: handed bytes that hold the canary (_native._debug_check_wiped, the
    check the extension runs on its own buffers), it stops the process and names them."""
    code = ("import sys\nfrom genai_ratelimit import _native\n"
            "_native._debug_check_wiped(b'AUTH ' + sys.argv[1].encode())\n")
    result = subprocess.run([sys.executable, "-c", code, password], cwd=HERE,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "a buffer handed to _debug_check_wiped that held a password was freed without being " \
           "wiped" in result.stderr, result.stderr
    clean = subprocess.run([sys.executable, "-c", code, "no canary here"], cwd=HERE,
                           capture_output=True, text=True, timeout=120)
    assert clean.returncode == 0, clean.stderr


def test_the_wipe_is_one_the_optimiser_keeps() -> None:
    """rl_wipe is explicit_bzero: a memset before free() is a dead store the optimiser may
    remove from a release build, where neither check above can look."""
    import genai_ratelimit._native as native

    nm = shutil.which("nm")
    assert nm, "nm (binutils) is needed to list the extension's imported symbols"
    listing = subprocess.run([nm, "-D", "--undefined-only", native.__file__],
                             capture_output=True, text=True, check=True, timeout=60).stdout
    imported = {line.split()[-1].split("@")[0] for line in listing.splitlines() if line.strip()}
    assert imported & {"explicit_bzero", "__explicit_bzero_chk"}, (
        "the extension does not import explicit_bzero: a wipe before free() may be elided")


def test_only_the_debug_and_sanitized_builds_carry_the_hooks() -> None:
    """The failure injection and the wipe check exist exactly in an -O0 build (make
    install-debug, install-asan); a release build and a wheel have neither."""
    import genai_ratelimit._native as native

    readelf = shutil.which("readelf")
    assert readelf, "readelf (binutils) is needed to read the extension's compiler flags"
    dump = subprocess.run([readelf, "--debug-dump=info", native.__file__], capture_output=True,
                          text=True, timeout=120).stdout
    producer = re.search(r"DW_AT_producer\s*:.*?:\s*(.*)", dump)
    debug_build = producer is not None and "-O0" in producer.group(1).split()
    hooks = (hasattr(_native, "_debug_wipe_canary"),
             hasattr(_native.Pipeline, "_debug_fail_allocation"))
    assert hooks == (debug_build, debug_build), (native.__file__, producer and producer.group(1))
