"""JetFlowServerConfig: every documented combination of SGLang flags and JETFLOW_* variables, and one-line errors."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from jetflow_sglang.sglang.config import DEFAULT_BUDGET, DEFAULT_WIDTH, default_budget, JetFlowConfigError, JetFlowServerConfig

HEADS = {}


@pytest.fixture(scope="module", autouse=True)
def heads(tmp_path_factory):
    """A tiny causal head (JetFlow) and a tiny bidirectional one (DFlash-style), config and weights on disk."""
    from tests.sglang.sgl_fixtures import build_tiny_head, build_tiny_qwen3

    root = tmp_path_factory.mktemp("cfg")
    target = build_tiny_qwen3(root / "tiny-qwen3")
    HEADS["causal"] = str(build_tiny_head(target, root / "causal"))
    HEADS["bidir"] = str(build_tiny_head(target, root / "bidir", causal=False))
    yield HEADS


GPU_DEFAULT = default_budget(None)  # no --device: SGLang picks an accelerator


def args(head="causal", n=None, topk=None, steps=None, device=None):
    head = HEADS.get(head, head)
    return SimpleNamespace(speculative_draft_model_path=head, speculative_num_draft_tokens=n,
                           speculative_eagle_topk=topk, speculative_num_steps=steps, device=device)


def cfg(env=None, **kw):
    return JetFlowServerConfig.from_server_args(args(**kw), env=env or {})


def test_defaults_with_and_without_a_head():
    c = cfg()
    assert (c.drafter, c.budget, c.adaptive, c.width, c.depth, c.tree) == \
        ("jetflow", GPU_DEFAULT, True, DEFAULT_WIDTH, None, "exact")  # auto, as `jetflow generate`
    assert c.head_dir == HEADS["causal"] and c.needs_head
    c = cfg(head=None)
    assert c.drafter == "ngram" and not c.needs_head and c.head_dir is None


def test_sglang_flags_map_to_budget_width_depth():
    c = cfg(n=6, topk=4, steps=3)
    assert (c.budget, c.adaptive, c.width, c.depth) == (6, False, 4, 3)
    assert cfg(topk=1).width == 1  # a chain is a valid tree


@pytest.mark.parametrize("env_budget,flag,want", [
    ("auto", None, (GPU_DEFAULT, True)),
    ("auto", 12, (12, True)),
    ("AUTO ", 5, (5, True)),
    ("16", None, (16, False)),
    ("16", 16, (16, False)),
    (None, 16, (16, False)),
    ("", 7, (7, False)),
    (None, None, (GPU_DEFAULT, True)),  # nothing given: auto up to the default budget
    ("", None, (GPU_DEFAULT, True)),
])
def test_budget_combinations(env_budget, flag, want):
    env = {} if env_budget is None else {"JETFLOW_BUDGET": env_budget}
    c = cfg(env, n=flag)
    assert (c.budget, c.adaptive) == want


def test_the_default_budget_follows_the_device():
    """auto's maximum: 32 on a CPU (16-32 node trees pay at batch 1 there), 64 on an accelerator; a flag or
    JETFLOW_BUDGET=N still fixes it, and JETFLOW_BUDGET=auto with the flag still caps auto."""
    assert (DEFAULT_BUDGET["cpu"], DEFAULT_BUDGET["accelerator"]) == (32, 64)
    for device, want in (("cpu", 32), ("CPU", 32), ("cuda", 64), (None, 64)):
        c = JetFlowServerConfig.from_server_args(args(device=device), env={})
        assert (c.budget, c.adaptive) == (want, True), device
    assert (cfg(n=16, device="cpu").budget, cfg(n=16, device="cpu").adaptive) == (16, False)
    c = cfg({"JETFLOW_BUDGET": "auto"}, n=16, device="cpu")
    assert (c.budget, c.adaptive) == (16, True)


def test_drafter_defaults_to_the_head_kind():
    assert cfg(head="bidir").drafter == "ddtree"  # a DFlash-style (bidirectional) head
    assert cfg({"JETFLOW_DRAFTER": "dflash"}, head="bidir").drafter == "dflash"


def test_env_drafter_and_tree():
    c = cfg({"JETFLOW_DRAFTER": "jetflow", "JETFLOW_TREE": "exact"})
    assert (c.drafter, c.tree) == ("jetflow", "exact")
    assert cfg({"JETFLOW_DRAFTER": "ngram"}).drafter == "ngram"  # a head may be given and unused
    assert cfg({"JETFLOW_DRAFTER": "ar"}, head=None).drafter == "ar"


@pytest.mark.parametrize("env,kw,needle", [
    ({"JETFLOW_BUDGET": "16"}, {"n": 8}, "conflicts with --speculative-num-draft-tokens 8"),
    ({"JETFLOW_BUDGET": "abc"}, {}, "JETFLOW_BUDGET must be auto or a positive integer; got 'abc'"),
    ({"JETFLOW_BUDGET": "fixed"}, {}, "JETFLOW_BUDGET must be auto or a positive integer"),
    ({"JETFLOW_BUDGET": "0"}, {}, "JETFLOW_BUDGET must be auto or an integer in 1..512; got 0"),
    ({"JETFLOW_BUDGET": "-3"}, {}, "got -3"),
    ({"JETFLOW_BUDGET": "5000"}, {}, "got 5000"),
    ({"JETFLOW_BUDGET": "513"}, {}, "got 513"),  # one maximum: the tree builders' (tree.MAX_BUDGET)
    ({}, {"n": 513}, "--speculative-num-draft-tokens must be at most 512; got 513"),
    ({}, {"n": 600}, "--speculative-num-draft-tokens must be at most 512; got 600"),
    ({}, {"n": 0}, "--speculative-num-draft-tokens must be at least 1"),
    ({}, {"topk": 0}, "--speculative-eagle-topk must be at least 1"),
    ({}, {"steps": -1}, "--speculative-num-steps must be at least 1"),
    ({}, {"n": "x"}, "--speculative-num-draft-tokens must be a positive integer"),
    ({"JETFLOW_DRAFTER": "eagle"}, {}, "JETFLOW_DRAFTER='eagle' is not a drafter"),
    ({"JETFLOW_DRAFTER": "ddtree"}, {"head": None}, "needs a draft head: pass --speculative-draft-model-path"),
    ({}, {"head": ""}, None),  # empty path = no head: ngram, no error
    ({"JETFLOW_TREE": "bfs"}, {}, "JETFLOW_TREE='bfs' is not a tree builder"),
    ({"JETFLOW_TREE": "paper"}, {}, "JETFLOW_TREE=paper is not available in the server"),
    ({"JETFLOW_DRAFTER": "jetflow-branch"}, {}, "JETFLOW_DRAFTER=jetflow-branch is not available in the batched"),
    ({"JETFLOW_WIDTH": "4"}, {}, "JETFLOW_WIDTH is no longer read; use --speculative-eagle-topk"),
    ({"JETFLOW_DEPTH": "2"}, {}, "JETFLOW_DEPTH is no longer read; use --speculative-num-steps"),
    ({"JETFLOW_DRAFTER": "ddtree"}, {}, "JETFLOW_DRAFTER=ddtree does not fit the causal head"),
    ({"JETFLOW_DRAFTER": "jetflow"}, {"head": "bidir"}, "JETFLOW_DRAFTER=jetflow does not fit the bidirectional"),
    ({}, {"head": "/no/such/head"}, "--speculative-draft-model-path /no/such/head: no draft-head checkpoint"),
    ({"JETFLOW_COST_PRIOR": '{"1": 0.01}'}, {"n": 8}, "JETFLOW_COST_PRIOR only applies to an adaptive budget"),
    ({"JETFLOW_BUDGET": "auto", "JETFLOW_COST_PRIOR": "[1]"}, {}, "JETFLOW_COST_PRIOR must be a JSON object"),
    ({"JETFLOW_BUDGET": "auto", "JETFLOW_COST_PRIOR": '{"0": 0.1}'}, {}, "JETFLOW_COST_PRIOR must be"),
    ({"JETFLOW_BUDGET": "auto", "JETFLOW_COST_PRIOR": '{"2": -1}'}, {}, "JETFLOW_COST_PRIOR must be"),
    ({"JETFLOW_BUDGET": "auto", "JETFLOW_COST_PRIOR": '{"2": "inf"}'}, {}, "JETFLOW_COST_PRIOR must be"),
    ({"JETFLOW_BUDGET": "auto", "JETFLOW_COST_PRIOR": '{"x": 1}'}, {}, "JETFLOW_COST_PRIOR must be"),
])
def test_bad_values_give_one_line_errors(env, kw, needle):
    if needle is None:
        assert cfg(env, **kw).drafter == "ngram"
        return
    with pytest.raises(JetFlowConfigError) as e:
        cfg(env, **kw)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_cost_prior():
    c = cfg({"JETFLOW_BUDGET": "auto", "JETFLOW_COST_PRIOR": '{"1": 0.01, "8": 0.5}'})
    assert c.cost_prior == {1: 0.01, 8: 0.5} and c.adaptive
    assert cfg().cost_prior is None


def test_reads_the_raw_input_snapshot_of_a_resolved_record():
    """On SGLang's record, resolution declares topk=steps=1 for JETFLOW; the operator's values stay in _raw_input."""
    a = args(topk=1, steps=1, n=8)
    a._raw_input = {"speculative_eagle_topk": 5, "speculative_num_steps": 3, "speculative_num_draft_tokens": 12,
                    "speculative_draft_model_path": HEADS["causal"]}
    c = JetFlowServerConfig.from_server_args(a, env={})
    assert (c.width, c.depth, c.budget) == (5, 3, 12)


def test_default_env_is_os_environ(monkeypatch):
    monkeypatch.setenv("JETFLOW_BUDGET", "16")
    monkeypatch.delenv("JETFLOW_DRAFTER", raising=False)
    c = JetFlowServerConfig.from_server_args(args())
    assert (c.budget, c.adaptive) == (16, False)


def test_config_is_frozen_and_describes_itself():
    c = cfg()
    with pytest.raises(Exception):
        c.budget = 3
    assert "budget=auto, up to 64" in c.describe() and "width=8" in c.describe()
    assert "budget=fixed 8" in cfg(n=8).describe()


def test_drafter_names_match_the_core():
    from jetflow_sglang.sglang import config
    from jetflow_sglang.draft import drafters

    assert set(config.DRAFTERS) == set(drafters.DRAFTERS)
    assert set(config.HEAD_DRAFTERS) <= set(drafters.DRAFTERS)


# -- through SGLang's own record and resolution recorder (what the launcher and the schedulers see) ---------------
@pytest.mark.parametrize("env,flag,want", [({"JETFLOW_BUDGET": "16"}, None, (16, False)),
                                           ({"JETFLOW_BUDGET": "auto"}, None, (32, True)),  # a CPU record
                                           ({"JETFLOW_BUDGET": "auto"}, 12, (12, True)),
                                           ({"JETFLOW_BUDGET": "16"}, 16, (16, False))])
def test_plugin_declares_the_budget_on_sglang_record(env, flag, want, monkeypatch):
    if os.environ.get("JETFLOW_SKIP_SGLANG") == "1":
        pytest.skip("no SGLang")
    pytest.importorskip("sglang")
    from sglang.srt.arg_groups.overrides import record_foreign_defaults, resolving_view
    from sglang.srt.server_args import ServerArgs

    from jetflow_sglang.sglang.plugin import _spec_class

    for k in ("JETFLOW_BUDGET", "JETFLOW_DRAFTER", "JETFLOW_TREE", "JETFLOW_COST_PRIOR"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    sa = ServerArgs(model_path=HEADS["causal"], device="cpu", speculative_algorithm="JETFLOW",
                    speculative_draft_model_path=HEADS["causal"], speculative_num_draft_tokens=flag,
                    speculative_eagle_topk=4, speculative_num_steps=3)
    spec = _spec_class()("JETFLOW", factory=lambda sa: None)
    record_foreign_defaults(sa, "test", spec.handle_server_args)
    view = resolving_view(sa)
    assert (view.speculative_num_draft_tokens, view.speculative_eagle_topk, view.speculative_num_steps) == \
        (want[0], 1, 1)  # what SGLang sizes its KV reservation from
    assert view.disable_overlap_schedule and not view.disable_radix_cache
    c = JetFlowServerConfig.from_server_args(sa)  # what each scheduler's worker computes from the same record
    assert (c.budget, c.adaptive, c.width, c.depth) == (*want, 4, 3)


def test_head_pool_counts_in_the_kv_budget():
    """fixes/memory.py: a JETFLOW target worker's per-token cell size grows by the head's K/V bytes (as EAGLE/DFLASH
    drafts do in SGLang's pool configurator); the draft worker, other algorithms and head-less drafters add 0."""
    import torch

    from jetflow_sglang.head import read_head_config
    from jetflow_sglang.sglang.fixes.memory import head_bytes_per_token, jetflow_cell_bytes

    hcfg, _ = read_head_config(HEADS["causal"])
    model = SimpleNamespace(dtype=torch.bfloat16, hf_config=None)
    kvc = lambda name, draft=False: SimpleNamespace(spec_algorithm=SimpleNamespace(name=name),  # noqa: E731
                                                    is_draft_worker=draft, model_config=model)
    want = hcfg.num_layers * 2 * hcfg.num_kv_heads * hcfg.head_dim * 2
    assert head_bytes_per_token(hcfg, torch.bfloat16) == want > 0
    assert jetflow_cell_bytes(kvc("JETFLOW"), HEADS["causal"]) == want + 4  # K/V rows + the int32 token id
    assert jetflow_cell_bytes(kvc("JETFLOW", draft=True), HEADS["causal"]) == 0
    assert jetflow_cell_bytes(kvc("EAGLE"), HEADS["causal"]) == 0
    assert jetflow_cell_bytes(kvc("JETFLOW"), None) == 4  # the ngram drafter keeps token ids only
    if os.environ.get("JETFLOW_SKIP_SGLANG") != "1":  # the hook wraps SGLang's default configurator once
        pytest.importorskip("sglang")
        from jetflow_sglang.sglang.cpu import ops as cpu_ops

        cpu_ops.install()  # as in every CPU SGLang process (its imports reach torchvision and sgl_kernel)
        from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator

        from jetflow_sglang.sglang.fixes.memory import install

        install()
        install()
        assert DefaultPoolConfigurator.__init__._jetflow


@pytest.mark.parametrize("env,device,want", [({}, "cpu", True), ({}, "cuda", False), ({}, None, False),
                                             ({"JETFLOW_LOOKUP": "off"}, "cpu", False),
                                             ({"JETFLOW_LOOKUP": "on"}, "cuda", True),
                                             ({"JETFLOW_LOOKUP": "1"}, "cpu", True)])
def test_lookup_setting(env, device, want):
    sa = SimpleNamespace(speculative_draft_model_path=HEADS["causal"], device=device)
    c = JetFlowServerConfig.from_server_args(sa, env=env)
    assert c.lookup is want and f"lookup={'on' if want else 'off'}" in c.describe()


def test_lookup_errors():
    sa = SimpleNamespace(speculative_draft_model_path=HEADS["causal"], device="cpu")
    with pytest.raises(JetFlowConfigError, match="JETFLOW_LOOKUP must be auto, on or off; got 'maybe'"):
        JetFlowServerConfig.from_server_args(sa, env={"JETFLOW_LOOKUP": "maybe"})
    no_head = SimpleNamespace(device="cpu")
    with pytest.raises(JetFlowConfigError, match="JETFLOW_LOOKUP=on merges prompt lookup into a head"):
        JetFlowServerConfig.from_server_args(no_head, env={"JETFLOW_LOOKUP": "on"})
    assert JetFlowServerConfig.from_server_args(no_head, env={}).lookup is False  # auto: ngram is lookup already


@pytest.mark.slow
@pytest.mark.parametrize("budget", ["513"])  # the first value past the maximum (512)
def test_a_budget_over_the_maximum_is_refused_at_launch(budget, tmp_path):
    """`--speculative-num-draft-tokens 513` passed the launch check when the server's maximum was 1024 and failed
    later in the tree builder; now the launcher refuses it in one line with exit code 2, before any model loads."""
    if os.environ.get("JETFLOW_SKIP_SGLANG") == "1":
        pytest.skip("no SGLang")
    import subprocess
    import sys
    import time

    from tests.sglang.sgl_fixtures import shared_head, shared_tiny

    target = shared_tiny()
    head = shared_head(target)
    env = {**os.environ, "JETFLOW_SGLANG_CPU": "1", "HF_HUB_OFFLINE": "1"}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", str(target), "--device", "cpu",
                          "--port", "1", "--speculative-algorithm", "JETFLOW", "--speculative-draft-model-path",
                          str(head), "--speculative-num-draft-tokens", budget], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [f"error: --speculative-num-draft-tokens must be at most 512; got {budget}"], out.stderr[-2000:]
    assert "Traceback" not in out.stderr and time.monotonic() - t0 < 120


