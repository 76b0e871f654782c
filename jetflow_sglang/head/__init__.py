"""JetFlow draft head: causal (JetFlow) or bidirectional (DFlash/DDTree) in-block attention."""
from .check import check_head_files
from .config import CheckpointError, HeadMismatchError, JetFlowHeadConfig, default_tap_layers, target_signature
from .fit import BIDIRECTIONAL_DRAFTERS, CAUSAL_DRAFTERS, drafter_for
from .io import attach_head, load_head, read_head_config, save_head
from .model import MASK, JetFlowHead, init_from_target

__all__ = ["BIDIRECTIONAL_DRAFTERS", "CAUSAL_DRAFTERS", "CheckpointError", "HeadMismatchError", "JetFlowHeadConfig",
           "JetFlowHead", "MASK", "attach_head", "check_head_files", "default_tap_layers", "drafter_for",
           "init_from_target", "load_head", "read_head_config", "save_head", "target_signature"]
