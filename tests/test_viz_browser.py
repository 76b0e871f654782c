"""The explorer in a real headless Chromium: Debian's `chromium` driven by Playwright's Python package.

The app runs in a subprocess on a tiny random Llama (built here, saved to tmp) with a head built for it, so each
generation takes a second or two. Screenshots land in the test's tmp folder (printed at the end).
"""
import json
import re
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium")
if CHROMIUM is None:
    pytest.skip("Debian's chromium is not installed (apt-get install chromium, or scripts/install_browser.sh)",
                allow_module_level=True)
# Only a missing browser skips: missing Python packages are an install bug and must fail (scripts/install_browser.sh).
import playwright.sync_api as sync_api
import torch

torch.set_num_threads(1)

# --no-sandbox: CI runs as root. The rest keeps Chromium from calling out to the network.
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
TREE_TITLE = "document.querySelector('#jf-tree .js-plotly-plot').layout.title.text"
TREE_NODES = """() => { const el = document.querySelector('#jf-tree .js-plotly-plot'), by = {};
    el.data.forEach(t => by[t.name] = t);
    const drawn = (by['draft nodes'] || {customdata: []}).customdata.length;
    const folded = by['collapsed'] ? by['collapsed'].customdata.reduce((a, b) => a + b, 0) : 0;
    return {total: drawn + folded, drawn: drawn, title: (el.layout.title || {}).text || ''}; }"""
NODE_TRACES = """() => { const el = document.querySelector('#jf-tree .js-plotly-plot');
    const byName = {}; (el.data || []).forEach(t => byName[t.name] = t);
    const layers = [...el.querySelectorAll('.scatterlayer .trace')];
    return {nodes: (byName['draft nodes'] || {customdata: []}).customdata.length,
            path: (byName['accepted path'] || {customdata: []}).customdata,
            opacity: (byName['draft nodes'] || {marker: {}}).marker.opacity,
            accepted_edges: ((byName['accepted edges'] || {x: []}).x.length) / 3,
            drawn_points: layers.map(t => t.querySelectorAll('path.point').length),
            title: (el.layout.title || {}).text || ''}; }"""


def build_tiny(out: Path) -> tuple[Path, Path]:
    """A 6-layer random Llama with a byte-level BPE tokenizer, and a JetFlow head built for it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from jetflow_sglang.head import JetFlowHead, JetFlowHeadConfig, init_from_target, save_head

    torch.manual_seed(0)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["Natalia sold clips to her friends in April and May. How many clips? def is_prime(n): return n > 1"] * 8
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    cfg = LlamaConfig(vocab_size=len(hf_tok), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      eos_token_id=hf_tok.eos_token_id, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out / "target")
    hf_tok.save_pretrained(out / "target")
    head = JetFlowHead(JetFlowHeadConfig.for_target(cfg, num_layers=1, causal=True, block_size=8))
    with torch.no_grad():
        init_from_target(head, model)
    save_head(head, out / "head", dtype=torch.float32)
    bidir = JetFlowHead(JetFlowHeadConfig.for_target(cfg, num_layers=1, causal=False, block_size=8))
    with torch.no_grad():
        init_from_target(bidir, model)
    save_head(bidir, out / "head-bidir", dtype=torch.float32)
    return out / "target", out / "head"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(tmp: Path, target: Path | None, head: Path | None, results: Path | None, name: str,
              dtype: str = "float32"):
    """The explorer in a subprocess on a free port; returns (process, url, log file). None: the app's default."""
    port = free_port()
    log = open(tmp / f"{name}.log", "w")
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", OMP_NUM_THREADS="1")
    args = [a for flag, v in (("--target", target), ("--head", head), ("--results", results)) if v for a in (flag, str(v))]
    proc = subprocess.Popen([sys.executable, "-m", "jetflow_sglang.viz", *args, "--dtype", dtype, "--port", str(port),
                             "--threads", "1"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).resolve().parent.parent)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 300  # the default model may be converted from its GGUF first
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return proc, url, log
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"the explorer did not start:\n{(tmp / f'{name}.log').read_text()[-3000:]}")
            time.sleep(0.5)


def stop_app(proc, log):
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


ARTEFACTS = Path(os.environ.get("JETFLOW_ARTEFACTS", Path(__file__).resolve().parent.parent / "runs" / "artefacts"))
VIEW = {"width": 1440, "height": 900}


