"""Session fixtures of the SGLang tests: the server pool (pool.py), and its count of starts in the run's summary
(under pytest-xdist each worker writes its pool's report beside its temporary folder; the controller prints them)."""
from __future__ import annotations

from pathlib import Path

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
        (tmp_path_factory.getbasetemp() / "server_pool.txt").write_text(_report(pool))


def _report(pool) -> str:
    lines = [f"server pool: {len(pool.starts)} starts, {pool.reuses} shared reuses"]
    return "\n".join(lines + [f"  {line}" for line in pool.starts]) + "\n"


def pytest_terminal_summary(terminalreporter, config):
    for pool in _POOLS:  # a run without workers
        terminalreporter.write(_report(pool))
    if hasattr(config, "workerinput") or not hasattr(config, "_tmp_path_factory"):
        return
    root = Path(config._tmp_path_factory.getbasetemp())
    for report in sorted(root.glob("popen-gw*/server_pool.txt")):  # the workers' pools
        terminalreporter.write(f"[{report.parent.name}] " + report.read_text())
