"""The tree-verify attention backends JETFLOW registers with SGLang (`jetflow_tree_native`, `jetflow_tree_triton`)
and the guard that picks and checks the backend that runs verify."""