def shot(page, name, full=False):
    """A screenshot kept as a test artefact (runs/ is git-ignored; JETFLOW_ARTEFACTS overrides the folder)."""
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTEFACTS / f"{name}.png"), full_page=full)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("viz")
    target, head = build_tiny(tmp)
    results = tmp / "results"
    (results / "h200").mkdir(parents=True)
    rows = [dict(dataset="gsm8k", drafter=d, budget=b, tau=1 + b ** 0.5 / k, speedup=1 + b ** 0.5 / (2 * k))
            for k, d in ((2, "jetflow"), (4, "ddtree")) for b in (1, 16, 32, 64, 128, 256)]
    (results / "tau_gsm8k.json").write_text(json.dumps(rows))
    (results / "broken.json").write_text(json.dumps([{"note": "no budget in this row"}]))
    real = Path(__file__).resolve().parent.parent / "bench" / "results"
    for name in ("tau.json", "h200/tau.json", "sglang_serving.json"):  # the repository's own result files
        shutil.copy(real / name, results / name)
    yield tmp, target, head, results
    print(f"\nexplorer screenshots: {ARTEFACTS}")


@pytest.fixture(scope="module")
def app(tiny):
    tmp, target, head, results = tiny
    proc, url, log = start_app(tmp, target, head, results, "app")
    yield url, tmp
    stop_app(proc, log)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def open_page(browser, url):
    page = browser.new_page(viewport=VIEW, accept_downloads=True)
    page.goto(url)
    page.locator("#jf-generate").wait_for(timeout=60_000)
    return page


def choose(page, elem_id, label):
    page.locator(f"#{elem_id} input").click()
    page.locator(f"#{elem_id}").get_by_role("option", name=label, exact=True).click()


def set_slider(page, elem_id, value):
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")


STATS = "document.querySelector('#jf-stats').innerText"


def generate_and_wait(page, timeout=120_000):
    before = page.locator("#jf-stats").inner_text()  # a previous run's "done" line must not count
    page.locator("#jf-generate").click()
    page.wait_for_function(f"{STATS}.startsWith('done') && {STATS} !== {json.dumps(before)}", timeout=timeout)
    page.wait_for_selector("#jf-tree .js-plotly-plot .scatterlayer path.point", timeout=timeout)
    return page.evaluate(NODE_TRACES)


def hover_text(page, plot: str, trace: str, k: int) -> str:
    """Move the mouse onto point k of a named trace and return plotly's hover label."""
    page.locator(plot).scroll_into_view_if_needed()
    box = page.evaluate("""([plot, trace, k]) => {
        const el = document.querySelector(plot + ' .js-plotly-plot'), fl = el._fullLayout;
        const t = el.data.find(t => t.name === trace), r = el.getBoundingClientRect();
        return [r.x + fl.xaxis._offset + fl.xaxis.l2p(t.x[k]), r.y + fl.yaxis._offset + fl.yaxis.l2p(t.y[k])]; }""",
                        [plot, trace, k])
    page.mouse.move(box[0] - 3, box[1])
    page.mouse.move(box[0], box[1])
    page.wait_for_selector(f"{plot} .hoverlayer .hovertext", timeout=10_000)
    return page.locator(f"{plot} .hoverlayer .hovertext").first.text_content()


