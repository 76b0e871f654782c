"""Test-session settings that must exist before any test module imports torch, transformers or triton."""
import atexit
import os
import shutil
import tempfile

# Triton decides at import time whether its own library functions run in the interpreter, and transformers may import
# triton early. Without a GPU the kernels can only run interpreted, so turn that on before anything is imported.
if os.environ.get("JETFLOW_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _private_cache() -> str:
    """A cache folder for this test session, so that nothing the tests write (cost profiles of tiny pytest models)
    lands in the user's cache. The converted default target is linked in, and the user's cost profiles are copied
    (copied: the session's writes stay in the session). The folder goes when the session ends; server processes the
    tests start inherit it through JETFLOW_CACHE."""
    from jetflow_sglang.paths import DEFAULT_TARGET_NAME, cache_dir

    user, session = cache_dir(), tempfile.mkdtemp(prefix="jetflow-test-cache-")
    if (user / DEFAULT_TARGET_NAME / "config.json").is_file():
        os.symlink(user / DEFAULT_TARGET_NAME, os.path.join(session, DEFAULT_TARGET_NAME))
    if (user / "cost_profile.json").is_file():
        shutil.copy(user / "cost_profile.json", session)
    atexit.register(shutil.rmtree, session, True)
    return session


os.environ["JETFLOW_CACHE"] = _private_cache()


# -- the run's time by module (printed at the end; CI has a time limit, and a module's servers start in its setups) --
_MODULE_S: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _MODULE_S[path] = _MODULE_S.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _MODULE_S:
        return
    total = sum(_MODULE_S.values())
    terminalreporter.write_sep("=", f"time by module: {total / 60:.1f} min in tests")
    for path, sec in sorted(_MODULE_S.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{sec:8.1f} s  {100 * sec / total:5.1f}%  {path}")
