"""bench_serving's CPU accounting: a deliberate burst is booked as the burst's, not as foreign load, and a level's
foreign load is what no server, no client and no burst used (what --max-foreign-cpu reruns a round for)."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.scripts import load_script

psutil = pytest.importorskip("psutil")
ROOT = Path(__file__).resolve().parents[2]


def _bench():
    return load_script("bench_serving")


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


def test_a_busy_neighbour_is_named_before_the_run():
    """The pre-flight check names a process that keeps a core busy (as an idle SGLang server without --sleep-on-idle
    does), and not an idle one."""
    bench = _bench()

    def detached(code: str) -> int:  # not this process's child: the benchmark's own children are never foreign
        sh = subprocess.run(["sh", "-c", f'{sys.executable} -c "{code}" >/dev/null 2>&1 & echo $!'],
                            capture_output=True, text=True, check=True)
        return int(sh.stdout)

    busy, idle = detached("while True: pass"), detached("import time; time.sleep(60)")
    try:
        time.sleep(0.5)  # past the interpreter's start-up
        found = {b["pid"]: b for b in bench.busy_processes(seconds=1.5)}
    finally:
        for pid in (busy, idle):
            os.kill(pid, 9)
    assert busy in found and found[busy]["cores"] >= 0.5, found
    assert idle not in found, found


def test_a_kept_loaded_round_is_flagged_in_the_report(tmp_path):
    """A round still slowed after its reruns (4 cores' worth of foreign CPU over 10 s) is named in the report; a clean
    round (0.1 s) is not."""
    bench = _bench()
    clean = {"own_cpu_s": 9.0, "other_servers_cpu_s": 0.1, "burst_cpu_s": 0.0, "foreign_cpu_s": 0.1, "wall_s": 10.0}
    loaded = {**clean, "foreign_cpu_s": 40.0}
    row = {"workload": "mixed", "concurrency": 4, "output_tok_per_s": 10.0, "round_tok_per_s": [10.0, 40.0],
           "ttft_mean_s": 0.1, "itl_mean_ms": 10.0, "e2e_mean_s": 1.0, "e2e_p50_s": 1.0, "e2e_max_s": 1.0,
           "accept_length": None, "cached_tokens_mean": 0}
    results = [{**row, "config": "nospec", "round_cpu": [clean, clean]},
               {**row, "config": "jetflow-auto", "round_cpu": [clean, loaded]}]
    assert bench.loaded_rounds(results, 0.25) == ["jetflow-auto mixed c=4 round 2: 4.0 cores busy elsewhere"]
    meta = {"date": "d", "command": "c", "model": "m", "head": "h", "drafter": "jetflow", "dtype": "bfloat16",
            "requests_per_level": 8, "max_tokens": 64, "prefix_tokens": 400, "machine": "x", "sglang": "s",
            "torch": "t", "max_foreign_cpu": 0.25, "retries": 2,
            "busy_at_start": [{"pid": 7, "cores": 1.01, "command": "sglang::scheduler"}]}
    text = bench.write_report(tmp_path / "r", meta, results, {})
    assert "**Rounds kept under foreign load**" in text and "jetflow-auto mixed c=4 round 2" in text
    assert "nospec mixed" not in text.split("**Rounds kept under foreign load**")[1]
    assert "pid 7 used 1.01 cores: `sglang::scheduler`" in text


def test_the_report_shows_both_baselines(tmp_path):
    """Each row's ratio to stock plain SGLang (nospec) and to a JETFLOW server at budget 1 (the same serving stack
    without speculation), when the run has that config."""
    bench = _bench()
    row = {"workload": "mixed", "concurrency": 1, "ttft_mean_s": 0.1, "itl_mean_ms": 10.0, "e2e_mean_s": 1.0,
           "e2e_p50_s": 1.0, "e2e_max_s": 1.0, "accept_length": None, "cached_tokens_mean": 0}
    results = [{**row, "config": "nospec", "output_tok_per_s": 10.0},
               {**row, "config": "jetflow-b1", "output_tok_per_s": 12.5},
               {**row, "config": "jetflow-b8", "output_tok_per_s": 20.0}]
    meta = {"date": "d", "command": "c", "model": "m", "head": "h", "drafter": "jetflow", "dtype": "bfloat16",
            "requests_per_level": 8, "max_tokens": 64, "prefix_tokens": 400, "machine": "x", "sglang": "s",
            "torch": "t"}
    text = bench.write_report(tmp_path / "r", meta, results, {})
    b8 = next(ln for ln in text.splitlines() if ln.startswith("| mixed | jetflow-b8 |"))
    assert b8.split(" | ")[4:6] == ["2.00x", "1.60x"], b8
    b1 = next(ln for ln in text.splitlines() if ln.startswith("| mixed | jetflow-b1 |"))
    assert b1.split(" | ")[4:6] == ["1.25x", "-"], b1
