"""The load behind bench/results/sglang_serving_memory_*: hold touched anonymous memory so that MemAvailable stays
near TARGET MiB (the OOM killer takes this process first). Start it once the benchmark's servers are up:

    python bench/results/load_repro/memory_hog.py 100 &
"""
import mmap
import sys
import time

open("/proc/self/oom_score_adj", "w").write("1000")
target, chunk = int(sys.argv[1]) * 2**20, 8 * 2**20
held = []


def available() -> int:
    return next(int(ln.split()[1]) * 1024 for ln in open("/proc/meminfo") if ln.startswith("MemAvailable"))


while True:
    free = available()
    if free > target + chunk:
        held.append(mmap.mmap(-1, chunk))
        held[-1].write(b"\x01" * chunk)
    elif free < target - chunk and held:
        held.pop().close()
    else:
        time.sleep(0.1)
