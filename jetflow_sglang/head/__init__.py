"""JetFlow draft head: causal (JetFlow) or bidirectional (DFlash/DDTree) in-block attention."""
from jetflow_sglang.head.check import check_head_files
from jetflow_sglang.head.config import (CheckpointError, HeadMismatchError, JetFlowHeadConfig, default_tap_layers,
                                         target_signature)
from jetflow_sglang.head.export import ExportError, export_head
from jetflow_sglang.head.io import attach_head, load_head, read_head_config, save_head
from jetflow_sglang.head.model import MASK, JetFlowHead, init_from_target

__all__ = ["CheckpointError", "ExportError", "HeadMismatchError", "JetFlowHeadConfig", "JetFlowHead", "MASK",
           "attach_head", "check_head_files", "default_tap_layers", "export_head", "init_from_target", "load_head",
           "read_head_config", "save_head", "target_signature"]
