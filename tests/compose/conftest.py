"""Fixtures for the Docker tests: the session's engine and images (tests/compose/engine.py)
and a compose stack (tests/compose/stack.py), each stopped even when a test fails."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.compose.engine import DockerEngine, Images, docker_engine, images
from tests.compose.stack import ComposeStack


@pytest.fixture(scope="session")
def docker() -> Iterator[DockerEngine]:
    with docker_engine() as engine:
        yield engine


@pytest.fixture(scope="session")
def stack_images(docker: DockerEngine) -> Images:
    """The base and services images, and the leasekeeper image built by ``docker-compose
    build`` from the project's Dockerfile (layer-cached across sessions)."""
    return images(docker, lambda found: ComposeStack(docker, found).build())


@pytest.fixture(scope="module")
def compose_stack(docker: DockerEngine, stack_images: Images) -> Iterator[ComposeStack]:
    stack = ComposeStack(docker, stack_images)
    try:
        stack.up()
        yield stack
    finally:
        stack.close_clients()
        stack.down(volumes=True)
