"""JetFlow tree explorer: a Gradio app that shows each round's draft tree, the accepted path and budget sweeps.

Run it with `jetflow-explorer` or `python -m jetflow_sglang.viz`; see jetflow_sglang/viz/app.py.
"""
