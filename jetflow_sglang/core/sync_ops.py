"""The ATen ops that make the host wait for the device or whose output shape depends on device data: one list for
the live checker of a served round (sglang/host_syncs.py) and for the static scan of a captured piece (graphs.py)."""
from __future__ import annotations

import torch

aten = torch.ops.aten
ALWAYS = {aten._local_scalar_dense.default: "item", aten.nonzero.default: "nonzero",
          aten.masked_select.default: "masked_select", aten.multinomial.default: "multinomial",
          aten._unique2.default: "unique", aten.unique_dim.default: "unique",
          aten.unique_consecutive.default: "unique"}
BOOL_INDEXED = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
REPEATS = (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor)
TO_HOST = (aten._to_copy.default, aten.copy_.default)
PYTHON_LEVEL = ("tolist", "cpu")  # host reads the dispatcher cannot see on CPU tensors


def flag(func, args, kwargs) -> str | None:
    """The reason `func(*args, **kwargs)` makes the host wait or has a data-dependent shape, or None."""
    if func in ALWAYS:
        return ALWAYS[func]
    if func in (aten.lift_fresh.default, aten.lift_fresh_copy.default):  # (the second: in a traced piece)
        # a Python scalar (x[:, 0] = True) is a fill on the device, not a copy
        return "from Python data" if args[0].dim() > 0 else None
    if func in BOOL_INDEXED:
        idx = args[1] if len(args) > 1 else ()
        if any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in idx):
            return "boolean index"
    elif func in REPEATS:
        if kwargs.get("output_size") is None:
            return "repeat_interleave without output_size"
    elif func in TO_HOST:  # a non_blocking copy (readback.py's, behind an event) does not wait
        if func is aten._to_copy.default:
            src, dst, quiet = args[0], kwargs.get("device"), kwargs.get("non_blocking", False)
        else:
            src, dst, quiet = args[1], args[0].device, args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if dst is not None and torch.device(dst).type == "cpu" and isinstance(src, torch.Tensor) \
                and src.device.type != "cpu" and not quiet:
            return "copy to the host"
    return None
