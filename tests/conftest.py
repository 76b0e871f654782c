"""Test-session settings that must exist before any test module imports torch, transformers or triton."""
import os

# Triton decides at import time whether its own library functions run in the interpreter, and transformers may import
# triton early. Without a GPU the kernels can only run interpreted, so turn that on before anything is imported.
if os.environ.get("JETFLOW_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
