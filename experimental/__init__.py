"""Code that no run path calls yet, kept with its tests: the FlashInfer verify path and Triton AOT compilation."""
