"""One drafter registry drives the CLI, load_stack, the server config and the worker; load_stack's defaults are the
CLI's."""
from __future__ import annotations

import inspect

import pytest

from jetflow_sglang.draft import registry
from jetflow_sglang.cli import parser
from jetflow_sglang.sglang.config import JetFlowConfigError, JetFlowServerConfig
from jetflow_sglang.draft.drafters import make_drafter
from jetflow_sglang.engine.stack import check_stack_args, load_stack


def test_every_list_of_drafters_is_the_registry():
    import jetflow_sglang.sglang.config as config
    import jetflow_sglang.draft.drafters as drafters
    import jetflow_sglang.draft.fit as fit

    assert drafters.DRAFTERS == config.DRAFTERS == registry.DRAFTERS == tuple(registry.REGISTRY)
    assert fit.CAUSAL_DRAFTERS == registry.CAUSAL_DRAFTERS
    assert fit.BIDIRECTIONAL_DRAFTERS == registry.BIDIRECTIONAL_DRAFTERS
    choices = next(a for a in parser()._subparsers._group_actions[0].choices["generate"]._actions
                   if a.dest == "drafter").choices
    assert tuple(choices) == registry.DRAFTERS
    for name, row in registry.REGISTRY.items():
        assert (row.head is None) == (row.mode is None), name


def _names_listed(msg: str) -> bool:
    return all(n in msg for n in registry.DRAFTERS)


def test_an_unknown_drafter_is_refused_with_the_registry_names():
    with pytest.raises(ValueError) as e:
        registry.spec("eagle")
    assert _names_listed(str(e.value))
    with pytest.raises(ValueError) as e:
        make_drafter("eagle")
    assert _names_listed(str(e.value))
    with pytest.raises(ValueError) as e:
        check_stack_args("eagle", 8, "cpu", "exact", None, "auto")
    assert _names_listed(str(e.value))
    from types import SimpleNamespace

    with pytest.raises(JetFlowConfigError) as e:
        JetFlowServerConfig.from_server_args(SimpleNamespace(), env={"JETFLOW_DRAFTER": "eagle"})
    assert _names_listed(str(e.value))
    with pytest.raises(SystemExit):
        parser().parse_args(["generate", "x", "--drafter", "eagle"])


def test_cli_only_drafters_are_refused_by_the_server_with_the_server_names():
    from types import SimpleNamespace

    from jetflow_sglang.paths import DEFAULT_HEAD_DIR

    assert registry.CLI_ONLY_DRAFTERS  # jetflow-branch
    for name in registry.CLI_ONLY_DRAFTERS:
        with pytest.raises(JetFlowConfigError) as e:
            JetFlowServerConfig.from_server_args(SimpleNamespace(speculative_draft_model_path=str(DEFAULT_HEAD_DIR)),
                                                 env={"JETFLOW_DRAFTER": name})
        assert all(n in str(e.value) for n in registry.SERVER_DRAFTERS)


def test_load_stack_defaults_are_the_clis():
    args = parser().parse_args(["generate", "x"])
    defaults = {k: p.default for k, p in inspect.signature(load_stack).parameters.items()}
    for key in ("drafter", "width", "tree", "depth", "lookup", "exact", "dtype", "device"):
        assert defaults[key] == getattr(args, key), key
    assert defaults["target_dir"] is None and defaults["head_dir"] is None and args.target is None and args.head is None


@pytest.mark.slow
def test_load_stack_builds_the_clis_drafter():
    """The default model and head: load_stack() with no argument drafts as `jetflow generate` does (jetflow + prompt
    lookup), and lookup=False gives the head alone."""
    _, drafter = load_stack()
    assert hasattr(drafter, "lookup") and drafter.base.name == "jetflow"
    _, alone = load_stack(lookup=False)
    assert not hasattr(alone, "lookup") and alone.name == "jetflow"