@pytest.mark.parametrize("device,value,want", [("cpu", None, False), ("cpu", "auto", False), ("cpu", "on", True),
                                               ("cuda", None, True), ("cuda", "off", False), ("cpu", "0", False)])
def test_overlap_follows_sglang_on_the_cpu_and_the_switch(device, value, want):
    """JETFLOW_OVERLAP: auto keeps a CPU server synchronous (as SGLang's own speculative algorithms) and overlaps
    elsewhere; on/off force it."""
    a = SimpleNamespace(speculative_draft_model_path=HEADS["causal"], device=device)
    c = JetFlowServerConfig.from_server_args(a, env={} if value is None else {"JETFLOW_OVERLAP": value})
    assert c.overlap is want


def test_bad_overlap_and_count_switches_are_one_line_errors():
    for name in ("JETFLOW_OVERLAP", "JETFLOW_COUNT_SYNCS"):
        with pytest.raises(JetFlowConfigError, match=name):
            cfg(env={name: "sometimes"})
    assert cfg(env={"JETFLOW_COUNT_SYNCS": "1"}).count_syncs and not cfg().count_syncs


def test_plugin_leaves_overlap_on_when_asked(monkeypatch):
    """On a CPU with JETFLOW_OVERLAP=on the plugin does not declare disable_overlap_schedule (SGLang's default: off)."""
    if os.environ.get("JETFLOW_SKIP_SGLANG") == "1":
        pytest.skip("no SGLang")
    pytest.importorskip("sglang")
    from sglang.srt.arg_groups.overrides import record_foreign_defaults, resolving_view
    from sglang.srt.server_args import ServerArgs

    from jetflow_sglang.sglang.plugin import _spec_class

    for value, disabled in (("on", False), ("off", True)):
        monkeypatch.setenv("JETFLOW_OVERLAP", value)
        sa = ServerArgs(model_path=HEADS["causal"], device="cpu", speculative_algorithm="JETFLOW",
                        speculative_draft_model_path=HEADS["causal"])
        record_foreign_defaults(sa, "test", _spec_class()("JETFLOW", factory=lambda sa: None).handle_server_args)
        assert bool(resolving_view(sa).disable_overlap_schedule) is disabled
