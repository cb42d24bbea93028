"""The end-to-end benchmark's app: examples/app.py exactly as shipped, plus one extra route,
`POST /bench/unlimited/v1/chat/completions`, which is the same handler function as the limited
`POST /v1/chat/completions`, behind the same middlewares, without `Depends(rate_limit)`.
So "limited vs unlimited" differs by the rate limiter and nothing else.

    uvicorn e2e_app:app --app-dir benchmarks

(run.py starts it with REDIS_URL, EXAMPLE_KEY_PREFIX and GENAI_RATELIMIT_TIERS set.)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from app import app, chat_completions  # noqa: E402

UNLIMITED_PATH = "/bench/unlimited/v1/chat/completions"
app.add_api_route(UNLIMITED_PATH, chat_completions, methods=["POST"])
