from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.harness.services import MissingService, running_redis


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A fresh real redis-server per test (`make services` installs it)."""
    try:
        with running_redis() as url:
            yield url
    except MissingService as exc:
        pytest.skip(str(exc))
