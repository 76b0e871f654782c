"""Pure torch: draft trees, batched trees, prompt lookup, acceptance, the budget controller, row GEMMs.

Imports nothing else from jetflow_sglang: every other part builds on it."""
