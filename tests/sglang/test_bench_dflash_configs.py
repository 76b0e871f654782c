"""bench_serving's DFLASH peer configs without servers: their flags and environment, the one-line refusal without a
release-layout head, and the per-round report (tokens per verify, ratio to nospec's round, JETFLOW round fields)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    return load_script("bench_serving")


def test_dflash_configs_flags_and_environment():
    bench = _bench()
    args, env = bench.config_args("dflash-b16", "/jet", "jetflow", "/dfl")
    assert args[args.index("--speculative-algorithm") + 1] == "DFLASH"
    assert args[args.index("--speculative-num-draft-tokens") + 1] == "16"
    assert args[args.index("--speculative-draft-model-path") + 1] == "/dfl"
    assert env == {"JETFLOW_BENCH_DFLASH_PEER": "1"}  # the peer patches: these servers only
    args, env = bench.config_args("jetflow-dflash-b8", "/jet", "jetflow", "/dfl")
    assert args[args.index("--speculative-algorithm") + 1] == "JETFLOW"
    assert args[args.index("--speculative-draft-model-path") + 1] == "/dfl"
    assert env == {"JETFLOW_DRAFTER": "dflash", "JETFLOW_LOOKUP": "off"}  # counting syncs: --count-syncs only
    for name in ("nospec", "jetflow-b8", "ngram"):  # the others never get the switch
        assert "JETFLOW_BENCH_DFLASH_PEER" not in bench.config_args(name, "/jet", "jetflow", "/dfl")[1]
    with pytest.raises(ValueError, match="--dflash-head"):
        bench.config_args("dflash-b8", "/jet", "jetflow", None)


def test_a_named_dflash_config_without_a_release_head_is_one_line(tmp_path):
    target = tmp_path / "t"
    target.mkdir()
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_serving.py"), "--model", str(target), "--head",
                        str(tmp_path / "h"), "--configs", "nospec", "dflash-b8"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2
    last = p.stderr.strip().splitlines()[-1]
    assert "dflash-b8" in last and "--dflash-head DIR" in last, p.stderr
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_serving.py"), "--model", str(target), "--head",
                        str(tmp_path / "h"), "--dflash-head", str(target), "--configs", "dflash-b8"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2 and "no config.json there" in p.stderr.strip().splitlines()[-1], p.stderr


def test_the_report_has_every_round(tmp_path):
    bench = _bench()
    row = {"workload": "mixed", "concurrency": 1, "ttft_mean_s": 0.1, "itl_mean_ms": 10.0, "e2e_mean_s": 1.0,
           "e2e_p50_s": 1.0, "e2e_max_s": 1.0, "accept_length": None, "cached_tokens_mean": 0}
    results = [{**row, "config": "nospec", "output_tok_per_s": 10.0, "round_tok_per_s": [10.0, 20.0]},
               {**row, "config": "dflash-b8", "output_tok_per_s": 15.0, "round_tok_per_s": [15.0, 10.0],
                "round_tokens_per_verify": [1.5, 1.25]},
               {**row, "config": "jetflow-dflash-b8", "output_tok_per_s": 12.0, "round_tok_per_s": [12.0, 30.0],
                "round_tokens_per_verify": [1.5, 1.25],
                "round_jetflow": [{"host_syncs_per_round": 2, "round_split": {"draft": 0.4}}, {}]}]
    meta = {"date": "d", "command": "c", "model": "m", "head": "h", "drafter": "jetflow", "dtype": "float32",
            "requests_per_level": 1, "max_tokens": 8, "prefix_tokens": 400, "machine": "x", "sglang": "s",
            "torch": "t"}
    text = bench.write_report(tmp_path / "r", meta, results, {})
    assert "| mixed | dflash-b8 | 1 | 1 | 15.0 | 1.50x | 1.50 | - | - |" in text
    assert "| mixed | dflash-b8 | 1 | 2 | 10.0 | 0.50x | 1.25 | - | - |" in text
    assert '| mixed | jetflow-dflash-b8 | 1 | 1 | 12.0 | 1.20x | 1.50 | 2 | {"draft":0.4} |' in text
    assert "| mixed | nospec | 1 | 2 | 20.0 | - | - | - | - |" in text
    assert json.loads((tmp_path / "r.json").read_text())["results"][2]["round_jetflow"][0]["host_syncs_per_round"] == 2
    assert (tmp_path / "r.png").is_file()
    assert bench.tokens_per_verify([{"tokens": 10, "verify_ct": 4}, {"tokens": 6, "verify_ct": 4},
                                    {"tokens": 5, "verify_ct": None}]) == 2.0
    assert bench.tokens_per_verify([{"tokens": 5, "verify_ct": None}]) is None
