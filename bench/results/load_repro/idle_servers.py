"""The load behind bench/results/sglang_serving_idle_servers_*: K SGLang servers started WITHOUT --sleep-on-idle (an
idle one busy-polls a whole core), as a colleague's servers on the same CPU. They are kept stopped (SIGSTOP) and wake
only while the benchmark whose log is watched runs one of the named levels (its tqdm postfix), for at most
--max-seconds. Run it, wait for "ready", then start bench_serving.py with its output in --log:

    python bench/results/load_repro/idle_servers.py 6 /tmp/bench.log "jetflow-auto mixed c=4" &
    python scripts/bench_serving.py ... > /tmp/bench.log 2>&1
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("servers", type=int)
ap.add_argument("log", type=Path, help="bench_serving.py's stderr, redirected to a file")
ap.add_argument("levels", help="comma-separated postfixes, e.g. 'jetflow-auto mixed c=4,nospec mixed c=4'")
ap.add_argument("--max-seconds", type=float, default=1e9)
ap.add_argument("--model", default=os.path.expanduser("~/.cache/jetflow/SmolLM2-135M-Instruct"))
a = ap.parse_args()
levels = a.levels.split(",")
env = {**os.environ, "JETFLOW_SGLANG_CPU": "1", "OMP_NUM_THREADS": "1"}
procs = [subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--model-path", a.model, "--device", "cpu",
                           "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(31000 + 1100 * i),
                           "--max-total-tokens", "4096", "--max-running-requests", "4"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
         for i in range(a.servers)]


def signal_all(sig):
    for p in procs:
        os.killpg(p.pid, sig)


try:
    import requests
    for i in range(a.servers):
        while True:
            try:
                if requests.get(f"http://127.0.0.1:{31000 + 1100 * i}/health", timeout=2).ok:
                    break
            except requests.RequestException:
                time.sleep(2)
    signal_all(signal.SIGSTOP)
    print("ready (servers stopped)", flush=True)
    awake, woke_at, finished = None, 0.0, False
    while not finished:
        text = a.log.read_text(errors="ignore") if a.log.exists() else ""
        postfixes = re.findall(r"level(?:/s)?, ([^\]]+)\]", text)
        level = postfixes[-1].strip() if postfixes else ""
        finished = "100%|" in text.split("bench:")[-1]
        if awake is None and level in levels:  # wake once, for the first of the named levels
            signal_all(signal.SIGCONT)
            awake, woke_at = True, time.time()
            print(time.strftime("%T"), "awake at", level, flush=True)
        elif awake and (level not in levels or time.time() - woke_at > a.max_seconds):
            signal_all(signal.SIGSTOP)
            awake = False
            print(time.strftime("%T"), "stopped at", level, flush=True)
        time.sleep(0.2)
finally:
    signal_all(signal.SIGCONT)
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