def test_live_run_target_view_diagnostics_export_and_reload(app, browser):
    url, out = app
    page = open_page(browser, url)
    assert "draft head missing" not in page.locator("#jf-banner").inner_text()
    page.locator("#jf-ex-math").click()
    sync_api.expect(page.locator("#jf-prompt textarea")).to_have_value(re.compile("Natalia"), timeout=30_000)

    # JetFlow with the (random) head: a full 24-node tree each round, most of it rejected and dimmed
    set_slider(page, "jf-budget", 24)
    set_slider(page, "jf-max-tokens", 12)
    page.locator("#jf-generate").click()
    sync_api.expect(page.locator("#jf-generate")).to_be_disabled(timeout=10_000)  # says "Running…" during a run
    page.wait_for_function(f"{STATS}.startsWith('done')", timeout=120_000)
    sync_api.expect(page.locator("#jf-generate")).to_be_enabled(timeout=30_000)
    page.wait_for_selector("#jf-tree .js-plotly-plot .scatterlayer path.point", timeout=30_000)
    info = page.evaluate(NODE_TRACES)
    assert info["nodes"] == 24, info
    assert sum(info["drawn_points"]) >= 24 + len(info["path"]), "plotly did not draw the nodes"
    assert info["path"][0] == 0 and len(info["path"]) >= 1
    assert all(info["opacity"][i] == 1 for i in info["path"])
    assert sum(o < 1 for o in info["opacity"]) == 24 - len(info["path"]), "rejected nodes are not dimmed"
    stats = page.locator("#jf-stats").inner_text()
    for want in ("temperature 0", "max tokens 12", "stops at end-of-text", "budget 24", "over plain decoding",
                 "τ = tokens committed per verify step"):
        assert want in stats, (want, stats)
    assert re.search(r"speedup [0-9.]+x", stats), stats

    shot(page, "explorer_live_1440x900")
    # the target's view on hover: its probability of the node's token and its top-5 there
    tip = hover_text(page, "#jf-tree", "draft nodes", 1)
    assert "target p" in tip and "target's top-5 here" in tip, tip
    # the token the target chose instead, after the last accepted node
    star = page.evaluate("""() => document.querySelector('#jf-tree .js-plotly-plot').data
        .filter(t => t.name === "target's token").map(t => t.text[0])""")
    assert len(star) == 1 and star[0].startswith("target:"), star
    # colour by the target's probability
    page.locator("#jf-colour").get_by_text("target p", exact=True).click()
    page.wait_for_function("""document.querySelector('#jf-tree .js-plotly-plot').data
        .find(t => t.name === 'draft nodes').marker.colorbar.title.text.startsWith('target')""", timeout=30_000)
    # diagnostics under the tree, with data
    diag = page.evaluate("""() => document.querySelector('#jf-diag .js-plotly-plot').data
        .filter(t => t.name && t.name.includes(' · ')).map(t => [t.name, (t.y || []).filter(v => v !== null).length])""")
    assert {n.split(" · ")[1] for n, _ in diag} == {"by depth", "by rank", "calibration"}, diag
    assert all(k > 0 for _, k in diag), diag
    shot(page, "explorer_live_1440x900")
    shot(page, "explorer_live_full", full=True)

    # export every round, then load the file back: same rounds, same tree
    with page.expect_download(timeout=30_000) as dl:
        page.locator("#jf-export").click()
    saved = out / "exported_run.json"
    dl.value.save_as(saved)
    data = json.loads(saved.read_text())
    assert data["format"] == "jetflow-explorer-run/1" and data["settings"]["budget"] == 24
    assert len(data["rounds"]) >= 1 and all(r["target_top"]["ids"] for r in data["rounds"])
    assert all(len(r["tree"]["tokens"]) == 24 for r in data["rounds"])
    fresh = open_page(browser, url)
    with fresh.expect_file_chooser() as fc:
        fresh.locator("#jf-import").click()
    fc.value.set_files(str(saved))
    fresh.wait_for_function(f"{STATS}.startsWith('loaded')", timeout=30_000)
    assert f"rounds {len(data['rounds'])}" in fresh.locator("#jf-stats").inner_text()
    fresh.wait_for_selector("#jf-tree .js-plotly-plot .scatterlayer path.point", timeout=30_000)
    again = fresh.evaluate(NODE_TRACES)
    assert again["nodes"] == 24 and again["path"] == info["path"]
    fresh.close()

    # n-gram prompt lookup on the tiny model's repetitive output: multi-token accepted paths, highlighted
    choose(page, "jf-drafter", "n-gram (prompt lookup)")
    set_slider(page, "jf-max-tokens", 64)
    info = generate_and_wait(page)
    stats = page.locator("#jf-stats").inner_text()
    assert "ngram" in stats and "tau" in stats and "tok/s" in stats
    rounds = int(page.locator("#jf-round input[type=number]").input_value())
    assert rounds >= 1
    best = info
    for k in range(rounds, 0, -1):  # scrub back to a round that accepted draft tokens
        if len(best["path"]) >= 2:
            break
        set_slider(page, "jf-round", k)
        page.wait_for_function(f"document.querySelector('#jf-tree .js-plotly-plot').layout.title.text"
                               f".startsWith('round {k}:')", timeout=30_000)
        best = page.evaluate(NODE_TRACES)
    assert len(best["path"]) >= 2, f"no round accepted a draft token: {stats}"
    assert best["accepted_edges"] == len(best["path"]) - 1
    assert page.locator("#jf-text .jf-acc").count() >= 1

    # the CLI's default drafter: the head's tree with the prompt-lookup trie merged in; lossless on the same output
    choose(page, "jf-drafter", "JetFlow + lookup (jetflow generate's default)")
    info = generate_and_wait(page)
    stats = page.locator("#jf-stats").inner_text()
    assert "jetflow+lookup" in stats and "tau" in stats and "identical text: True" in stats, stats
    assert info["nodes"] >= 1
    page.close()


