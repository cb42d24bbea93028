"""examples/compose.yaml and examples/Dockerfile agree with each other and with the repository.

`make test-docker` builds the Dockerfile with a real engine and runs it beside Redis in a
container (no registry is reachable there, so compose.yaml's redis:7 image is not pulled and
compose itself is not run); hadolint lints the Dockerfile (`make lint`), `make test-wheel`
replays its steps in a Debian 12 root, and this file checks what a typo would break: the
build context and the files the Dockerfile copies (and that .dockerignore lets through), the
Redis URL, the port, and the start order."""

from __future__ import annotations

import fnmatch
import json
import shlex
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml

import genai_ratelimit
from helpers_dockerfile import dockerfile_instructions

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    pytest.mark.not_asan(reason="reads examples/compose.yaml and examples/Dockerfile: runs no C"),
    pytest.mark.no_hiredis1(reason="reads examples/compose.yaml and examples/Dockerfile: no hiredis path"),
]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def compose() -> dict[str, Any]:
    document = yaml.safe_load((EXAMPLES / "compose.yaml").read_text())
    assert isinstance(document, dict)
    return document


def dockerfile(keyword: str) -> list[str]:
    return [i.arguments for i in dockerfile_instructions(EXAMPLES / "Dockerfile") if i.keyword == keyword]


def test_compose_builds_the_app_from_the_repository_root_with_the_example_dockerfile() -> None:
    build = compose()["services"]["app"]["build"]
    context = (EXAMPLES / build["context"]).resolve()
    assert (context / "pyproject.toml").exists(), f"the build context {context} is not the repository's root"
    assert (context / build["dockerfile"]).resolve() == EXAMPLES / "Dockerfile"


def test_every_file_the_dockerfile_copies_is_in_the_context_or_made_by_make_wheel() -> None:
    context = EXAMPLES.parent
    wheel = f"genai_ratelimit-{genai_ratelimit.__version__}-cp310-abi3-manylinux_2_34_x86_64.whl"
    for arguments in dockerfile("COPY"):
        *sources, _ = shlex.split(arguments)
        for source in sources:
            if source.startswith("dist/"):
                assert fnmatch.fnmatch(f"dist/{wheel}", source), f"{source} would not match {wheel}"
            else:
                assert (context / source).is_file(), f"COPY {source}: no such file in the repository"


def test_the_dockerignore_sends_what_the_dockerfile_copies_and_nothing_else() -> None:
    """The context is the repository's root: .dockerignore excludes everything ("*"), then
    lets through exactly the Dockerfile's COPY sources (so build/, .venv never travel)."""
    lines = [line.strip() for line in (EXAMPLES.parent / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert lines[0] == "*", lines
    copied = [source for arguments in dockerfile("COPY") for source in shlex.split(arguments)[:-1]]
    assert sorted(line.removeprefix("!") for line in lines[1:]) == sorted(copied)


def test_the_app_reaches_the_compose_redis_service() -> None:
    services = compose()["services"]
    url = urllib.parse.urlsplit(services["app"]["environment"]["REDIS_URL"])
    assert url.scheme == "redis" and url.hostname in services, url
    redis = services[url.hostname]
    assert redis["image"].startswith("redis:")
    assert "--port" not in redis.get("command", []) and url.port == 6379
    assert services["app"]["depends_on"][url.hostname]["condition"] == "service_healthy"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    # The Dockerfile's default is the same URL, so `docker run --network ...` behaves alike.
    assert f"REDIS_URL={services['app']['environment']['REDIS_URL']}" in dockerfile("ENV")


def test_the_published_port_is_the_one_uvicorn_listens_on() -> None:
    command = json.loads(dockerfile("CMD")[0])
    port = command[command.index("--port") + 1]
    assert dockerfile("EXPOSE") == [port]
    published = [mapping.rsplit(":", 1)[1] for mapping in compose()["services"]["app"]["ports"]]
    assert published == [port]


def test_the_image_runs_the_python_version_the_classifiers_name() -> None:
    [argument] = dockerfile("ARG")
    [base] = dockerfile("FROM")
    # FROM ${PYTHON_IMAGE}: python:3.11-slim unless `docker build --build-arg` names another.
    name, _, default = argument.partition("=")
    assert base == f"${{{name}}}", base
    base = default
    pyproject = (EXAMPLES.parent / "pyproject.toml").read_text()
    version = base.removeprefix("python:").split("-")[0]
    assert f'"Programming Language :: Python :: {version}"' in pyproject, base
