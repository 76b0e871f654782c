"""The one list of SGLang run-time patches (compat.PATCHES): every target exists in the installed SGLang, the check
names a missing one, and every wrapping module really touches its target."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

if os.environ.get("JETFLOW_SKIP_SGLANG") == "1":
    pytest.skip("no SGLang", allow_module_level=True)

from jetflow_sglang.sglang import compat
from jetflow_sglang.sglang.cpu import ops as cpu_ops  # noqa: E402

MODULES = Path(compat.__file__).parent


def test_every_patch_target_resolves_and_check_passes():
    cpu_ops.install()  # the CPU shims (JETFLOW_SGLANG_CPU=1 in the servers)
    assert len(compat.PATCHES) >= 8
    for target, where, why in compat.PATCHES:
        assert compat._resolves(target), target
        assert (MODULES / where).is_file() and why
    compat.check()


def test_each_patch_has_its_upstream_change_and_the_serving_ones_are_few():
    """docs/UPSTREAM.md names, for every target, the SGLang change that would retire it; the fixes a JETFLOW server
    needs (SERVING) stay few: nine functions (one wrapped under two names)."""
    upstream = (MODULES.parents[1] / "docs" / "UPSTREAM.md").read_text()
    for target, _, _ in compat.PATCHES:
        short = target.removeprefix("sglang.srt.")
        assert f"`{short}`" in upstream, target
    assert compat.PATCHES == compat.SERVING + compat.CPU_HARNESS + compat.BENCHMARK + compat.DIAGNOSTIC
    assert len({t.rsplit(".", 1)[-1] for t, _, _ in compat.SERVING}) <= 9


def test_a_missing_target_is_named(monkeypatch):
    cpu_ops.install()
    monkeypatch.setattr(compat, "PATCHES", compat.PATCHES + [("sglang.srt.nowhere.Thing.method", "worker.py", "x")])
    with pytest.raises(compat.SGLangVersionError) as e:
        compat.check()
    assert "sglang.srt.nowhere.Thing.method (wrapped by worker.py)" in str(e.value)


def test_each_wrapping_module_names_its_target():
    """A patch added without its row here (or a row whose module no longer touches the target) fails this test."""
    for target, where, _ in compat.PATCHES:
        assert target.split(".")[-1] in (MODULES / where).read_text(), (target, where)


def test_wrap_installs_once_and_only_listed_targets(monkeypatch):
    """compat.wrap, which every run-time wrapper of the plugin goes through, replaces a listed target once and
    refuses one that PATCHES does not list."""
    import types

    mod = types.ModuleType("sglang.srt.fake_module")
    mod.f = lambda x: x + 1
    monkeypatch.setattr(compat, "PATCHES", compat.PATCHES + [("sglang.srt.fake_module.f", "worker.py", "test")])
    make = lambda original: (lambda x: original(x) * 10)  # noqa: E731
    assert compat.wrap(mod, "f", make) and mod.f(1) == 20
    assert not compat.wrap(mod, "f", make) and mod.f(1) == 20  # a second install changes nothing
    mod.g = lambda x: x
    with pytest.raises(RuntimeError, match="sglang.srt.fake_module.g is wrapped at run time but not listed"):
        compat.wrap(mod, "g", make)

    class Thing:  # an instance's method is named by its class
        def m(self):
            return 1
    Thing.__module__, Thing.__qualname__ = "sglang.srt.fake_module", "Thing"
    with pytest.raises(RuntimeError, match="sglang.srt.fake_module.Thing.m"):
        compat.wrap(Thing(), "m", make)
