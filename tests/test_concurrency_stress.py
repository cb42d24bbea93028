"""Concurrency under stress: 16 threads in each of 2 processes, all on one user, released
together 1,000 times, never get more than the limit through; and a gunicorn-style pre-fork,
where one RateLimiter is made (and used) in the parent before fork(), works in every child on
a connection of the child's own.

The stress test keeps its two worker processes for all 1,000 trials: each holds one
RateLimiter and 16 threads; every trial lines all 32 threads up on one cross-process barrier
and uses a fresh user id, so a trial costs one round of 32 checks."""

from __future__ import annotations

import json
import multiprocessing
import os
import uuid
from collections import Counter

import redis

from helpers_core import connections_received

TRIALS = 1_000
THREADS = 16
PROCESSES = 2
LIMIT = 5  # of 32 callers per trial, exactly 5 may pass


def stress_worker(url: str, prefix: str, barrier, pipe) -> None:
    """One app server process: one RateLimiter shared by THREADS threads. Waits for "go" on
    the pipe, runs every trial, sends back ("ok", per-thread results) or ("error", text)."""
    import threading

    from genai_ratelimit import RateLimiter

    results: list[list[tuple[bool, int] | None]] = [[None] * TRIALS for _ in range(THREADS)]
    errors: list[str] = []

    try:
        limiter = RateLimiter(url, connect_timeout=5, socket_timeout=5)

        def run(index: int) -> None:
            try:
                for trial in range(TRIALS):
                    barrier.wait(60)
                    allowed, remaining, _ = limiter.check(f"{prefix}-{trial}", LIMIT, 60)
                    results[index][trial] = (allowed, remaining)
            except BaseException as exc:  # reported to the parent; frees the others
                errors.append(f"thread {index}: {type(exc).__name__}: {exc}")
                barrier.abort()

        assert pipe.recv() == "go"
        threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        limiter.close()
        pipe.send(("error", errors) if errors else ("ok", results))
    except BaseException as exc:
        pipe.send(("error", [f"{type(exc).__name__}: {exc}"]))
    finally:
        pipe.close()


def run_stress(url: str, prefix: str) -> list[list[tuple[bool, int]]]:
    """Runs the trials in PROCESSES spawned workers; returns, per trial, all 32 answers."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(PROCESSES * THREADS)
    pipes, processes = [], []
    for _ in range(PROCESSES):
        parent_end, child_end = context.Pipe()
        process = context.Process(target=stress_worker, args=(url, prefix, barrier, child_end))
        process.start()
        child_end.close()
        pipes.append(parent_end)
        processes.append(process)
    by_trial: list[list[tuple[bool, int]]] = [[] for _ in range(TRIALS)]
    try:
        for pipe in pipes:
            pipe.send("go")
        for pipe in pipes:
            if not pipe.poll(120):
                raise AssertionError("a worker process sent no results within 120 s")
            status, payload = pipe.recv()
            if status != "ok":
                barrier.abort()
                raise AssertionError(f"a worker process failed: {payload}")
            for per_thread in payload:
                for trial, answer in enumerate(per_thread):
                    by_trial[trial].append(tuple(answer))
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join(5)
    assert [p.exitcode for p in processes] == [0] * PROCESSES
    return by_trial


def test_sixteen_threads_in_two_processes_never_exceed_the_limit_in_1000_trials(
        redis_url, redis_client):
    prefix = f"stress-{uuid.uuid4().hex}"
    dialled_before = connections_received(redis_client)
    by_trial = run_stress(redis_url, prefix)
    dialled = connections_received(redis_client) - dialled_before
    # The threads really met: a process whose calls never overlapped would need one connection.
    assert dialled > PROCESSES

    over = [(trial, answers) for trial, answers in enumerate(by_trial)
            if sum(allowed for allowed, _ in answers) > LIMIT]
    assert not over, f"{len(over)} trial(s) let more than {LIMIT} through, e.g. {over[0]}"
    # Exactly the limit passed each time, each allowed caller saw its own count ...
    for trial, answers in enumerate(by_trial):
        assert len(answers) == PROCESSES * THREADS
        remaining = sorted(r for allowed, r in answers if allowed)
        assert remaining == list(range(LIMIT)), (trial, answers)
    # ... and Redis holds exactly the limit's worth of entries for every trial's user.
    pipeline = redis_client.pipeline(transaction=False)
    for trial in range(TRIALS):
        pipeline.zcard(f"ratelimit:{prefix}-{trial}:60")
    assert Counter(pipeline.execute()) == {LIMIT: TRIALS}


# -------------------------------------------------------------------- pre-fork

CHILDREN = 3
CHECKS_PER_CHILD = 10


def limiter_connection_ids(client: redis.Redis) -> set[int]:
    """Ids of the server's connections whose last command was the limiter's EVALSHA."""
    return {int(c["id"]) for c in client.client_list() if c.get("cmd") == "evalsha"}


def fork_child(limiter, user: str) -> tuple[int, int, int]:
    """Forks a child that makes CHECKS_PER_CHILD checks with the inherited limiter, writes
    them as JSON to a pipe, then holds its connection open until released. Returns (pid,
    read end of the results, write end of the release pipe)."""
    results_r, results_w = os.pipe()
    release_r, release_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        status = 1
        try:
            os.close(results_r)
            os.close(release_w)
            answers = [list(limiter.check(user, 100, 60)) for _ in range(CHECKS_PER_CHILD)]
            with os.fdopen(results_w, "w") as out:
                json.dump(answers, out)
            os.read(release_r, 1)  # keep the connection open while the parent looks
            status = 0
        finally:
            os._exit(status)
    os.close(results_w)
    os.close(release_r)
    return pid, results_r, release_w


def test_prefork_children_get_correct_answers_on_connections_of_their_own(
        redis_url, redis_client, user_id):
    from genai_ratelimit import RateLimiter

    limiter = RateLimiter(redis_url)
    try:
        ids_before = limiter_connection_ids(redis_client)
        assert limiter.check(user_id, 100, 60) == (True, 99, 0)  # the parent's socket is open
        [parent_id] = limiter_connection_ids(redis_client) - ids_before
        dialled_before = connections_received(redis_client)

        children = [fork_child(limiter, user_id) for _ in range(CHILDREN)]
        answers = []
        for _, results_r, _ in children:
            with os.fdopen(results_r) as source:
                answers.append([tuple(a) for a in json.load(source)])
        ids_with_children = limiter_connection_ids(redis_client)
        dialled_by_children = connections_received(redis_client) - dialled_before
        for pid, _, release_w in children:
            os.write(release_w, b"x")
            os.close(release_w)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, "a child failed"

        # Every child was allowed every time, and all their counts are distinct: one window.
        for child in answers:
            assert all(allowed and retry == 0 for allowed, _, retry in child), child
        seen = sorted(remaining for child in answers for _, remaining, _ in child)
        assert seen == list(range(99 - CHILDREN * CHECKS_PER_CHILD, 99))
        # Each child dialled its own connection; the parent's stayed where it was.
        assert dialled_by_children == CHILDREN
        assert len(ids_with_children - ids_before - {parent_id}) == CHILDREN
        assert parent_id in ids_with_children
        # The parent still works, on its own connection.
        dialled = connections_received(redis_client)
        assert limiter.check(user_id, 100, 60) == (True, 99 - CHILDREN * CHECKS_PER_CHILD - 1, 0)
        assert connections_received(redis_client) == dialled
        assert parent_id in limiter_connection_ids(redis_client)
    finally:
        limiter.close()
