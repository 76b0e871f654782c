"""jetflow-explorer: watch JetFlow draft a tree each round, see which branch the target accepts, sweep the budget.

    jetflow-explorer                      # default SmolLM2-135M-Instruct target + the shipped head, on 127.0.0.1:7860
    python -m viz --target DIR --head DIR --port 7861

Runs offline. If the head is missing or does not fit the target, the head drafters are disabled and the page says
why; the n-gram and autoregressive drafters still work.
"""
from __future__ import annotations

import argparse
import os
import threading
import time
import traceback
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # offline: no telemetry calls
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gradio as gr
import torch

from jetflow_sglang.cli import bidir_dir
from jetflow_sglang.drafters import make_drafter
from jetflow_sglang.engine import generate
from jetflow_sglang.head import load_head
from jetflow_sglang.target import Target

from . import figures as F
from .session import Session
from .sweep import BUDGETS, list_results, load_results, sweep

DRAFTERS = [("JetFlow", "jetflow"), ("JetFlow branch-conditioned", "jetflow-branch"), ("DDTree", "ddtree"),
            ("DFlash chain", "dflash"), ("n-gram (prompt lookup)", "ngram"), ("autoregressive", "ar")]
HEAD_DRAFTERS = {"jetflow", "jetflow-branch", "ddtree", "dflash"}
EXAMPLES = {
    "math": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May? Think step by step.",
    "code": "Write a Python function `is_prime(n)` that returns True when n is a prime number, with a docstring.",
    "chat": "What are three good habits for getting better sleep? Answer in a short list.",
}
MAX_BUDGET, MAX_TOKENS = 256, 1024
# Live updates while a run streams. Each one re-draws two Plotly figures in the browser; at 4 per second a loaded
# machine's page fell behind (measured: a click on Stop took 2-3 s to leave the page, so Stop landed late), at 2 per
# second it kept up (0.1-0.4 s).
UPDATE_EVERY_S = 0.5
RESULTS_DIR = Path(__file__).resolve().parent.parent / "bench" / "results"
CSS = """
.jf-text {white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 14px; line-height: 1.6;
          min-height: 4em; padding: 8px; border: 1px solid #ddd; border-radius: 6px}
.jf-r0 {background: #eef5ff} .jf-r1 {background: #fff4e6}
.jf-acc {text-decoration: underline 2px #e4572e; text-underline-offset: 3px}
.jf-cur {outline: 2px solid #e4572e}
"""


class Models:
    """The target, the head and drafters, shared by all tabs. Target owns a batch-1 KV cache, so only one
    generation runs at a time: events share one concurrency slot and this lock guards the model."""

    def __init__(self, target_dir: str, head_dir: str | None, dtype: str = "bfloat16"):
        self.target_dir, self.head_dir = str(target_dir), head_dir
        self.target = Target.from_pretrained(target_dir, dtype=dtype)
        self.head, self.bidir, self.head_error = None, None, ""
        if head_dir is None:
            self.head_error = "no head given"
        else:
            try:
                self.head = load_head(head_dir, self.target)
                self.target.tap_layers = list(self.head.config.tap_layers)  # the taps the head was trained on
                if bidir_dir(head_dir).exists():  # DDTree/DFlash baselines get their own bidirectional head
                    self.bidir = load_head(bidir_dir(head_dir), self.target)
            except Exception as e:  # missing, corrupt or mismatched: keep running without the head drafters
                self.head_error = f"{type(e).__name__}: {e}"
        self.lock = threading.Lock()
        self._drafters: dict[str, object] = {}
        self.eos_ids = sorted(self.target.eos_ids())

    def available(self) -> list[str]:
        return [v for _, v in DRAFTERS if self.head is not None or v not in HEAD_DRAFTERS]

    def drafter(self, name: str):
        if name in HEAD_DRAFTERS and self.head is None:
            raise ValueError(f"the {name} drafter needs the draft head, which is not loaded ({self.head_error}); "
                             "use n-gram or autoregressive")
        if name not in self._drafters:
            self._drafters[name] = make_drafter(name, head=self.head, bidir_head=self.bidir)
        return self._drafters[name]

    def decode(self, ids) -> str:
        return self.target.tokenizer.decode(ids, skip_special_tokens=True)

    def decode_one(self, tok: int) -> str:
        return self.target.tokenizer.decode([tok])

    def banner(self) -> str:
        lines = [f"**target** `{self.target_dir}` ({self.target.config.num_hidden_layers} layers, {self.target.dtype})"]
        if self.head is not None:
            kind = "causal (JetFlow)" if self.head.config.causal else "bidirectional (DFlash/DDTree)"
            lines.append(f"**head** `{self.head_dir}`: {kind}, block {self.head.config.block_size}")
        else:
            lines.append(f"⚠️ **draft head missing**: {self.head_error}. Only the n-gram and autoregressive drafters "
                         "are available until a head is trained (see the README).")
        return "  \n".join(lines)


