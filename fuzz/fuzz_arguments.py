"""Fuzz target: argument validation of a check, before any I/O.

Builds arguments of every shape from the input (str, str subclasses, lone surrogates,
bytes, ints of any size, bools, floats, int subclasses, None; window sequences as lists,
tuples, ranges, generators, dicts, pairs of the wrong length; keyword arguments right,
unknown and duplicated) and calls Codec.check / check_windows, plus the blocking Limiter
(pointed at a unix socket that does not exist, so a valid check fails fast at connect).

The oracle is a Python model of the rules in csrc/py_request.c: a valid call must give a Request
whose EVALSHA is exactly what the model expects (keys, member, clock, windows sorted
shortest first); an invalid one must raise the model's exception type (TypeError or
ValueError), and Codec and Limiter must agree. Anything else is a crash.

    python fuzz/fuzz_arguments.py [libFuzzer flags] [corpus dirs]   (see fuzz/run.py)
"""

from __future__ import annotations

import os
import re
import sys

from common import RateLimiterError, _native, atheris

MAX_LIMIT = _native.MAX_LIMIT
MAX_SECONDS = _native.MAX_WINDOW_SECONDS
MAX_WINDOWS = _native.MAX_WINDOWS
UUID4 = re.compile(rb"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")

CODECS = {False: _native.Codec("fz"), True: _native.Codec("fz", client_clock=True)}
LIMITER = _native.Limiter(unix_path="/nonexistent/genai-ratelimit-fuzz.sock", key_prefix="fz",
                          connect_timeout=0.05, socket_timeout=0.05)


class OddStr(str):
    def __str__(self) -> str:
        return "not-me"

    def encode(self, *args, **kwargs):  # type: ignore[override]
        raise AssertionError("the C code must not call str methods")


class OddInt(int):
    def __index__(self) -> int:
        return 1

    def __int__(self) -> int:
        return 1


class Invalid(Exception):
    def __init__(self, kind: type[BaseException]) -> None:
        self.kind = kind


@atheris.instrument_func
def make_text(fdp: atheris.FuzzedDataProvider):
    kind = fdp.ConsumeIntInRange(0, 9)
    if kind == 0:
        return ""
    if kind == 1:
        return fdp.ConsumeUnicode(fdp.ConsumeIntInRange(0, 24))  # may hold lone surrogates
    if kind == 2:
        return OddStr(fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 8)))
    if kind == 3:
        return fdp.ConsumeBytes(4)
    if kind == 4:
        return fdp.ConsumeInt(2)
    if kind == 5:
        return None
    if kind == 6:
        return "x" * fdp.ConsumeIntInRange(1, 70000)  # past the stack arena of the formatter
    if kind == 7:
        return "user\x00with-nul:" + fdp.ConsumeUnicodeNoSurrogates(4)
    return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(1, 16))


@atheris.instrument_func
def make_number(fdp: atheris.FuzzedDataProvider):
    kind = fdp.ConsumeIntInRange(0, 11)
    if kind == 0:
        return fdp.ConsumeIntInRange(-2, 100)
    if kind == 1:
        return fdp.ConsumeInt(fdp.ConsumeIntInRange(1, 20))  # up to 160-bit, either sign
    if kind == 2:
        return fdp.PickValueInList([0, 1, MAX_LIMIT, MAX_LIMIT + 1, MAX_SECONDS, MAX_SECONDS + 1,
                                    2**31 - 1, 2**31, 2**53, 2**63 - 1, 2**63, 2**64, -2**63])
    if kind == 3:
        return fdp.ConsumeBool()
    if kind == 4:
        return fdp.ConsumeFloat()
    if kind == 5:
        return str(fdp.ConsumeIntInRange(1, 100))
    if kind == 6:
        return OddInt(fdp.ConsumeIntInRange(-5, 2**40))
    if kind == 7:
        return None
    return fdp.ConsumeIntInRange(1, 100000)


