"""python -m genai_ratelimit: the command line (genai_ratelimit/cli.py)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
