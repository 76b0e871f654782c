"""Tree-mask attention kernels for JetFlow verification.

Importing the package is cheap and never imports triton or flashinfer: load `triton_tree_attn` (Triton) or
`hf_tree_attention` (transformers wiring) explicitly; the FlashInfer path is `experimental.flashinfer_path`.
"""
from jetflow_sglang.kernels.tree_mask import GRAPH_WORDS, dense_allow, pad_nodes, pad_words  # noqa: F401
