"""jetflow-explorer: watch JetFlow draft a tree each round, see what the target thought of every node and which
branch it accepted, compare two drafters, sweep the budget, read the benchmark results.

    jetflow-explorer                      # default SmolLM2-135M-Instruct target + the shipped head, on 127.0.0.1:7860
    python -m jetflow_sglang.viz --target DIR --head DIR --port 7861

Runs offline. If the head is missing or does not fit the target, the head drafters are disabled and the page says
why; the n-gram and autoregressive drafters still work.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import gradio as gr
import torch

from . import figures as F
from . import results as R
from .compare import Pair, aligned_round, summary
from .export import load_run, save_run
from .models import DRAFTERS, MAX_BUDGET, MAX_TOKENS, InputError, Models, check_inputs, notice
from .plots import diagnostics_figure
from .runner import stream
from .session import TAU_DEF, Session
from .sweep import BUDGETS, list_results, sweep

EXAMPLES = {
    "math": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May? Think step by step.",
    "code": "Write a Python function `is_prime(n)` that returns True when n is a prime number, with a docstring.",
    "chat": "What are three good habits for getting better sleep? Answer in a short list.",
}
# Live updates while a run streams. Each one re-draws Plotly figures in the browser; at 4 per second a loaded
# machine's page fell behind (a click on Stop took 2-3 s to land), at 2 per second it kept up.
UPDATE_EVERY_S = 0.5
RESULTS_DIR = Path(__file__).resolve().parents[2] / "bench" / "results"  # a checkout's; absent in a wheel install
TREE_HEIGHT = 540  # px: the tree panel has its own scroll, so the scrubber above it stays in view
# Uploads over this size are refused by the server (HTTP 413) while they stream in; the partial file is deleted from
# Gradio's upload folder. The one upload is "Load run", an exported run (export.py): the largest the explorer can write
# (budget 256 nodes, 1024 rounds of one token each, the target's top-5 per node) is about 47 MB.
MAX_UPLOAD_BYTES = 64 * 1024 * 1024
CSS = f"""
.jf-text {{white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 14px; line-height: 1.6;
          min-height: 4em; padding: 8px; border: 1px solid #ddd; border-radius: 6px; max-height: {TREE_HEIGHT}px;
          overflow-y: auto}}