@atheris.instrument_func
def make_windows(fdp: atheris.FuzzedDataProvider):
    kind = fdp.ConsumeIntInRange(0, 9)
    n = fdp.ConsumeIntInRange(0, 36) if kind == 1 else fdp.ConsumeIntInRange(0, 5)
    pairs = []
    for _ in range(n):
        shape = fdp.ConsumeIntInRange(0, 7)
        if shape == 0:
            pairs.append([make_number(fdp), make_number(fdp)])
        elif shape == 1:
            pairs.append((make_number(fdp),))
        elif shape == 2:
            pairs.append((make_number(fdp), make_number(fdp), 1))
        elif shape == 3:
            pairs.append(make_number(fdp))
        else:
            pairs.append((make_number(fdp), make_number(fdp)))
    if kind == 2:
        return tuple(pairs)
    if kind == 3:
        return (p for p in pairs)
    if kind == 4:
        return dict(enumerate(pairs))
    if kind == 5:
        return range(n)
    if kind == 6:
        return make_text(fdp)
    if kind == 7:
        return None
    return pairs


# ------------------------------------------------------------------------ the model

def positive(value, max_value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise Invalid(TypeError)
    value = int.__int__(value)  # the real value, whatever a subclass's __int__ says
    if value < 1 or value > max_value:
        raise Invalid(ValueError)
    return value


@atheris.instrument_func
def model_user(user) -> bytes:
    if not isinstance(user, str):
        raise Invalid(TypeError)
    if len(user) == 0:
        raise Invalid(ValueError)
    try:
        return str.encode(user, "utf-8")
    except UnicodeEncodeError:
        raise Invalid(ValueError) from None


@atheris.instrument_func
def model_windows(windows) -> list[tuple[int, int]]:
    if isinstance(windows, (str, bytes, bytearray)) or windows is None:
        raise Invalid(TypeError)
    if isinstance(windows, (dict, int, float)) or not hasattr(windows, "__getitem__"):
        raise Invalid(TypeError)
    items = list(windows)
    if not items:
        raise Invalid(ValueError)
    if len(items) > MAX_WINDOWS:
        raise Invalid(ValueError)
    result: list[tuple[int, int]] = []
    for pair in items:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise Invalid(TypeError)
        limit = positive(pair[0], MAX_LIMIT)
        seconds = positive(pair[1], MAX_SECONDS)
        if any(s == seconds for _, s in result):
            raise Invalid(ValueError)
        result.append((limit, seconds))
    return sorted(result, key=lambda w: w[1])  # stable: equal lengths were refused above


def parse_resp_array(command: bytes) -> list[bytes]:
    if not command.startswith(b"*"):
        raise AssertionError(f"not a RESP array: {command[:40]!r}")
    count_end = command.index(b"\r\n")
    count = int(command[1:count_end])
    pos, items = count_end + 2, []
    for _ in range(count):
        if command[pos:pos + 1] != b"$":
            raise AssertionError(f"not a bulk string at {pos}: {command[pos:pos + 20]!r}")
        end = command.index(b"\r\n", pos)
        length = int(command[pos + 1:end])
        items.append(command[end + 2:end + 2 + length])
        if command[end + 2 + length:end + 4 + length] != b"\r\n":
            raise AssertionError("bulk string not terminated")
        pos = end + 4 + length
    if pos != len(command):
        raise AssertionError("bytes after the command")
    return items


@atheris.instrument_func
def check_command(command: bytes, user: bytes, windows: list[tuple[int, int]],
                  client_clock: bool, cost: int) -> None:
    words = parse_resp_array(command)
    n = len(windows)
    # three keys per window (lua/sliding_window.lua): the log, its weights (":w") and the
    # running totals of its weighted entries (":t")
    if words[:3] != [b"EVALSHA", _native.SCRIPT_SHA1.encode(), str(3 * n).encode()]:
        raise AssertionError(f"head {words[:3]!r}")
    keys = words[3:3 + 3 * n]
    zsets = [b"fz:" + user + b":" + str(s).encode() for _, s in windows]
    if keys != zsets + [key + b":w" for key in zsets] + [key + b":t" for key in zsets]:
        raise AssertionError(f"keys {keys!r} for windows {windows}")
    n *= 3  # the words after the keys
    member, now = words[3 + n], words[4 + n]
    if not UUID4.match(member):
        raise AssertionError(f"member {member!r}")
    if client_clock != (now != b""):
        raise AssertionError(f"clock argument {now!r} with client_clock={client_clock}")
    if client_clock and not now.isdigit():
        raise AssertionError(f"clock argument {now!r}")
    expected = [w for limit, s in windows
                for w in (str(s * 1000).encode(), str(limit).encode(), str(cost).encode())]
    if words[5 + n:] != expected:
        raise AssertionError(f"window arguments {words[5 + n:]!r}, expected {expected!r}")


# ----------------------------------------------------------------------- the target

def call(function, use_windows: bool, args: tuple, kwargs: dict):
    try:
        return "ok", function(*args, **kwargs)
    except TypeError as exc:
        return TypeError, exc
    except ValueError as exc:  # UnicodeEncodeError for lone surrogates is one
        return ValueError, exc
    except RateLimiterError as exc:
        return RateLimiterError, exc


@atheris.instrument_func
def TestOneInput(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    use_windows = fdp.ConsumeBool()
    client_clock = fdp.ConsumeBool()
    kill_switch = fdp.ConsumeIntInRange(0, 15) == 0
    user = make_text(fdp)
    values = [user, make_windows(fdp)] if use_windows else [user, make_number(fdp), make_number(fdp)]
    names = ["user_id", "windows"] if use_windows else ["user_id", "limit", "window_seconds"]
    style = fdp.ConsumeIntInRange(0, 5)
    cost = make_number(fdp) if fdp.ConsumeIntInRange(0, 2) == 0 else None

    # Expected outcome of the argument matching (csrc/py_request.c rl_parse_args).
    args: tuple = tuple(values)
    kwargs: dict = {}
    argument_error = None
    if style == 1:  # all by keyword
        args, kwargs = (), dict(zip(names, values, strict=True))
    elif style == 2:  # the last one by keyword
        args, kwargs = tuple(values[:-1]), {names[-1]: values[-1]}
    elif style == 3:
        kwargs = {"nope": 1}
        argument_error = TypeError
    elif style == 4:
        args = tuple(values[:-1])
        argument_error = TypeError
    elif style == 5:
        args, kwargs = tuple(values), {names[0]: values[0]}
        argument_error = TypeError
    if cost is not None:
        kwargs["cost"] = cost  # keyword-only: never positional

    expected: object
    model: object = None
    if argument_error is not None:
        expected = argument_error
    else:
        try:
            encoded = model_user(user)
            windows = model_windows(values[1]) if use_windows else [
                (positive(values[1], MAX_LIMIT), positive(values[2], MAX_SECONDS))]
            units = 1 if cost is None else positive(cost, MAX_LIMIT)
            if units > min(limit for limit, _ in windows):
                raise Invalid(ValueError)  # a cost no window could ever allow
            expected, model = "ok", (encoded, windows, units)
        except Invalid as invalid:
            expected = invalid.kind

    if kill_switch:
        os.environ["RATE_LIMIT_DISABLED"] = "1"
    try:
        codec = CODECS[client_clock]
        outcome, value = call(codec.check_windows if use_windows else codec.check, use_windows,
                              args, kwargs)
        limiter_outcome, limiter_value = call(
            LIMITER.check_windows if use_windows else LIMITER.check, use_windows, args, kwargs)
    finally:
        os.environ.pop("RATE_LIMIT_DISABLED", None)

    if outcome != expected:
        raise AssertionError(f"Codec: {outcome!r} ({value!r}), model expected {expected!r} "
                             f"for args={args!r} kwargs={kwargs!r}")
    if expected != "ok":
        if limiter_outcome != expected:
            raise AssertionError(f"Limiter: {limiter_outcome!r} ({limiter_value!r}), Codec and "
                                 f"the model: {expected!r}")
        if not str(value):
            raise AssertionError(f"an error without a message: {value!r}")
        return
    encoded, windows, units = model  # type: ignore[misc]
    if kill_switch:
        tightest = min(range(len(windows)), key=lambda i: (windows[i][0], i))
        want = (True, windows[tightest][0], 0) + ((windows[tightest][1],) if use_windows else ())
        if value != want or limiter_value != want:
            raise AssertionError(f"kill switch answered {value!r} / {limiter_value!r}, want {want}")
        return
    if limiter_outcome is not RateLimiterError:
        raise AssertionError(f"Limiter on a missing socket: {limiter_outcome!r} {limiter_value!r}")
    check_command(value.command, encoded, windows, client_clock, units)


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
