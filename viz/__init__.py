"""JetFlow tree explorer: a Gradio app that shows each round's draft tree, the accepted path and budget sweeps.

Run it with `jetflow-explorer` or `python -m viz`; see viz/app.py.
"""