.jf-r0 {{background: #eef5ff}} .jf-r1 {{background: #fff4e6}}
.jf-acc {{text-decoration: underline 2px #e4572e; text-underline-offset: 3px}}
.jf-cur {{outline: 2px solid #e4572e}}
#jf-tree, #jf-cmp-tree-a, #jf-cmp-tree-b {{max-height: {TREE_HEIGHT + 20}px; overflow-y: auto}}
"""
COLOUR_CHOICES = [("draft p", "draft"), ("target p", "target"), ("agreement (log p_target/p_draft)", "agreement")]


def build(models: Models, results_dir: Path = RESULTS_DIR) -> gr.Blocks:
    export_dir = Path(tempfile.mkdtemp(prefix="jetflow-explorer-"))

    def tree_of(s: Session, k, colour="draft", collapse=True, threshold=0.01, zoom=False, name=""):
        if not s.rounds:
            return None
        k = max(1, min(int(k or len(s.rounds)), len(s.rounds)))
        r = s.rounds[k - 1]
        title = (f"{name}round {k}: {len(r.tree)} drafted, {len(r.path) - 1} accepted "
                 f"+ {len(r.new_tokens) - r.n_drafted} target")
        try:
            thr = float(threshold) if collapse else 0.0
        except (TypeError, ValueError):
            thr = 0.0
        return F.tree_figure(r.tree, r.path, decode=s.label, title=title, view=r.target, colour=colour or "draft",
                             target_token=r.target_token, threshold=max(0.0, thr), zoom=bool(zoom))

    def diag_of(runs: dict[str, Session]):
        runs = {k: v for k, v in runs.items() if v.rounds}
        return diagnostics_figure({k: [(r.tree, r.path) for r in v.rounds] for k, v in runs.items()}) if runs else None

    def export_button(s: Session):
        if not s.rounds or s.running:
            return gr.DownloadButton(value=None, interactive=False)
        return gr.DownloadButton(value=str(save_run(s, Path(tempfile.mkdtemp(dir=export_dir)), models.meta())),
                                 interactive=True)

    def view(s: Session, opts, k: int | None = None, final: bool = False):
        k = len(s.rounds) if k is None else k
        # minimum 0: Gradio refuses a slider with minimum == maximum, which one round would give
        scrub = gr.Slider(minimum=0, maximum=max(1, len(s.rounds)), value=max(1, k), step=1,
                          interactive=bool(s.rounds) and not s.running)
        # the diagnostics are drawn once the run is over: redrawing three panels every update slows the page
        return (tree_of(s, k, *opts), s.text_html(k if not s.running else None), s.stats_markdown(),
                F.accept_histogram(s.accept_lengths), scrub,
                diag_of({s.drafter or "run": s}) if final else gr.skip(), export_button(s) if final else gr.skip())

    def busy_buttons():
        return gr.Button(value="Running…", interactive=False), gr.Button(value="Running…", interactive=False)

    def idle_buttons():
        return gr.Button(value="Generate", interactive=True), gr.Button(value="Run both", interactive=True)

    def run_generation(prompt, drafter, budget, temperature, max_tokens, ignore_eos, measure_ar, colour, collapse,
                       threshold, zoom, s: Session):
        opts = (colour, collapse, threshold, zoom)
        keep = (gr.skip(),) * 2
        try:
            drafter, budget, temperature, max_tokens = check_inputs(models, prompt, drafter, budget, temperature,
                                                                    max_tokens)
            if not models.lock.acquire(timeout=600):
                raise InputError("The model is busy with another tab's run; try again shortly.")
        except Exception as e:
            yield keep + (notice(e),) + (gr.skip(),) * 4
            return
        try:
            last = 0.0
            for _ in stream(models, s, prompt, drafter, budget, temperature, max_tokens, not ignore_eos,
                            bool(measure_ar)):
                # at most one page update per UPDATE_EVERY_S; the final state always goes out below
                if time.perf_counter() - last >= UPDATE_EVERY_S:
                    yield view(s, opts)
                    last = time.perf_counter()
        except Exception as e:
            s.running = s.running_ar = False
            yield keep + (notice(e),) + (gr.skip(),) * 4
            return
        finally:
            s.running = False  # also when the tab goes away mid-run and Gradio closes the generator
            models.lock.release()
        yield view(s, opts, final=True)

    def request_stop(s):
        # The running event reads this flag between rounds (the state object is shared by reference), finishes its
        # round and sends the final tree and stats itself. The answer is a toast, never a write to an output of
        # the running event, which could land after the run's final update and overwrite it.
        sessions = [s.a, s.b] if isinstance(s, Pair) else [s]
        busy = any(x.running or x.sweeping for x in sessions)
        for x in sessions:
            x.stop_requested = x.stop_requested or busy
        if isinstance(s, Pair):
            s.stop_requested = busy
        gr.Info("stopping after this round…" if busy else "nothing is running", duration=3)

    def redraw(k, colour, collapse, threshold, zoom, s: Session):
        return tree_of(s, k, colour, collapse, threshold, zoom), s.text_html(int(k or 0) or None)

    def import_run(file, colour, collapse, threshold, zoom, s: Session):
        try:
            if not file:
                raise InputError("No file chosen.")
            loaded = load_run(file if isinstance(file, str) else getattr(file, "name", file))
        except ValueError as e:
            return (gr.skip(),) * 2 + (notice(InputError(str(e))),) + (gr.skip(),) * 4
        s.__dict__.update(loaded.__dict__)
        tree, text_, stats_, hist_, scrub, diag_, exp = view(s, (colour, collapse, threshold, zoom), final=True)
        return tree, text_, f"loaded {Path(str(file)).name}: " + stats_, hist_, scrub, diag_, exp

    # ---- side by side ----
    def cmp_view(p: Pair, k, colour, collapse, threshold, zoom):
        k = int(k or len(p.a.rounds) or 1)
        j = aligned_round(p.a, p.b, k)
        scrub = gr.Slider(minimum=0, maximum=max(1, len(p.a.rounds)), value=max(1, min(k, len(p.a.rounds) or 1)),
                          step=1, interactive=bool(p.a.rounds) and not p.running)
        opts = (colour, collapse, threshold, zoom)
        stats_ = summary(p.a, "A") + "  \n" + summary(p.b, "B") + "  \n" + TAU_DEF + (
            f"  \nshowing round {k} of A and round {j} of B (the round of B that covers the text where A's round "
            f"starts)" if p.a.rounds and p.b.rounds else "")
        return (tree_of(p.a, k, *opts, name="A · "), tree_of(p.b, j, *opts, name="B · ") if j else None, stats_,
                scrub, diag_of({f"{p.a.drafter} (A)": p.a, f"{p.b.drafter} (B)": p.b}))

    def run_compare(prompt, da, db, budget, temperature, max_tokens, ignore_eos, colour, collapse, threshold, zoom,
                    p: Pair):
        try:
            if da == db:
                raise InputError("Pick two different drafters.")
            for d in (da, db):
                check_inputs(models, prompt, d, budget, temperature, max_tokens)
            _, budget, temperature, max_tokens = check_inputs(models, prompt, da, budget, temperature, max_tokens)
            if not models.lock.acquire(timeout=600):
                raise InputError("The model is busy with another tab's run; try again shortly.")
        except Exception as e:
            yield (gr.skip(),) * 2 + (notice(e),) + (gr.skip(),) * 2
            return
        p.a, p.b, p.stop_requested = Session(), Session(), False
        try:
            last = 0.0
            for s, d in ((p.a, da), (p.b, db)):
                if p.stop_requested:
                    break
                for _ in stream(models, s, prompt, d, budget, temperature, max_tokens, not ignore_eos, False):
                    if p.stop_requested:
                        s.stop_requested = True
                    if time.perf_counter() - last >= UPDATE_EVERY_S:
                        yield cmp_view(p, None, colour, collapse, threshold, zoom)[:4] + (gr.skip(),)
                        last = time.perf_counter()
                s.running = False
        except Exception as e:
            yield (gr.skip(),) * 2 + (notice(e),) + (gr.skip(),) * 2
            return
        finally:
            p.a.running = p.b.running = False
            models.lock.release()
        yield cmp_view(p, 1, colour, collapse, threshold, zoom)

    # ---- sweeps and result files ----
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
        return F.sweep_figure(rows, title="this prompt"), [[r.get(c) for c in ("dataset", "drafter", "budget", "tau",
                                                                                 "speedup", "tokens_per_s")]
                                                           for r in rows], f"{done}: {len(rows)} runs"

    def result_choices():
        return [(str(Path(p).relative_to(results_dir)), p) for p in list_results(results_dir)]

    def load_result(path, dataset):
        """(plot, table, message, dataset selector, definitions)."""
        try:
            if not path:
                raise InputError(f"No result file chosen (looked in {results_dir}).")
            rf = R.load_file(path, str(Path(path).relative_to(results_dir)) if Path(path).is_relative_to(results_dir)
                             else Path(path).name)
            if rf.kind == "serving":
                fig, head = R.serving_figure(rf), R.SERVING_COLUMNS
                sel, defs = gr.Dropdown(choices=[], value=None, interactive=False), R.SERVING_LINE
            else:
                choices = rf.datasets + ([R.ALL] if len(rf.datasets) > 1 else [])
                dataset = dataset if dataset in choices else (choices[0] if choices else None)
                fig, head = R.tau_figure(rf, dataset), R.TAU_COLUMNS
                sel = gr.Dropdown(choices=choices, value=dataset, interactive=bool(choices))
                defs = R.TAU_LINE + ("  \n" + R.e2e_markdown(rf) if rf.e2e else "")
        except ValueError as e:
            return gr.skip(), gr.skip(), notice(InputError(str(e))), gr.skip(), gr.skip()
        rows = R.table(rf, dataset)
        return (fig, gr.Dataframe(value=rows, headers=head), f"loaded {len(rf.rows)} rows: {rf.title()}", sel, defs)

    available = models.available()
    inputs_help = (f"budget 1–{MAX_BUDGET} tree nodes (root included) · temperature 0–2 · max tokens 1–{MAX_TOKENS}; "
                   "out-of-range values are refused with a message, never clamped")
    with gr.Blocks(title="JetFlow tree explorer", analytics_enabled=False) as demo:
        # A factory (not an instance, which Gradio would deep-copy): Gradio calls it once per tab.
        state = gr.State(lambda: Session())
        pair = gr.State(lambda: Pair())
        gr.Markdown("**JetFlow tree explorer** · each round the drafter proposes a token tree; the target verifies "
                    "all of it in one forward and keeps the longest path it agrees with.  \n" + models.banner(),
                    elem_id="jf-banner")
        with gr.Row(equal_height=False):
            # the settings sidebar: shared by the Live, Side by side and Budget sweep tabs
            with gr.Column(scale=2, min_width=340):
                prompt = gr.Textbox(label="prompt", lines=3, max_lines=8, elem_id="jf-prompt")
                with gr.Row():
                    ex_buttons = [(gr.Button(f"{k}", size="sm", elem_id=f"jf-ex-{k}", min_width=60), v)
                                  for k, v in EXAMPLES.items()]
                drafter = gr.Dropdown([(k, v) for k, v in DRAFTERS if v in available], label="drafter",
                                      value=available[0], elem_id="jf-drafter")
                with gr.Row():
                    budget = gr.Number(32, label="budget (nodes)", precision=None, elem_id="jf-budget", min_width=80)
                    temperature = gr.Number(0.0, label="temperature", elem_id="jf-temperature", min_width=80)
                    max_tokens = gr.Number(128, label="max tokens", precision=None, elem_id="jf-max-tokens",
                                           min_width=80)
                gr.Markdown(f"<small>{inputs_help}</small>")
                ignore_eos = gr.Checkbox(False, label="keep going past end-of-text", elem_id="jf-ignore-eos")
                measure_ar = gr.Checkbox(True, label="measure speedup over plain decoding", elem_id="jf-measure-ar")
                with gr.Row():
                    go_btn = gr.Button("Generate", variant="primary", elem_id="jf-generate", min_width=100)
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="jf-stop", min_width=60)
                with gr.Row():
                    export_btn = gr.DownloadButton("Export run", value=None, interactive=False, elem_id="jf-export",
                                                   size="sm", min_width=80)
                    import_btn = gr.UploadButton("Load run", file_types=[".json"], elem_id="jf-import", size="sm",
                                                 min_width=80)
                colour = gr.Radio(COLOUR_CHOICES, value="draft", label="node colour (per-step probability)",
                                  elem_id="jf-colour")
                with gr.Row():
                    collapse = gr.Checkbox(True, label=f"fold trees over {F.COLLAPSE_MIN} nodes",
                                           elem_id="jf-collapse", min_width=100)
                    threshold = gr.Number(0.01, label="fold below draft p", elem_id="jf-threshold", min_width=80)
                zoom = gr.Checkbox(False, label="zoom to the accepted path", elem_id="jf-zoom")
            view_opts = [colour, collapse, threshold, zoom]
            with gr.Column(scale=5):
                with gr.Tab("Live"):
                    stats = gr.Markdown("no rounds yet", elem_id="jf-stats")
                    scrubber = gr.Slider(0, 1, value=1, step=1, label="round", interactive=False, elem_id="jf-round")
                    with gr.Row(equal_height=False):
                        with gr.Column(scale=3):
                            gr.Markdown("<small>draft tree: accepted path outlined in red, rejected branches "
                                        "dimmed, ★ = the token the target chose; hover a node for the target's "
                                        "view</small>")
                            tree_plot = gr.Plot(show_label=False, elem_id="jf-tree")
                        with gr.Column(scale=2, min_width=240):
                            text = gr.HTML('<div class="jf-text"></div>', elem_id="jf-text")
                    gr.Markdown("<small>acceptance diagnostics of this run: a node is *tried* when its parent was "
                                "accepted; hover for counts</small>")
                    diag = gr.Plot(show_label=False, elem_id="jf-diag")
                    hist = gr.Plot(show_label=False, elem_id="jf-hist")
                with gr.Tab("Side by side"):
                    with gr.Row():
                        cmp_a = gr.Dropdown([(k, v) for k, v in DRAFTERS if v in available], value=available[0],
                                            label="drafter A", elem_id="jf-cmp-a")
                        cmp_b = gr.Dropdown([(k, v) for k, v in DRAFTERS if v in available],
                                            value=next((v for v in available[1:] if v != "ar"), available[-1]),
                                            label="drafter B", elem_id="jf-cmp-b")
                        cmp_btn = gr.Button("Run both", variant="primary", elem_id="jf-cmp-run")
                        cmp_stop = gr.Button("Stop", variant="stop", elem_id="jf-cmp-stop")
                    cmp_stats = gr.Markdown("Runs two drafters on the prompt and settings on the left, one after "
                                            "the other.", elem_id="jf-cmp-stats")
                    cmp_scrub = gr.Slider(0, 1, value=1, step=1, label="round of A", interactive=False,
                                          elem_id="jf-cmp-round")
                    with gr.Row(equal_height=False):
                        cmp_tree_a = gr.Plot(show_label=False, elem_id="jf-cmp-tree-a")
                        cmp_tree_b = gr.Plot(show_label=False, elem_id="jf-cmp-tree-b")
                    cmp_diag = gr.Plot(show_label=False, elem_id="jf-cmp-diag")
                with gr.Tab("Budget sweep"):
                    gr.Markdown(f"Runs the prompt on the left at budgets {list(BUDGETS)} for each chosen drafter, "
                                "plus autoregressive decoding once for the speedup baseline.")
                    with gr.Row():
                        sweep_drafters = gr.CheckboxGroup(
                            [(k, v) for k, v in DRAFTERS if v in available and v != "ar"],
                            value=[v for v in ("jetflow", "ngram") if v in available], label="drafters",
                            elem_id="jf-sweep-drafters")
                        sweep_tokens = gr.Slider(8, 256, value=48, step=8, label="max tokens per run")
                    with gr.Row():
                        sweep_btn = gr.Button("Run sweep", variant="primary", elem_id="jf-sweep")
                        sweep_stop = gr.Button("Stop", variant="stop")
                    sweep_msg = gr.Markdown("", elem_id="jf-sweep-msg")
                    sweep_plot = gr.Plot(label="tau and speedup vs budget", elem_id="jf-sweep-plot")
                    sweep_table = gr.Dataframe(headers=["dataset", "drafter", "budget", "tau", "speedup", "tokens/s"],
                                               label="results", interactive=False)
                with gr.Tab("Results"):
                    with gr.Row():
                        files = gr.Dropdown(result_choices(), label=f"result file (from {results_dir})",
                                            elem_id="jf-results", scale=3)
                        dataset = gr.Dropdown([], label="dataset", elem_id="jf-dataset", interactive=False, scale=2)
                        with gr.Column(scale=1, min_width=90):
                            load_btn = gr.Button("load", size="sm", variant="primary", elem_id="jf-load")
                            refresh = gr.Button("refresh list", size="sm")
                    res_msg = gr.Markdown("", elem_id="jf-res-msg")
                    res_plot = gr.Plot(show_label=False, elem_id="jf-res-plot")
                    res_defs = gr.Markdown(R.TAU_LINE, elem_id="jf-res-defs")
                    res_table = gr.Dataframe(headers=R.TAU_COLUMNS, label="rows (rounded)", interactive=False,
                                             elem_id="jf-res-table")

        for btn, text_ in ex_buttons:
            btn.click(lambda t=text_: t, None, prompt, api_visibility="private")
        # The states are inputs only: the events mutate their tab's objects in place (Gradio keeps them by reference).
        outs = [tree_plot, text, stats, hist, scrubber, diag, export_btn]
        run_in = [prompt, drafter, budget, temperature, max_tokens, ignore_eos, measure_ar, *view_opts, state]
        buttons = [go_btn, cmp_btn]
        for trigger in (go_btn.click, prompt.submit):
            # Generate says "Running…" and is disabled until the run is over (also when another tab holds the model)
            trigger(busy_buttons, None, buttons, concurrency_limit=None, api_visibility="private").then(
                run_generation, run_in, outs, concurrency_id="model", concurrency_limit=1, show_progress="minimal",
                api_visibility="private").then(idle_buttons, None, buttons, concurrency_limit=None,
                                               api_visibility="private")
        # No outputs (see request_stop) and no concurrency limit: Stop never waits behind other events.
        stop_btn.click(request_stop, state, None, concurrency_limit=None, api_visibility="private")
        for ev in (scrubber.input, colour.change, collapse.change, threshold.submit, zoom.change):
            ev(redraw, [scrubber, *view_opts, state], [tree_plot, text], api_visibility="private")
        import_btn.upload(import_run, [import_btn, *view_opts, state], outs, api_visibility="private")

        cmp_outs = [cmp_tree_a, cmp_tree_b, cmp_stats, cmp_scrub, cmp_diag]
        cmp_btn.click(busy_buttons, None, buttons, concurrency_limit=None, api_visibility="private").then(
            run_compare, [prompt, cmp_a, cmp_b, budget, temperature, max_tokens, ignore_eos, *view_opts, pair],
            cmp_outs, concurrency_id="model", concurrency_limit=1, show_progress="minimal",
            api_visibility="private").then(idle_buttons, None, buttons, concurrency_limit=None,
                                           api_visibility="private")
        cmp_stop.click(request_stop, pair, None, concurrency_limit=None, api_visibility="private")
        cmp_scrub.input(lambda p, k, *o: cmp_view(p, k, *o), [pair, cmp_scrub, *view_opts], cmp_outs,
                        api_visibility="private")

        sweep_btn.click(run_sweep, [prompt, sweep_drafters, sweep_tokens, temperature, state],
                        [sweep_plot, sweep_table, sweep_msg], concurrency_id="model", concurrency_limit=1,
                        api_visibility="private")
        sweep_stop.click(request_stop, state, None, concurrency_limit=None, api_visibility="private")
        refresh.click(lambda: gr.Dropdown(choices=result_choices()), None, files, api_visibility="private")
        res_outs = [res_plot, res_table, res_msg, dataset, res_defs]
        load_btn.click(load_result, [files, dataset], res_outs, api_visibility="private")
        dataset.input(load_result, [files, dataset], res_outs, api_visibility="private")
    return demo


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="jetflow-explorer", description=__doc__.split("\n")[0])
    ap.add_argument("--target", help="HF model folder (default: SmolLM2-135M-Instruct, converted offline on first use)")
    ap.add_argument("--head", help="draft-head folder (default: the shipped head)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"])
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
    if not models.has_head:
        print(f"[explorer] head not loaded: {models.head_error}", flush=True)
    demo = build(models, Path(args.results).resolve())
    theme = gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],  # no web-font fetches offline
                              font_mono=["ui-monospace", "monospace"])
    demo.queue(default_concurrency_limit=4).launch(server_name=args.host, server_port=args.port, theme=theme,
                                                   css=CSS, show_error=True, footer_links=[],
                                                   max_file_size=MAX_UPLOAD_BYTES)


if __name__ == "__main__":
    main()
