"""Session fixtures of the SGLang tests: the server pool (pool.py), and its count of starts in the run's summary."""
from __future__ import annotations

import pytest

_POOLS: list = []


@pytest.fixture(scope="session")
def server_pool(tmp_path_factory):
    from tests.sglang.pool import ServerPool

    pool = ServerPool(tmp_path_factory.mktemp("server_pool"))
    _POOLS.append(pool)
    try:
        yield pool
    finally:
        pool.stop_all()


def pytest_terminal_summary(terminalreporter):
    for pool in _POOLS:
        terminalreporter.write_line(f"server pool: {len(pool.starts)} starts, {pool.reuses} shared reuses")
        for line in pool.starts:
            terminalreporter.write_line(f"  {line}")
