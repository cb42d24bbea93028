"""`make serve`: the example app on http://127.0.0.1:$PORT (default 8000, or a free port when
that one is taken) until Ctrl-C, with a throwaway redis-server unless $REDIS_URL is set.
Prints curl lines to try."""

from __future__ import annotations

import os
import sys

import uvicorn

from _local import EXAMPLES, LocalRedis, free_port, port_is_free


def curl_lines(base_url: str, owns_redis: bool) -> str:
    body = '{"messages": [{"role": "user", "content": "Hello"}]}'
    post = f"curl -sN -i {base_url}/v1/chat/completions -H 'Content-Type: application/json'"
    return "\n".join([
        "Try (keys: sk-demo-free, sk-demo-pro, sk-demo-enterprise; no key = limited by address):",
        f"  {post} -H 'Authorization: Bearer sk-demo-free' -d '{body}'",
        f"  {post} -H 'Authorization: Bearer sk-demo-pro' "
        f"-d '{{\"stream\": false, \"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}]}}'",
        f"  for i in $(seq 7); do {post} -o /dev/null -w '%{{http_code}}\\n' "
        f"-H 'Authorization: Bearer sk-demo-free' -d '{body}'; done",
        f"  curl -s {base_url}/healthz",
        "Ctrl-C stops the app" + (" and redis-server." if owns_redis else "."),
    ])


def main() -> int:
    requested = int(os.environ.get("PORT", "8000"))
    port = requested if port_is_free(requested) else free_port()
    redis_server = None
    if not os.environ.get("REDIS_URL", "").strip():
        redis_server = LocalRedis()
        redis_server.start()
        os.environ["REDIS_URL"] = redis_server.url
    try:
        where = "$REDIS_URL" if redis_server is None else f"throwaway redis-server at {redis_server.url}"
        print(f"Redis: {where}")
        if port != requested:
            print(f"(port {requested} is taken; using {port})")
        print(curl_lines(f"http://127.0.0.1:{port}", redis_server is not None), flush=True)
        # proxy_headers=False: request.client is the TCP peer, never a forged X-Forwarded-For.
        uvicorn.run("app:app", app_dir=str(EXAMPLES), host="127.0.0.1", port=port,
                    proxy_headers=False)
    finally:
        if redis_server is not None:
            redis_server.__exit__()
    return 0


if __name__ == "__main__":
    sys.exit(main())
