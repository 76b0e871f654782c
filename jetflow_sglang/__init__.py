"""JetFlow: causal parallel tree drafting for speculative decoding, with an SGLang worker.

Light on import: the SGLang plugin imports this package in every SGLang process.
"""
from jetflow_sglang.paths import default_paths

__version__ = "0.1.0"
__all__ = ["default_paths", "__version__"]
