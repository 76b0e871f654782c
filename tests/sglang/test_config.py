"""JetFlowServerConfig: every documented combination of SGLang flags and JETFLOW_* variables, and one-line errors."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from jetflow_sglang.config import DEFAULT_BUDGET, DEFAULT_WIDTH, JetFlowConfigError, JetFlowServerConfig


def args(head="/heads/h", n=None, topk=None, steps=None):
    return SimpleNamespace(speculative_draft_model_path=head, speculative_num_draft_tokens=n,
                           speculative_eagle_topk=topk, speculative_num_steps=steps)


def cfg(env=None, **kw):
    return JetFlowServerConfig.from_server_args(args(**kw), env=env or {})


def test_defaults_with_and_without_a_head():
    c = cfg()
    assert (c.drafter, c.budget, c.adaptive, c.width, c.depth, c.tree) == \
        ("jetflow", DEFAULT_BUDGET, False, DEFAULT_WIDTH, None, "exact")
    assert c.head_dir == "/heads/h" and c.needs_head
    c = cfg(head=None)
    assert c.drafter == "ngram" and not c.needs_head and c.head_dir is None


def test_sglang_flags_map_to_budget_width_depth():
    c = cfg(n=6, topk=4, steps=3)
    assert (c.budget, c.adaptive, c.width, c.depth) == (6, False, 4, 3)
    assert cfg(topk=1).width == 1  # a chain is a valid tree


@pytest.mark.parametrize("env_budget,flag,want", [
    ("auto", None, (DEFAULT_BUDGET, True)),
    ("auto", 12, (12, True)),
    ("AUTO ", 5, (5, True)),
    ("16", None, (16, False)),
    ("16", 16, (16, False)),
    (None, 16, (16, False)),
    ("", 7, (7, False)),
])
def test_budget_combinations(env_budget, flag, want):
    env = {} if env_budget is None else {"JETFLOW_BUDGET": env_budget}
    c = cfg(env, n=flag)
    assert (c.budget, c.adaptive) == want


def test_env_drafter_and_tree():
    c = cfg({"JETFLOW_DRAFTER": "ddtree", "JETFLOW_TREE": "paper"})
    assert (c.drafter, c.tree) == ("ddtree", "paper")
    assert cfg({"JETFLOW_DRAFTER": "ngram"}).drafter == "ngram"  # a head may be given and unused
    assert cfg({"JETFLOW_DRAFTER": "ar"}, head=None).drafter == "ar"


@pytest.mark.parametrize("env,kw,needle", [
    ({"JETFLOW_BUDGET": "16"}, {"n": 8}, "conflicts with --speculative-num-draft-tokens 8"),
    ({"JETFLOW_BUDGET": "abc"}, {}, "JETFLOW_BUDGET must be auto or a positive integer; got 'abc'"),
    ({"JETFLOW_BUDGET": "fixed"}, {}, "JETFLOW_BUDGET must be auto or a positive integer"),
    ({"JETFLOW_BUDGET": "0"}, {}, "JETFLOW_BUDGET must be auto or an integer in 1..1024; got 0"),
    ({"JETFLOW_BUDGET": "-3"}, {}, "got -3"),
    ({"JETFLOW_BUDGET": "5000"}, {}, "got 5000"),
    ({}, {"n": 0}, "--speculative-num-draft-tokens must be at least 1"),
    ({}, {"topk": 0}, "--speculative-eagle-topk must be at least 1"),
    ({}, {"steps": -1}, "--speculative-num-steps must be at least 1"),
    ({}, {"n": "x"}, "--speculative-num-draft-tokens must be a positive integer"),
    ({"JETFLOW_DRAFTER": "eagle"}, {}, "JETFLOW_DRAFTER='eagle' is not a drafter"),
    ({"JETFLOW_DRAFTER": "ddtree"}, {"head": None}, "needs a draft head: pass --speculative-draft-model-path"),
    ({}, {"head": ""}, None),  # empty path = no head: ngram, no error
    ({"JETFLOW_TREE": "bfs"}, {}, "JETFLOW_TREE='bfs' is not a tree builder"),
    ({"JETFLOW_WIDTH": "4"}, {}, "JETFLOW_WIDTH is no longer read; use --speculative-eagle-topk"),
    ({"JETFLOW_DEPTH": "2"}, {}, "JETFLOW_DEPTH is no longer read; use --speculative-num-steps"),
])
def test_bad_values_give_one_line_errors(env, kw, needle):
    if needle is None:
        assert cfg(env, **kw).drafter == "ngram"
        return
    with pytest.raises(JetFlowConfigError) as e:
        cfg(env, **kw)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_reads_the_raw_input_snapshot_of_a_resolved_record():
    """On SGLang's record, resolution declares topk=steps=1 for JETFLOW; the operator's values stay in _raw_input."""
    a = args(topk=1, steps=1, n=8)
    a._raw_input = {"speculative_eagle_topk": 5, "speculative_num_steps": 3, "speculative_num_draft_tokens": 12,
                    "speculative_draft_model_path": "/heads/h"}
    c = JetFlowServerConfig.from_server_args(a, env={})
    assert (c.width, c.depth, c.budget) == (5, 3, 12)


def test_default_env_is_os_environ(monkeypatch):
    monkeypatch.setenv("JETFLOW_BUDGET", "auto")
    monkeypatch.delenv("JETFLOW_DRAFTER", raising=False)
    assert JetFlowServerConfig.from_server_args(args()).adaptive


def test_config_is_frozen_and_describes_itself():
    c = cfg()
    with pytest.raises(Exception):
        c.budget = 3
    assert "budget=fixed 8" in c.describe() and "width=8" in c.describe()


def test_drafter_names_match_the_core():
    from jetflow_sglang import config, drafters

    assert set(config.DRAFTERS) == set(drafters.DRAFTERS)
    assert set(config.HEAD_DRAFTERS) <= set(drafters.DRAFTERS)