def test_bad_input_shows_a_message_and_runs_nothing(app, browser):
    url, out = app
    page = open_page(browser, url)
    page.locator("#jf-prompt textarea").fill("   ")
    page.locator("#jf-generate").click()
    page.wait_for_function(f"{STATS}.includes('The prompt is empty')", timeout=30_000)
    page.locator("#jf-prompt textarea").fill("hello")
    for elem, value, msg in (("jf-budget", -5, "Budget must be between 1 and"),
                             ("jf-temperature", 50, "Temperature must be between 0 and 2"),
                             ("jf-max-tokens", 1000000, "Max tokens must be between 1 and")):
        set_slider(page, elem, value)
        page.locator("#jf-generate").click()
        page.wait_for_function(f"{STATS}.includes({json.dumps(msg)})", timeout=30_000)
        assert page.locator(f"#{elem} input[type=number]").input_value() == str(value)  # kept, never clamped
        set_slider(page, elem, {"jf-budget": 8, "jf-temperature": 0, "jf-max-tokens": 8}[elem])
    assert "Traceback" not in page.content()
    assert page.locator("#jf-text").inner_text().strip() == ""  # nothing ran
    shot(page, "explorer_error")
    page.close()


def test_side_by_side_two_drafters_and_big_trees(app, browser):
    url, out = app
    page = open_page(browser, url)
    page.locator("#jf-ex-code").click()
    sync_api.expect(page.locator("#jf-prompt textarea")).to_have_value(re.compile("prime"), timeout=30_000)
    set_slider(page, "jf-budget", 160)
    set_slider(page, "jf-max-tokens", 8)
    page.get_by_role("tab", name="Side by side").click()
    choose(page, "jf-cmp-a", "JetFlow")
    choose(page, "jf-cmp-b", "DDTree")
    page.locator("#jf-cmp-run").click()
    page.wait_for_function("""() => { const s = document.querySelector('#jf-cmp-stats').innerText;
        return s.includes('showing round') }""", timeout=120_000)
    page.wait_for_function("""() => ['#jf-cmp-tree-a', '#jf-cmp-tree-b', '#jf-cmp-diag'].every(id =>
        document.querySelector(id + ' .js-plotly-plot .main-svg'))""", timeout=30_000)
    trees = page.evaluate("""() => ['#jf-cmp-tree-a', '#jf-cmp-tree-b'].map(id => {
        const el = document.querySelector(id + ' .js-plotly-plot'); return el ? el.layout.title.text : null })""")
    assert trees[0].startswith("A · round 1") and trees[1].startswith("B · round"), trees
    stats = page.locator("#jf-cmp-stats").inner_text()
    assert "jetflow" in stats and "ddtree" in stats and stats.count("τ") >= 2 and stats.count("tok/s") == 2
    names = page.evaluate("""() => document.querySelector('#jf-cmp-diag .js-plotly-plot').data.map(t => t.name)""")
    assert any("(A)" in n for n in names) and any("(B)" in n for n in names), names
    # a 160-node tree folds its unlikely branches into "+k more" nodes that add up with the drawn ones to 160
    folded = page.evaluate("""() => { const el = document.querySelector('#jf-cmp-tree-a .js-plotly-plot');
        const by = {}; el.data.forEach(t => by[t.name] = t);
        return [by['draft nodes'].customdata.length, by['collapsed'] ? by['collapsed'].customdata : []] }""")
    assert folded[1] and folded[0] + sum(folded[1]) == 160, folded
    shot(page, "explorer_side_by_side_1440x900")
    page.close()


