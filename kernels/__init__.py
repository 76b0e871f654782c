"""Tree-mask attention kernels for JetFlow verification.

Importing the package is cheap and never imports triton or flashinfer: load `kernels.triton_tree_attn` (Triton),
`kernels.flashinfer_path` (FlashInfer, optional) or `kernels.hf_tree_attention` (transformers wiring) explicitly.
"""
from .tree_mask import GRAPH_WORDS, dense_allow, flashinfer_custom_mask, pad_nodes, pad_words  # noqa: F401
