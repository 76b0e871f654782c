"""The built wheel, installed the way a user installs it: `pip wheel` builds it from the project's files, and `pip
install --no-deps --no-index` puts it into a fresh venv outside the checkout whose dependencies are already present
(the project venv's site-packages, linked in entry by entry, minus this project's own editable install). There, with
the working folder outside the checkout, `jetflow paths`, `jetflow generate`, `jetflow-explorer --help`, the shipped
heads and the SGLang plugin must work from the installed files alone."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.sglang.sgl_fixtures import build_tiny_head, build_tiny_qwen3

ROOT = Path(__file__).resolve().parents[1]
PKG = "jetflow_sglang"
DEFAULT_TARGET = "SmolLM2-135M-Instruct"  # jetflow_sglang.paths.DEFAULT_TARGET_NAME


def shipped_files(src: Path) -> set[str]:
    """Every file of the package in `src` that the wheel must carry: modules, heads and data (not docs)."""
    return {p.relative_to(src).as_posix() for p in (src / PKG).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".md")}


def build_wheel(out: Path) -> Path:
    """`pip wheel` on a copy of the project's files: pyproject.toml, README.md and every top-level folder that holds
    an __init__.py (the package, and the folders setuptools must leave out), so that a checkout's stale build/ folder
    cannot leak in and nothing is written into the checkout; offline, with the setuptools already installed."""
    src = out / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in (p for p in ROOT.iterdir() if (p / "__init__.py").is_file()):
        shutil.copytree(folder, src / folder.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    assert (src / PKG).is_dir()
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "--disable-pip-version-check", ".", "-w", str(out / "dist")],
                          cwd=src, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (out / "dist").glob("jetflow_sglang-*.whl")
    return wheel


def own_entries(site: Path) -> set[str]:
    """The top-level names this project's own install put into `site`: its dist-info and what its RECORD lists (the
    editable finder and .pth, or the package). Read from `site` itself: importlib.metadata would also find the
    checkout's jetflow_sglang.egg-info first on the test's sys.path."""
    names = {PKG}
    for info in site.glob(f"{PKG}-*.dist-info"):
        names.add(info.name)
        record = (info / "RECORD").read_text() if (info / "RECORD").is_file() else ""
        names |= {row.split(",")[0].split("/")[0] for row in record.splitlines() if row and not row.startswith("..")}
    return names


def make_venv(out: Path) -> Path:
    """A venv whose site-packages links every entry of the project venv's site-packages except this project. Nothing
    pip writes for the wheel may go through a link into the project venv: that is checked before installing."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(out)], check=True, timeout=120)
    py = out / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    ours = Path(sysconfig.get_paths()["purelib"])
    skip = own_entries(ours)
    for entry in ours.iterdir():
        if entry.name not in skip:
            (site / entry.name).symlink_to(entry)
    linked = [p.name for p in site.iterdir()
              if p.name == PKG or p.name.startswith((f"{PKG}-", f"__editable__.{PKG}", f"__editable___{PKG}"))]
    assert not linked, f"the project's own install would be linked in: {linked}"
    return py


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, a clean environment for it, its working folder outside the checkout, the wheel, the folder it
    was built from)."""
    root = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(root)
    py = make_venv(root / "venv")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PATH=f"{py.parent}{os.pathsep}{env.get('PATH', '')}", PYTHONNOUSERSITE="1", OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", JETFLOW_CACHE=str(root / "cache"), GRADIO_ANALYTICS_ENABLED="False")
    work = root / "work"
    work.mkdir()
    proc = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check",
                           str(wheel)], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return py, env, work, wheel, root / "src"


def run(installed, *cmd, timeout=600, extra_env=None) -> subprocess.CompletedProcess:
    py, env, work, *_ = installed
    proc = subprocess.run([str(c) for c in cmd], cwd=work, env={**env, **(extra_env or {})}, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def inside(path, folder: Path) -> bool:
    return Path(path).resolve().is_relative_to(folder.resolve())


def test_the_wheel_holds_the_package_and_nothing_beside_it(installed):
    *_, wheel, src = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    dist_info = wheel.name.split("-py")[0] + ".dist-info"
    assert {n.split("/")[0] for n in names} == {PKG, dist_info}, sorted(names)  # no top-level `viz` or `tests`
    missing = shipped_files(src) - names
    assert not missing, f"files of the package missing from the wheel: {sorted(missing)}"
    assert {f"{PKG}/heads/smollm2-135m-instruct/model.safetensors", f"{PKG}/data/gsm8k_train.jsonl",
            f"{PKG}/heads/smollm2-135m-instruct-bidir/config.json", f"{PKG}/viz/app.py"} <= names
    entry_points = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert "jetflow-explorer = jetflow_sglang.viz.app:main" in entry_points


def test_the_package_is_imported_from_the_venv_not_the_checkout(installed):
    py, *_ = installed
    out = run(installed, py, "-c", "import json, importlib.metadata as m, jetflow_sglang, jetflow_sglang.viz; "
              "d = [str(x.locate_file('')) for x in m.distributions() if x.metadata['Name'] == 'jetflow-sglang']; "
              "print(json.dumps([jetflow_sglang.__file__, jetflow_sglang.viz.__file__, d]))").stdout
    pkg_file, viz_file, dists = json.loads(out)
    venv = py.parent.parent
    assert inside(pkg_file, venv) and inside(viz_file, venv) and not inside(pkg_file, ROOT), out
    assert len(dists) == 1 and inside(dists[0], venv), dists  # one jetflow-sglang, the wheel's, not the editable one


def test_jetflow_paths_points_into_the_installed_heads(installed):
    py, env, *_ = installed
    cache = Path(env["JETFLOW_CACHE"])
    cache.mkdir(exist_ok=True)
    # `jetflow paths` prepares the default target: link in the converted one (the test session's cache links the
    # user's), or else a tiny model under its name, so that the GGUF is not converted here
    converted = Path(os.environ.get("JETFLOW_CACHE", "")) / DEFAULT_TARGET
    if not (cache / DEFAULT_TARGET).exists():
        (cache / DEFAULT_TARGET).symlink_to(converted if (converted / "config.json").is_file()
                                            else build_tiny_qwen3(cache.parent / "tiny-target"))
    out = run(installed, py.parent / "jetflow", "paths").stdout
    rows = dict(line.split(":", 1) for line in out.splitlines())
    head, bidir = Path(rows["head"].strip()), Path(rows["bidirectional head"].strip())
    assert Path(rows["target"].strip()) == cache / DEFAULT_TARGET, out
    venv = py.parent.parent
    for folder in (head, bidir):
        assert inside(folder, venv), out
        assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file(), folder
    # both shipped heads load from the installed files
    run(installed, py, "-c", "from jetflow_sglang.head import load_head; from jetflow_sglang.paths import "
        "DEFAULT_HEAD_DIR, bidir_dir; load_head(DEFAULT_HEAD_DIR); load_head(bidir_dir(DEFAULT_HEAD_DIR))")


def test_jetflow_generate_runs_from_the_wheel(installed, tmp_path):
    py, *_ = installed
    target = build_tiny_qwen3(tmp_path / "target")
    head = build_tiny_head(target, tmp_path / "head")
    out = run(installed, py.parent / "jetflow", "generate", "The quick brown fox", "--target", target, "--head", head,
              "--budget", "8", "--max-new-tokens", "16", "--compare-ar", "--json", "--threads", "1",
              "--dtype", "float32").stdout
    res = json.loads(out.strip().splitlines()[-1])
    assert res["new_tokens"] >= 1 and res["lossless"] is True and res["tau"] >= 1.0, res


def test_the_explorer_entry_point_starts(installed):
    py, *_ = installed
    proc = run(installed, py.parent / "jetflow-explorer", "--help")
    assert proc.stdout.startswith("usage: jetflow-explorer") and "--results" in proc.stdout, proc.stdout


def test_the_sglang_plugin_registers_jetflow(installed):
    py, *_ = installed
    if subprocess.run([str(py), "-c", "import sglang"], capture_output=True).returncode:
        pytest.skip("SGLang is not installed (bash scripts/setup.sh installs it)")
    code = """
import json
from importlib.metadata import entry_points
(ep,) = entry_points(group="sglang.srt.plugins", name="jetflow")
register = ep.load()
register()
from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo, get_spec
import jetflow_sglang.sglang.plugin as plugin
assert isinstance(SpeculativeAlgorithm.from_string("jetflow"), CustomSpecAlgo)
print(json.dumps({"value": ep.value, "dist": str(ep.dist.locate_file("")), "module": plugin.__file__,
                  "registered": get_spec("JETFLOW") is not None,
                  "sglang_sees": "jetflow" in load_plugins_by_group(GENERAL_PLUGINS_GROUP)}))
"""
    res = json.loads(run(installed, py, "-c", code, extra_env={"JETFLOW_SGLANG_CPU": "1"}).stdout.splitlines()[-1])
    venv = py.parent.parent
    assert res["value"] == "jetflow_sglang.sglang.plugin:register", res
    assert inside(res["dist"], venv) and inside(res["module"], venv), res
    assert res["registered"] and res["sglang_sees"], res