def test_results_tab_reads_the_benchmark_files(app, browser):
    url, out = app
    page = open_page(browser, url)
    page.get_by_role("tab", name="Results").click()
    choose(page, "jf-results", "broken.json")  # a file without rows: a message, not a crash
    page.locator("#jf-load").click()
    page.wait_for_function("document.querySelector('#jf-res-msg').innerText.includes('no rows with a budget')",
                           timeout=30_000)
    colours = """() => { const el = document.querySelector('#jf-res-plot .js-plotly-plot'); const c = {};
        el.data.filter(t => t.name).forEach(t => { const d = t.name.split(' · ')[0];
            (c[d] = c[d] || new Set()).add(t.line.color) });
        return {colours: Object.fromEntries(Object.entries(c).map(([k, v]) => [k, [...v]])),
                ticks: el.layout.xaxis.tickvals, title: el.layout.title.text} }"""
    for name, shot_name in (("tau.json", "explorer_results_cpu"), ("h200/tau.json", "explorer_results_h200")):
        choose(page, "jf-results", name)
        page.locator("#jf-load").click()
        page.wait_for_function(f"""() => {{ const el = document.querySelector('#jf-res-plot .js-plotly-plot');
            return el && el.layout.title.text.startsWith({json.dumps(name)}) }}""", timeout=30_000)
        got = page.evaluate(colours)
        assert got["colours"] and all(len(v) == 1 for v in got["colours"].values()), got
        assert len({v[0] for v in got["colours"].values()}) == len(got["colours"])  # one colour per drafter
        want = sorted({r["budget"] for r in json.loads((Path(__file__).resolve().parent.parent / "bench" / "results"
                                                        / name).read_text())["rows"]})
        assert got["ticks"] == want and name in got["title"], got
        assert "oracle" in page.locator("#jf-res-defs").inner_text()
        cells = page.locator("#jf-res-table").inner_text()
        assert not re.search(r"\d\.\d{3,}", cells), "unrounded numbers in the table"
        shot(page, shot_name)
    choose(page, "jf-results", "sglang_serving.json")
    page.locator("#jf-load").click()
    page.wait_for_function("document.querySelector('#jf-res-msg').innerText.includes('sglang_serving.json')",
                           timeout=30_000)
    shot(page, "explorer_results_serving")
    page.close()


def test_stop_and_two_tabs_keep_their_own_state(app, browser):
    url, out = app
    a, b = open_page(browser, url), open_page(browser, url)
    # tab A: a long run, stopped after a few rounds. 256-node JetFlow trees make every round heavy (a verify of 256
    # nodes and its figure), so the run outlasts the Stop clicks below even on a fast machine (1024 plain decoding
    # steps of the tiny model took 2.4 s on one, and Stop landed after the end)
    a.locator("#jf-ex-chat").click()
    sync_api.expect(a.locator("#jf-prompt textarea")).to_have_value(re.compile("sleep"), timeout=30_000)
    choose(a, "jf-drafter", "JetFlow")
    set_slider(a, "jf-budget", 256)
    set_slider(a, "jf-max-tokens", 1024)
    a.locator("#jf-ignore-eos input").check()  # the tiny model can reach EOS in under a second, before Stop lands
    a.locator("#jf-generate").click()
    a.wait_for_function(f"/rounds ([3-9]|\\d\\d+)/.test({STATS})", timeout=60_000)
    # Stop in tab B, which runs nothing, must not stop tab A's run
    b.locator("#jf-stop").click()
    sync_api.expect(b.locator(".toast-wrap")).to_contain_text("nothing is running", timeout=30_000)
    assert a.locator("#jf-stats").inner_text().startswith("running")
    a.locator("#jf-stop").click()
    # the toast lives 3 s: read it before waiting for the round to end (a loaded CI machine can take longer than that)
    sync_api.expect(a.locator(".toast-wrap")).to_contain_text("stopping after this round", timeout=30_000)
    a.wait_for_function(f"/^(stopped|done)/.test({STATS})", timeout=60_000)
    a_stats = a.locator("#jf-stats").inner_text()
    assert a_stats.startswith("stopped"), a_stats
    assert "· tokens 1024 ·" not in a_stats and "ignores end-of-text" in a_stats
    set_slider(a, "jf-round", 1)
    a.wait_for_function(f"{TREE_TITLE}.startsWith('round 1:')", timeout=30_000)
    a_round1 = a.evaluate(TREE_NODES)
    assert a_round1["total"] > 1, (a_round1, a_stats)  # a JetFlow tree (its unlikely branches folded), not a root
    # tab B: its own run with another drafter must not leak into tab A
    assert b.locator("#jf-stats").inner_text().startswith("no rounds")
    b.locator("#jf-ex-code").click()
    choose(b, "jf-drafter", "n-gram (prompt lookup)")
    set_slider(b, "jf-max-tokens", 16)
    b.locator("#jf-measure-ar input").uncheck()
    generate_and_wait(b)
    assert "ngram" in b.locator("#jf-stats").inner_text() and "not measured" in b.locator("#jf-stats").inner_text()
    assert a.locator("#jf-stats").inner_text() == a_stats
    set_slider(a, "jf-round", 2)  # scrubbing tab A reads tab A's rounds, not tab B's n-gram tries
    a.wait_for_function(f"{TREE_TITLE}.startsWith('round 2:')", timeout=30_000)
    set_slider(a, "jf-round", 1)
    a.wait_for_function(f"{TREE_TITLE}.startsWith('round 1:')", timeout=30_000)
    assert a.evaluate(TREE_NODES) == a_round1
    a.close(), b.close()


