"""CPU shims that let SGLang serve on a machine without a GPU (see jetflow_sglang.sglang.compat.PATCHES)."""
