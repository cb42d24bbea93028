"""The extension module as CPython sees it: types that cannot be changed from Python, the
interpreters it says it supports, and out of memory reported as CPython's own MemoryError.

- Every type the module makes from a spec (Limiter, Codec, Request, Pipeline) has
  Py_TPFLAGS_IMMUTABLETYPE: no attribute of it can be set or deleted from Python (one
  limiter's code cannot patch another's type). WindowDecision is a struct sequence made by
  PyStructSequence_NewType, which has no way to say so (CPython 3.10 to 3.13 make it a
  mutable heap type): its instances are tuples, immutable anyway.
- Py_mod_multiple_interpreters (CPython 3.12+): the module has no state outside its module
  state, so it loads in subinterpreters that share the main interpreter's GIL; it declares
  nothing more (a GIL of its own per interpreter is not claimed). A build for the 3.10
  Limited API cannot name the slot at all, and 3.12+ then applies the same default.
- Out of memory on the asyncio path reaches the future as the MemoryError that
  PyErr_NoMemory raises (no arguments), not MemoryError(None).
"""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from genai_ratelimit import _native

SPEC_TYPES = [_native.Limiter, _native.Codec, _native.Request, _native.Pipeline]
IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE


@pytest.mark.parametrize("cls", SPEC_TYPES, ids=lambda cls: cls.__name__)
def test_the_module_s_types_cannot_be_changed_from_python(cls: type) -> None:
    assert cls.__flags__ & IMMUTABLE_TYPE, f"{cls.__name__} lacks Py_TPFLAGS_IMMUTABLETYPE"
    with pytest.raises(TypeError, match="immutable"):
        cls.patched = True  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="immutable"):
        del cls.__doc__
    assert not hasattr(cls, "patched")


def test_a_window_decision_is_an_immutable_tuple() -> None:
    value = _native.WindowDecision((True, 4, 0, 60, 0, 1_767_225_600_000))
    assert isinstance(value, tuple) and tuple(value) == (True, 4, 0, 60)
    with pytest.raises((AttributeError, TypeError)):
        value.remaining = 5  # type: ignore[misc]


SUBINTERPRETER_IMPORT = """
import os
try:
    import genai_ratelimit._native as native
    limiter = native.Codec("sub").check("user", 5, 60)
    os.write({fd}, b"imported: " + type(limiter).__name__.encode())
except BaseException as exc:
    os.write({fd}, ("refused: " + type(exc).__name__ + ": " + str(exc)).encode())
"""


def run_in_subinterpreter(own_gil: bool) -> str:
    """Runs SUBINTERPRETER_IMPORT in a subinterpreter that checks its extensions (Python's
    own test helpers: _testcapi on 3.12, _testinternalcapi with an _interpreters config
    from 3.13) and returns what it wrote."""
    read, write = os.pipe()
    code = SUBINTERPRETER_IMPORT.format(fd=write)
    try:
        if sys.version_info < (3, 13):
            testcapi = pytest.importorskip("_testcapi", reason="this CPython has no _testcapi")
            testcapi.run_in_subinterp_with_config(
                code, use_main_obmalloc=not own_gil, allow_fork=True, allow_exec=True,
                allow_threads=True, allow_daemon_threads=False,
                check_multi_interp_extensions=True, gil=2 if own_gil else 1)
        else:
            testcapi = pytest.importorskip("_testinternalcapi",
                                           reason="this CPython has no _testinternalcapi")
            interpreters = pytest.importorskip("_interpreters",
                                               reason="this CPython has no _interpreters")
            config = interpreters.new_config("isolated" if own_gil else "legacy")
            config.check_multi_interp_extensions = True
            testcapi.run_in_subinterp_with_config(code, config)
        os.close(write)
        write = -1
        with os.fdopen(read, "rb") as pipe:
            read = -1
            return pipe.read().decode()
    finally:
        for fd in (read, write):
            if fd >= 0:
                os.close(fd)


@pytest.mark.skipif(sys.version_info < (3, 12),
                    reason="Py_mod_multiple_interpreters and interpreters that check it exist "
                           "from CPython 3.12")
def test_the_module_loads_in_a_subinterpreter_that_shares_the_gil() -> None:
    assert run_in_subinterpreter(own_gil=False) == "imported: Request"


@pytest.mark.skipif(sys.version_info < (3, 12),
                    reason="a GIL per interpreter exists from CPython 3.12")
def test_the_module_does_not_claim_a_gil_of_its_own_per_interpreter() -> None:
    outcome = run_in_subinterpreter(own_gil=True)
    assert outcome.startswith("refused: ImportError"), outcome
    assert "does not support loading in subinterpreters" in outcome, outcome


@pytest.mark.skipif(not hasattr(_native.Pipeline, "_debug_fail_allocation"),
                    reason="this build has no failure-injection hook: only the debug and "
                           "sanitized builds do (make install-debug / install-asan)")
def test_out_of_memory_reaches_the_future_as_python_s_own_memory_error() -> None:
    """NOSCRIPT, and no memory to queue SCRIPT LOAD and the command again: the decision's
    future fails with the MemoryError PyErr_NoMemory raises."""
    loop = asyncio.new_event_loop()
    try:
        pipeline = _native.Pipeline(1.0)
        future = loop.create_future()
        pipeline.push(future, _native.Codec("hygiene").check("user", 5, 60))
        pipeline.take()
        pipeline._debug_fail_allocation(1)
        pipeline.feed(b"-NOSCRIPT No matching script. Please use EVAL.\r\n")
        error = future.exception()
        assert type(error) is MemoryError and error.args == (), repr(error)
    finally:
        loop.close()