class InputError(ValueError):
    """Bad input from the page: shown as a message, never as a traceback."""


def check_inputs(models: Models, prompt, drafter, budget, temperature, max_tokens) -> tuple[str, int, float, int]:
    """Reject, before touching the model, anything the engine would reject."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError("The prompt is empty: type one or pick an example.")
    if drafter not in dict((v, k) for k, v in DRAFTERS):
        raise InputError(f"Unknown drafter {drafter!r}.")
    if drafter not in models.available():
        raise InputError(f"The {drafter} drafter needs the draft head, which is not loaded ({models.head_error}).")
    try:
        budget, temperature, max_tokens = int(budget), float(temperature), int(max_tokens)
    except (TypeError, ValueError):
        raise InputError("Budget, temperature and max tokens must be numbers.")
    if not 1 <= budget <= MAX_BUDGET:
        raise InputError(f"Budget must be between 1 and {MAX_BUDGET} nodes; got {budget}.")
    if not 0.0 <= temperature <= 2.0:
        raise InputError(f"Temperature must be between 0 and 2; got {temperature}.")
    if not 1 <= max_tokens <= MAX_TOKENS:
        raise InputError(f"Max tokens must be between 1 and {MAX_TOKENS}; got {max_tokens}.")
    return drafter, budget, temperature, max_tokens


def notice(e: Exception) -> str:
    """Turn an exception into a message for the page (a toast plus the returned markdown); any traceback goes
    to the server log only. Raising gr.Error instead would also paint an error badge over every output."""
    if isinstance(e, InputError):
        msg = str(e)
    elif isinstance(e, ValueError):  # the engine's own checks: budgets, prompts too long for the context, ...
        msg = f"Rejected: {e}"
    else:
        traceback.print_exc()
        msg = f"Generation failed ({type(e).__name__}: {e}); details are in the server log."
    gr.Warning(msg)
    return f"⚠️ {msg}"


def build(models: Models, results_dir: Path = RESULTS_DIR) -> gr.Blocks:
    def tree_of(s: Session, k: int):
        if not s.rounds:
            return None
        k = max(1, min(int(k), len(s.rounds)))
        r = s.rounds[k - 1]
        title = (f"round {k}: {len(r.tree)} nodes drafted, {len(r.path) - 1} accepted "
                 f"+ {len(r.new_tokens) - r.n_drafted} from the target")
        return F.tree_figure(r.tree, r.path, decode=models.decode_one, title=title)

    def view(s: Session, k: int | None = None):
        k = len(s.rounds) if k is None else k
        # minimum 0: Gradio refuses a slider with minimum == maximum, which one round would give
        scrub = gr.Slider(minimum=0, maximum=max(1, len(s.rounds)), value=max(1, k), step=1,
                          interactive=bool(s.rounds) and not s.running)
        return (tree_of(s, k), s.text_html(k if not s.running else None), s.stats_markdown(),
                F.accept_histogram(s.accept_lengths), scrub)

    def run_generation(prompt, drafter, budget, temperature, max_tokens, ignore_eos, s: Session):
        keep = (gr.skip(),) * 2
        try:
            drafter, budget, temperature, max_tokens = check_inputs(models, prompt, drafter, budget, temperature,
                                                                    max_tokens)
            if not models.lock.acquire(timeout=600):
                raise InputError("The model is busy with another tab's run; try again shortly.")
        except Exception as e:
            yield keep + (notice(e),) + (gr.skip(),) * 2
            return
        try:
            d = models.drafter(drafter)
            ids = models.target.encode_chat(prompt)
            s.reset(prompt, drafter, budget)
            last = 0.0
            for rnd in generate(models.target, d, ids, max_new_tokens=max_tokens, budget=budget,
                                temperature=temperature, eos_ids=() if ignore_eos else models.eos_ids):
                if rnd.tree is None:  # the prefill token: text only, no tree
                    s.add_prefill(rnd.new_tokens, models.decode)
                    continue
                s.add_round(rnd.tree, rnd.path, rnd.new_tokens, rnd.draft_s, rnd.verify_s, models.decode)
                if s.stop_requested:
                    break
                # Fast rounds (AR on a small model: a few ms) would flood the browser with plots: send at most
                # one update per UPDATE_EVERY_S; the final state always goes out below.
                if time.perf_counter() - last >= UPDATE_EVERY_S:
                    yield view(s)
                    last = time.perf_counter()
        except Exception as e:
            s.running = False
            yield keep + (notice(e),) + (gr.skip(),) * 2
            return
        finally:
            s.running = False  # also when the tab goes away mid-run and Gradio closes the generator
            models.lock.release()
        yield view(s)

    def request_stop(s: Session):
        # The running event reads this flag between rounds (the Session is the same object in both events: Gradio
        # keeps State values by reference), finishes its round and sends the final tree and stats itself.
        # The answer is a toast, never a write to an output of the running event: Stop's own output can reach
        # the page after the run's final update (both events run at once) and would overwrite it for good.
        busy = s.running or s.sweeping
        if busy:
            s.stop_requested = True
        gr.Info("stopping after this round…" if busy else "nothing is running", duration=3)

    def scrub(k, s: Session):
        return tree_of(s, k), s.text_html(int(k))

    def run_sweep(prompt, drafters, max_tokens, temperature, s: Session, progress=gr.Progress()):
        try:
            if not drafters:
                raise InputError("Pick at least one drafter for the sweep.")
            for d in drafters:
                check_inputs(models, prompt, d, 1, temperature, max_tokens)
            if not models.lock.acquire(timeout=600):
                raise InputError("The model is busy with another tab's run; try again shortly.")
        except Exception as e:
            return gr.skip(), gr.skip(), notice(e)
        s.stop_requested, s.sweeping = False, True
        try:
            ids = models.target.encode_chat(prompt)
            rows = sweep(models.target, {d: models.drafter(d) for d in drafters}, ids, int(max_tokens),
                         temperature=float(temperature), eos_ids=models.eos_ids,
                         progress=lambda k, n, what: progress((k, n), desc=what),
                         should_stop=lambda: s.stop_requested)
        except Exception as e:
            return gr.skip(), gr.skip(), notice(e)
        finally:
            s.sweeping = False
            models.lock.release()
        done = "stopped" if s.stop_requested else "done"
        return F.sweep_figure(rows, title="this prompt"), table(rows), f"{done}: {len(rows)} runs"

    def table(rows):
        cols = ["dataset", "drafter", "budget", "tau", "speedup", "tokens_per_s"]
        return [[r.get(c) for c in cols] for r in rows]

    def result_choices():
        return [(str(Path(p).relative_to(results_dir)), p) for p in list_results(results_dir)]

    def load_file(path):
        try:
            if not path:
                raise InputError(f"No result file chosen (looked in {results_dir}).")
            rows = load_results(path)
        except ValueError as e:
            return gr.skip(), gr.skip(), notice(InputError(str(e)))
        return F.sweep_figure(rows, title=Path(path).name), table(rows), f"loaded {len(rows)} rows from {Path(path).name}"

    available = models.available()
    with gr.Blocks(title="JetFlow tree explorer") as demo:
        # A factory (not a Session instance, which Gradio would deep-copy; not the class, which it would treat
        # as a dataclass value): Gradio calls it once per tab, so each tab gets its own Session.
        state = gr.State(lambda: Session())
        gr.Markdown("# JetFlow tree explorer\nEach round the drafter proposes a token tree; the target verifies "
                    "all of it in one forward and keeps the longest path it agrees with.")
        gr.Markdown(models.banner(), elem_id="jf-banner")
        with gr.Tab("Live"):
            with gr.Row():
                with gr.Column(scale=2):
                    prompt = gr.Textbox(label="prompt", lines=3, elem_id="jf-prompt")
                    with gr.Row():
                        ex_buttons = [(gr.Button(f"example: {k}", size="sm", elem_id=f"jf-ex-{k}"), v)
                                      for k, v in EXAMPLES.items()]
                with gr.Column(scale=1):
                    drafter = gr.Dropdown([(k, v) for k, v in DRAFTERS if v in available], label="drafter",
                                          value=available[0], elem_id="jf-drafter")
                    budget = gr.Slider(1, MAX_BUDGET, value=32, step=1, label="budget (tree nodes)", elem_id="jf-budget")
                    temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature", elem_id="jf-temperature")
                    max_tokens = gr.Slider(1, MAX_TOKENS, value=128, step=1, label="max tokens", elem_id="jf-max-tokens")
                    ignore_eos = gr.Checkbox(False, label="keep going past end-of-text", elem_id="jf-ignore-eos")
            with gr.Row():
                go_btn = gr.Button("Generate", variant="primary", elem_id="jf-generate")
                stop_btn = gr.Button("Stop", variant="stop", elem_id="jf-stop")
            stats = gr.Markdown("no rounds yet", elem_id="jf-stats")
            text = gr.HTML('<div class="jf-text"></div>', elem_id="jf-text")
            tree_plot = gr.Plot(label="draft tree (accepted path outlined in red, rejected branches dimmed)",
                                elem_id="jf-tree")
            scrubber = gr.Slider(0, 1, value=1, step=1, label="round", interactive=False, elem_id="jf-round")
            hist = gr.Plot(label="accept-length histogram", elem_id="jf-hist")
        with gr.Tab("Budget sweep"):
            gr.Markdown(f"Runs the prompt from the Live tab at budgets {list(BUDGETS)} for each chosen drafter, plus "
                        "autoregressive decoding once for the speedup baseline.")
            with gr.Row():
                sweep_drafters = gr.CheckboxGroup([(k, v) for k, v in DRAFTERS if v in available and v != "ar"],
                                                  value=[v for v in ("jetflow", "ngram") if v in available],
                                                  label="drafters", elem_id="jf-sweep-drafters")
                sweep_tokens = gr.Slider(8, 256, value=48, step=8, label="max tokens per run")
            with gr.Row():
                sweep_btn = gr.Button("Run sweep", variant="primary", elem_id="jf-sweep")
                sweep_stop = gr.Button("Stop", variant="stop")
            sweep_msg = gr.Markdown("", elem_id="jf-sweep-msg")
            sweep_plot = gr.Plot(label="tau and speedup vs budget", elem_id="jf-sweep-plot")
            sweep_table = gr.Dataframe(headers=["dataset", "drafter", "budget", "tau", "speedup", "tokens/s"],
                                       label="results", interactive=False)
            gr.Markdown(f"### Benchmark results\nFiles written by `scripts/bench_tau.py` into `{results_dir}`.")
            with gr.Row():
                files = gr.Dropdown(result_choices(), label="result file", elem_id="jf-results")
                refresh = gr.Button("refresh list", size="sm")
                load_btn = gr.Button("load", size="sm", elem_id="jf-load")

        for btn, text_ in ex_buttons:
            btn.click(lambda t=text_: t, None, prompt, api_visibility="private")
        # The state is an input only: the events mutate their tab's Session in place, which Gradio stores by
        # reference, so there is nothing to write back.
        outs = [tree_plot, text, stats, hist, scrubber]
        # show_progress="minimal": the queue position and timer without a full overlay on all five outputs, which
        # the page keeps animating for the whole run (the stats line already says "running")
        gen_event = go_btn.click(run_generation, [prompt, drafter, budget, temperature, max_tokens, ignore_eos, state], outs,
                                 concurrency_id="model", concurrency_limit=1, show_progress="minimal",
                                 api_visibility="private")
        prompt.submit(run_generation, [prompt, drafter, budget, temperature, max_tokens, ignore_eos, state], outs,
                      concurrency_id="model", concurrency_limit=1, show_progress="minimal", api_visibility="private")
        # No outputs (see request_stop) and no concurrency limit: Stop never waits behind other events.
        stop_btn.click(request_stop, state, None, concurrency_limit=None, api_visibility="private")
        scrubber.input(scrub, [scrubber, state], [tree_plot, text], api_visibility="private")
        sweep_btn.click(run_sweep, [prompt, sweep_drafters, sweep_tokens, temperature, state], [sweep_plot, sweep_table, sweep_msg],
                        concurrency_id="model", concurrency_limit=1, api_visibility="private")
        sweep_stop.click(request_stop, state, None, concurrency_limit=None, api_visibility="private")
        refresh.click(lambda: gr.Dropdown(choices=result_choices()), None, files, api_visibility="private")
        load_btn.click(load_file, files, [sweep_plot, sweep_table, sweep_msg], api_visibility="private")
        del gen_event
    return demo


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="jetflow-explorer", description=__doc__.split("\n")[0])
    ap.add_argument("--target", help="HF model folder (default: SmolLM2-135M-Instruct, converted offline on first use)")
    ap.add_argument("--head", help="draft-head folder (default: the shipped head)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=7860)
    ap.add_argument("--results", default=str(RESULTS_DIR), help="folder of benchmark result .json files")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target_dir, head_dir = args.target, args.head
    if target_dir is None or head_dir is None:
        from jetflow_sglang.paths import default_paths

        dt, dh = default_paths(prepare=target_dir is None)
        target_dir, head_dir = target_dir or dt, head_dir or dh
    if not (Path(target_dir) / "config.json").is_file():
        ap.error(f"no model at {target_dir} (expected an HF folder with config.json)")
    print(f"[explorer] loading target {target_dir}", flush=True)
    models = Models(target_dir, head_dir, args.dtype)
    if models.head is None:
        print(f"[explorer] head not loaded: {models.head_error}", flush=True)
    demo = build(models, Path(args.results))
    theme = gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],  # no web-font fetches offline
                              font_mono=["ui-monospace", "monospace"])
    demo.queue(default_concurrency_limit=4).launch(server_name=args.host, server_port=args.port, theme=theme,
                                                   css=CSS, show_error=True, footer_links=[])


if __name__ == "__main__":
    main()
