"""The standalone Hugging Face engine: target, batched target, the stack (target + head + drafter), the
speculative loop, exact rows, divergence reports, offline trees and machine profiling. SGLang never imports it."""
from jetflow_sglang.engine.loop import Result, autoregressive, generate, generate_batch, run
from jetflow_sglang.engine.stack import load_stack

__all__ = ["Result", "autoregressive", "generate", "generate_batch", "load_stack", "run"]
