"""The package's version: the only place it is written.

pyproject.toml reads it statically (`[tool.setuptools.dynamic]`, an AST literal, so building
never imports the package or its C extension); `genai_ratelimit.__version__` re-exports it.
Keep it a plain string assignment.
"""

__version__ = "0.1.0"
