"""Fixes of SGLang 0.5.23 that a JETFLOW server needs, each listed in compat.SERVING with the upstream change
that would retire it (docs/UPSTREAM.md). Installed only in a JETFLOW server's processes (plugin.install_patches,
the worker)."""
