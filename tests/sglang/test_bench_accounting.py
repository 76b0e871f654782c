"""bench_serving's CPU accounting: a deliberate burst is booked as the burst's, not as foreign load, and a level's
foreign load is what no server, no client and no burst used (what --max-foreign-cpu reruns a round for)."""
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")
ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "scripts" / "bench_serving.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_burst_is_booked_apart_from_foreign_load():
    bench = _bench()
    cores = os.cpu_count() or 1
    before = bench.cpu_snapshot({})
    burst = bench.Burst(1.0)
    assert len(burst.procs) == cores
    burst.join()
    cpu = bench.cpu_during(before, bench.cpu_snapshot({}), "none")
    assert cpu["burst_cpu_s"] >= 0.6 * cores, cpu  # each busy process ran ~1 s (start-up aside)
    assert cpu["foreign_cpu_s"] <= 0.5 * cores, cpu  # not booked as foreign (it would be ~cores seconds)


def test_foreign_load_is_seen():
    """A busy process this benchmark did not start (here: started by the test, not through Burst) is foreign."""
    bench = _bench()
    before = bench.cpu_snapshot({})
    hog = subprocess.Popen([sys.executable, "-c", "import time\nend = time.perf_counter() + 1.5\n"
                            "while time.perf_counter() < end: pass"])
    time.sleep(1.6)
    cpu = bench.cpu_during(before, bench.cpu_snapshot({}), "none")  # measured before the hog is reaped
    hog.wait()
    assert cpu["foreign_cpu_s"] >= 0.8, cpu
    assert cpu["burst_cpu_s"] == 0, cpu


def test_no_burst_starts_nothing():
    assert _bench().Burst(0).procs == []
