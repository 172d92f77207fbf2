"""Shared fixtures of the tests under tests/.

* ``docker_client``: the docker SDK client of the daemon the Docker tests run against. With no daemon
  (or no local ``python:3.11-slim`` image, which every env of the example bundle builds FROM, and no
  registry is reachable to pull it) the tests that use it are skipped, with the reason in the
  summary; with ``AGENTENV_REQUIRE_DOCKER=1`` (set by CI) they fail instead, so CI can't pass
  without having run them.
* every test gets its own ``AGENTENV_STATE_DIR``, so the suite never touches the user's state.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.harness import docker_unavailable  # noqa: E402

BASE_IMAGE = "python:3.11-slim"


def _one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _connect():
    """(client, None) when the daemon answers and has the base image, else (None, why not)."""
    try:
        import docker
        import docker.errors
    except ImportError as exc:
        return None, (f"the docker package is not installed ({_one_line(exc)}): these tests need "
                      "it; pip install -e '.[test]'")
    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except Exception as exc:                            # noqa: BLE001 - docker raises many kinds
        return None, (f"no Docker daemon answers ({_one_line(exc)}): these tests need one; "
                      "start Docker to run them")
    try:
        client.images.get(BASE_IMAGE)
    except docker.errors.ImageNotFound:
        client.close()
        return None, (f"the image {BASE_IMAGE} is missing (no registry is reachable to pull it): "
                      "build it with bash .ci/docker-up.sh")
    except Exception as exc:                            # noqa: BLE001
        client.close()
        return None, (f"the Docker daemon could not look up the image {BASE_IMAGE} "
                      f"({_one_line(exc)}): build it with bash .ci/docker-up.sh")
    return client, None


@pytest.fixture(scope="session")
def docker_client():
    client, why_not = _connect()
    if client is None:
        docker_unavailable(why_not)    # outside any except block: the reason alone is reported
    yield client
    client.close()


@pytest.fixture(autouse=True)
def _own_state_dir(tmp_path, monkeypatch):
    """Each test records local env processes under its own temp folder, never the user's."""
    monkeypatch.setenv("AGENTENV_STATE_DIR", str(tmp_path / "agentenv-state"))
