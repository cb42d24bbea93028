"""`make demo`: a throwaway redis-server (unless $REDIS_URL is set), the example app under
uvicorn on a free loopback port, a burst of real HTTP requests as a free user and a pro user,
and a table of what came back. Stops everything it started and exits 0.

Each run uses a fresh key prefix, so repeated runs print the same table and a Redis named by
$REDIS_URL is never flushed (the demo deletes only its own keys)."""

from __future__ import annotations

import os
import sys
import uuid
from contextlib import ExitStack

import httpx

from _local import AppServer, LocalRedis

BURSTS = [
    # (who, API key, tier, requests)
    ("free user", "sk-demo-free", "free", 8),
    ("pro user", "sk-demo-pro", "pro", 4),
]
COLUMNS = ("#", "status", "X-RateLimit-Remaining", "Retry-After", "X-RateLimit-Window")


def fire(client: httpx.Client, api_key: str, count: int) -> list[tuple[str, ...]]:
    """`count` streamed chat completions as one user. Returns one table row per request."""
    rows: list[tuple[str, ...]] = []
    body = {"model": "demo-1", "stream": True,
            "messages": [{"role": "user", "content": "Tell me about rate limits."}]}
    for number in range(1, count + 1):
        with client.stream("POST", "/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {api_key}"}) as response:
            text = "".join(response.iter_text())
            if response.status_code == 200 and not text.rstrip().endswith("data: [DONE]"):
                raise SystemExit(f"request {number}: the stream did not complete: {text[-200:]!r}")
            rows.append((
                str(number),
                f"{response.status_code} {response.reason_phrase}",
                response.headers.get("X-RateLimit-Remaining", "-"),
                response.headers.get("Retry-After", "-"),
                response.headers.get("X-RateLimit-Window", "-"),
            ))
    return rows


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(COLUMNS[i]), *(len(row[i]) for row in rows)) for i in range(len(COLUMNS))]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(("  " + line.format(*COLUMNS)).rstrip())
    print("  " + "  ".join("-" * w for w in widths))
    for row in rows:
        print(("  " + line.format(*row)).rstrip())


def delete_demo_keys(redis_url: str, key_prefix: str) -> None:
    """Removes this run's keys from a Redis the demo does not own (they would expire anyway)."""
    try:
        import redis
    except ImportError:
        return
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{key_prefix}:*", count=500))
        if keys:
            client.delete(*keys)
    except redis.RedisError:
        pass
    finally:
        client.close()


def main() -> int:
    from genai_ratelimit import TIER_LIMITS

    key_prefix = f"demo-{uuid.uuid4().hex[:12]}"
    external_url = os.environ.get("REDIS_URL", "").strip()
    with ExitStack() as stack:
        if external_url:
            redis_url = external_url
            print(f"Redis: $REDIS_URL (keys under {key_prefix}:*, deleted afterwards)")
            stack.callback(delete_demo_keys, redis_url, key_prefix)
        else:
            redis_url = stack.enter_context(LocalRedis()).url
            print(f"Redis: throwaway redis-server at {redis_url}")
        # The demo shows the built-in tiers with limiting on, whatever this shell says.
        for name in ("GENAI_RATELIMIT_TIERS", "RATE_LIMIT_DISABLED"):
            if os.environ.get(name):
                print(f"(ignoring {name} from your environment for the demo)")
        server = stack.enter_context(AppServer(
            {"REDIS_URL": redis_url, "EXAMPLE_KEY_PREFIX": key_prefix},
            unset=("GENAI_RATELIMIT_TIERS", "RATE_LIMIT_DISABLED")))
        print(f"App:   examples/app.py under uvicorn at {server.base_url}")
        with httpx.Client(base_url=server.base_url, timeout=10.0) as client:
            for who, api_key, tier, count in BURSTS:
                budget = TIER_LIMITS[tier]
                print(f"\n{who} ({tier} tier: {budget['per_minute']}/minute, {budget['per_day']}/day), "
                      f"{count} requests to POST /v1/chat/completions (streamed):")
                print_table(fire(client, api_key, count))
        print("\nStopping the app" + ("." if external_url else " and redis-server."))
    return 0


if __name__ == "__main__":
    sys.exit(main())
