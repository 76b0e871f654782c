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
    proc = subprocess.Popen([sys.executable, "-m", "viz", *args, "--dtype", dtype, "--port", str(port), "--threads", "1"],
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


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("viz")
    target, head = build_tiny(tmp)
    results = tmp / "results"
    results.mkdir()
    rows = [dict(dataset="gsm8k", drafter=d, budget=b, tau=1 + b ** 0.5 / k, speedup=1 + b ** 0.5 / (2 * k))
            for k, d in ((2, "jetflow"), (4, "ddtree")) for b in (1, 16, 32, 64, 128, 256)]
    (results / "tau_gsm8k.json").write_text(json.dumps(rows))
    (results / "broken.json").write_text(json.dumps([{"note": "no budget in this row"}]))
    yield tmp, target, head, results
    print(f"\nexplorer screenshots: {sorted(str(p) for p in tmp.glob('*.png'))}")


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
    page = browser.new_page(viewport={"width": 1400, "height": 1700})
    page.goto(url)
    page.locator("#jf-generate").wait_for(timeout=60_000)
    return page


def choose(page, elem_id, label):
    page.locator(f"#{elem_id} input").click()
    page.get_by_role("option", name=label, exact=True).click()


def set_slider(page, elem_id, value):
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")


def generate_and_wait(page, timeout=120_000):
    page.locator("#jf-generate").click()
    page.wait_for_function("document.querySelector('#jf-stats').innerText.startsWith('done')", timeout=timeout)
    page.wait_for_selector("#jf-tree .js-plotly-plot .scatterlayer path.point", timeout=timeout)
    return page.evaluate(NODE_TRACES)


def test_example_prompt_draws_tree_with_accepted_path(app, browser):
    url, out = app
    page = open_page(browser, url)
    assert "draft head missing" not in page.locator("#jf-banner").inner_text()
    page.locator("#jf-ex-math").click()
    sync_api.expect(page.locator("#jf-prompt textarea")).to_have_value(re.compile("Natalia"), timeout=30_000)

    # JetFlow with the (random) head: a full 24-node tree each round, most of it rejected and dimmed
    set_slider(page, "jf-budget", 24)
    set_slider(page, "jf-max-tokens", 12)
    info = generate_and_wait(page)
    assert info["nodes"] == 24, info
    assert sum(info["drawn_points"]) >= 24 + len(info["path"]), "plotly did not draw the nodes"
    assert info["path"][0] == 0 and len(info["path"]) >= 1
    assert all(info["opacity"][i] == 1 for i in info["path"])
    assert sum(o < 1 for o in info["opacity"]) == 24 - len(info["path"]), "rejected nodes are not dimmed"
    page.screenshot(path=str(out / "explorer_jetflow.png"), full_page=True)

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
    page.screenshot(path=str(out / "explorer_ngram.png"), full_page=True)
    page.close()


def test_bad_input_shows_a_message_not_a_traceback(app, browser):
    url, out = app
    page = open_page(browser, url)
    page.locator("#jf-prompt textarea").fill("   ")
    page.locator("#jf-generate").click()
    page.wait_for_function("document.querySelector('#jf-stats').innerText.includes('The prompt is empty')",
                           timeout=30_000)
    assert "Traceback" not in page.content()
    page.screenshot(path=str(out / "explorer_error.png"))
    page.close()


def test_stop_and_two_tabs_keep_their_own_state(app, browser):
    url, out = app
    a, b = open_page(browser, url), open_page(browser, url)
    # tab A: a long autoregressive run, stopped after a few rounds
    a.locator("#jf-ex-chat").click()
    sync_api.expect(a.locator("#jf-prompt textarea")).to_have_value(re.compile("sleep"), timeout=30_000)
    choose(a, "jf-drafter", "autoregressive")
    set_slider(a, "jf-max-tokens", 1024)
    a.locator("#jf-ignore-eos input").check()  # the tiny model can reach EOS in under a second, before Stop lands
    stats = "document.querySelector('#jf-stats').innerText"
    a.locator("#jf-generate").click()
    a.wait_for_function(f"/rounds ([3-9]|\\d\\d+)/.test({stats})", timeout=60_000)
    # Stop in tab B, which runs nothing, must not stop tab A's run
    b.locator("#jf-stop").click()
    sync_api.expect(b.locator(".toast-wrap")).to_contain_text("nothing is running", timeout=30_000)
    assert a.locator("#jf-stats").inner_text().startswith("running")
    a.locator("#jf-stop").click()
    a.wait_for_function(f"/^(stopped|done)/.test({stats})", timeout=60_000)
    # Stop answers with a toast; once it is up the Stop event is over, and the run's final stats must still be
    # there (Stop used to write to #jf-stats too, and its answer could land after the final update and stay)
    sync_api.expect(a.locator(".toast-wrap")).to_contain_text("stopping after this round", timeout=30_000)
    a_stats = a.locator("#jf-stats").inner_text()
    assert a_stats.startswith("stopped"), a_stats
    assert "tokens 1024" not in a_stats
    # tab B: its own run with another drafter must not leak into tab A
    assert b.locator("#jf-stats").inner_text().startswith("no rounds")
    b.locator("#jf-ex-code").click()
    choose(b, "jf-drafter", "n-gram (prompt lookup)")
    set_slider(b, "jf-max-tokens", 16)
    generate_and_wait(b)
    assert "ngram" in b.locator("#jf-stats").inner_text()
    assert a.locator("#jf-stats").inner_text() == a_stats
    set_slider(a, "jf-round", 1)  # scrubbing tab A reads tab A's rounds: AR trees are a lone root
    a.wait_for_function("document.querySelector('#jf-tree .js-plotly-plot').layout.title.text.startsWith('round 1:')",
                        timeout=30_000)
    assert a.evaluate(NODE_TRACES)["nodes"] == 1
    a.close(), b.close()


def test_sweep_panel_runs_and_loads_results(app, browser):
    url, out = app
    page = open_page(browser, url)
    page.locator("#jf-ex-math").click()
    page.get_by_role("tab", name="Budget sweep").click()
    choose(page, "jf-results", "broken.json")  # a file without rows: a message, not a crash
    page.locator("#jf-load").click()
    page.wait_for_function("document.querySelector('#jf-sweep-msg').innerText.includes('no rows with a budget')",
                           timeout=30_000)
    choose(page, "jf-results", "tau_gsm8k.json")
    page.locator("#jf-load").click()
    page.wait_for_function("""() => { const el = document.querySelector('#jf-sweep-plot .js-plotly-plot');
        return el && el.data.filter(t => t.name && t.name.includes('gsm8k')).length == 4 }""", timeout=30_000)
    page.screenshot(path=str(out / "explorer_results.png"), full_page=True)

    # a live sweep of this prompt: n-gram only (fast), 8 tokens per run, every budget plus the AR baseline
    page.get_by_label("JetFlow", exact=True).uncheck()
    page.get_by_label("n-gram (prompt lookup)").check()
    page.locator("#jf-sweep").click()
    page.wait_for_function("""() => { const el = document.querySelector('#jf-sweep-plot .js-plotly-plot');
        const t = el && el.data.filter(t => t.name == 'prompt / ngram');
        return t && t.length == 2 && t[0].x.length == 6 }""", timeout=120_000)
    page.screenshot(path=str(out / "explorer_sweep.png"), full_page=True)
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
        page.screenshot(path=str(tmp / "explorer_no_head.png"), full_page=True)
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
        page.screenshot(path=str(tmp_path / "explorer_default_model.png"), full_page=True)
        page.close()
    finally:
        stop_app(proc, log)