def test_sweep_panel_runs(app, browser):
    url, out = app
    page = open_page(browser, url)
    page.locator("#jf-ex-math").click()
    sync_api.expect(page.locator("#jf-prompt textarea")).to_have_value(re.compile("Natalia"), timeout=30_000)
    page.get_by_role("tab", name="Budget sweep").click()
    # a live sweep of this prompt: n-gram only (fast), 8 tokens per run, every budget plus the AR baseline
    page.get_by_label("JetFlow", exact=True).uncheck()
    page.get_by_label("n-gram (prompt lookup)").check()
    page.locator("#jf-sweep").click()
    page.wait_for_function("""() => { const el = document.querySelector('#jf-sweep-plot .js-plotly-plot');
        const t = el && el.data.filter(t => t.name == 'prompt / ngram');
        return t && t.length == 2 && t[0].x.length == 6 }""", timeout=120_000)
    shot(page, "explorer_sweep", full=True)
    page.close()


def test_missing_head_still_runs_with_ngram_and_says_so(tiny, browser):
    tmp, target, _, results = tiny
    proc, url, log = start_app(tmp, target, tmp / "no-such-head", results, "app_nohead")
    try:
        page = open_page(browser, url)
        assert "draft head missing" in page.locator("#jf-banner").inner_text()
        page.locator("#jf-drafter input").click()
        options = [o.get_attribute("aria-label") for o in page.get_by_role("option").all()]
        assert options == ["n-gram (prompt lookup)", "autoregressive"], options
        page.keyboard.press("Escape")
        page.locator("#jf-ex-chat").click()
        # the example fills the prompt through a server event: generating before it lands sends an empty prompt
        sync_api.expect(page.locator("#jf-prompt textarea")).to_have_value(re.compile("sleep"), timeout=30_000)
        set_slider(page, "jf-max-tokens", 16)
        info = generate_and_wait(page)
        assert info["nodes"] >= 1 and info["path"][0] == 0
        shot(page, "explorer_no_head")
        page.close()
    finally:
        stop_app(proc, log)


def test_default_model_and_shipped_head_draw_real_trees(tmp_path, browser):
    """What `jetflow-explorer` opens: SmolLM2-135M-Instruct and the shipped head, with no flags. The trained head
    must get more than one token per verify step on the math example, which a broken or random head does not."""
    proc, url, log = start_app(tmp_path, None, None, None, "app_default", dtype="bfloat16")
    try:
        page = open_page(browser, url)
        banner = page.locator("#jf-banner").inner_text()
        assert "SmolLM2-135M-Instruct" in banner and "draft head missing" not in banner, banner
        page.locator("#jf-ex-math").click()
        sync_api.expect(page.locator("#jf-prompt textarea")).to_have_value(re.compile("Natalia"), timeout=30_000)
        set_slider(page, "jf-budget", 16)
        set_slider(page, "jf-max-tokens", 48)
        info = generate_and_wait(page, timeout=300_000)
        assert info["nodes"] == 16 and info["path"][0] == 0, info
        assert sum(o < 1 for o in info["opacity"]) == 16 - len(info["path"]), "rejected nodes are not dimmed"
        stats = page.locator("#jf-stats").inner_text()
        tau = float(re.search(r"tau ([0-9.]+)", stats).group(1))
        assert tau > 1.2, stats
        shot(page, "explorer_default_model", full=True)
        page.close()
    finally:
        stop_app(proc, log)
