"""`make demo`: a throwaway redis-server (unless $REDIS_URL is set), the example app under
uvicorn on a free loopback port, bursts of real HTTP requests, and a table of what came back:
a free user whose token budget runs out before the request budget does, a request too large
to ever fit, a pro user, and a free user's fourth concurrent stream refused while three run
(max_in_flight). Stops everything it started and exits 0.

Each run uses a fresh key prefix, so repeated runs print the same table and a Redis named by
$REDIS_URL is never flushed (the demo deletes only its own keys)."""

from __future__ import annotations

import json
import os
import sys
import threading
import uuid
from contextlib import ExitStack

import httpx

from _local import AppServer, LocalRedis

BURSTS = [
    # (who, API key, tier, requests, max_tokens)
    ("free user", "sk-demo-free", "free", 5, 3000),
    ("free user, one request too large to ever fit", "sk-demo-free", "free", 1, 20_000),
    ("pro user", "sk-demo-pro", "pro", 4, None),
]
COLUMNS = ("#", "status", "requests left", "tokens left", "tokens used", "Retry-After", "refused by")


def fire(client: httpx.Client, api_key: str, count: int,
         max_tokens: int | None) -> tuple[list[tuple[str, ...]], str]:
    """`count` streamed chat completions as one user, asking the final usage chunk. Returns
    one table row per request, and the error message of the last 429 ("" when none)."""
    rows: list[tuple[str, ...]] = []
    message = ""
    body: dict[str, object] = {"model": "demo-1", "stream": True, "stream_options": {"include_usage": True},
                               "messages": [{"role": "user", "content": "Tell me about rate limits."}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    for number in range(1, count + 1):
        with client.stream("POST", "/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {api_key}"}) as response:
            text = "".join(response.iter_text())
        used = "-"
        if response.status_code == 200:
            if not text.rstrip().endswith("data: [DONE]"):
                raise SystemExit(f"request {number}: the stream did not complete: {text[-200:]!r}")
            events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: {")]
            used = str(json.loads(events[-1])["usage"]["total_tokens"])
        else:
            message = json.loads(text).get("error", {}).get("message", text)
        rows.append((
            str(number),
            f"{response.status_code} {response.reason_phrase}",
            response.headers.get("x-ratelimit-remaining-requests", "-"),
            response.headers.get("x-ratelimit-remaining-tokens", "-"),
            used,
            response.headers.get("Retry-After", "-"),
            response.headers.get("X-RateLimit-Resource", "-"),
        ))
    return rows, message


STREAMER_KEY = "sk-demo-streamer"
STREAM_COLUMNS = ("#", "when", "status", "X-RateLimit-Window", "Retry-After")


class SlowStream:
    """One slow streamed completion (pace_ms between chunks) read in a thread of its own:
    `first_chunk` is set once it is under way."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.status = ""
        self.window = "-"
        self.retry_after = "-"
        self.first_chunk = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {"model": "demo-1", "stream": True, "pace_ms": 150,
                "messages": [{"role": "user", "content": "Take your time."}]}
        try:
            with httpx.Client(base_url=self.base_url, timeout=30.0) as client, client.stream(
                    "POST", "/v1/chat/completions", json=body,
                    headers={"Authorization": f"Bearer {STREAMER_KEY}"}) as response:
                self.status = f"{response.status_code} {response.reason_phrase}"
                self.window = response.headers.get("X-RateLimit-Window", "-")
                self.retry_after = response.headers.get("Retry-After", "-")
                for _ in response.iter_bytes():
                    self.first_chunk.set()
        finally:
            self.first_chunk.set()


def concurrency_scene(base_url: str) -> list[tuple[str, ...]]:
    """Three slow streams of one free user, a fourth while they run (refused: 3 in flight),
    and a fifth once they have ended (admitted: the slots are free again)."""
    running = [SlowStream(base_url) for _ in range(3)]
    for stream in running:
        stream.first_chunk.wait(30)
    fourth = SlowStream(base_url)
    fourth.thread.join(30)
    for stream in running:
        stream.thread.join(30)
    fifth = SlowStream(base_url)
    fifth.thread.join(30)
    whens = ["streaming"] * 3 + ["while 3 stream", "after they ended"]
    return [(str(number), when, stream.status, stream.window, stream.retry_after)
            for number, (when, stream) in enumerate(zip(whens, [*running, fourth, fifth], strict=True), 1)]


def print_table(rows: list[tuple[str, ...]], columns: tuple[str, ...] = COLUMNS) -> None:
    widths = [max(len(columns[i]), *(len(row[i]) for row in rows)) for i in range(len(columns))]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(("  " + line.format(*columns)).rstrip())
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
    from genai_ratelimit import TIER_LIMITS, TIER_TOKEN_LIMITS

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
            for who, api_key, tier, count, max_tokens in BURSTS:
                budget, tokens = TIER_LIMITS[tier], TIER_TOKEN_LIMITS[tier]
                asking = f"max_tokens={max_tokens}" if max_tokens else "no max_tokens (1,000 reserved)"
                print(f"\n{who} ({tier} tier: {budget['per_minute']} requests and {tokens['per_minute']:,} "
                      f"tokens a minute), {count} streamed request(s), {asking}:")
                rows, message = fire(client, api_key, count, max_tokens)
                print_table(rows)
                if message:
                    print(f"  429 says: {message}")
        print("\nanother free user (max_in_flight 3): three slow streams at once, a fourth while "
              "they run, a fifth after:")
        print_table(concurrency_scene(server.base_url), STREAM_COLUMNS)
        print("  (Retry-After on the refusal: when the soonest slot's lease expires, an upper "
              "bound; a stream that ends frees its slot sooner)")
        print("\nStopping the app" + ("." if external_url else " and redis-server."))
    return 0


if __name__ == "__main__":
    sys.exit(main())
