"""JetFlow draft head: causal (JetFlow) or bidirectional (DFlash/DDTree) in-block attention."""
from .config import CheckpointError, HeadMismatchError, JetFlowHeadConfig, default_tap_layers, target_signature
from .io import load_head, save_head
from .model import MASK, JetFlowHead, init_from_target

__all__ = ["CheckpointError", "HeadMismatchError", "JetFlowHeadConfig", "JetFlowHead", "MASK", "default_tap_layers",
           "init_from_target", "load_head", "save_head", "target_signature"]
