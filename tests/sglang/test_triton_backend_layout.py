"""The pieces `jetflow_tree_triton` builds SGLang's pool views from (no server, no Triton): the block table read from
req_to_token on pages of 16, the pool viewed as pages without a copy, and the tree mask packed per request."""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("JETFLOW_SKIP_SGLANG") == "1":
    pytest.skip("SGLang is not installed (JETFLOW_SKIP_SGLANG=1)", allow_module_level=True)
from jetflow_sglang.sglang.cpu import ops as cpu_ops  # noqa: E402

cpu_ops.install()  # SGLang's attention modules reach torchvision (a stub on a CPU install)
from jetflow_sglang.core.tree import unpack_bits  # noqa: E402
from jetflow_sglang.sglang.attention.tree_triton import block_table, pack_tree_rows, paged  # noqa: E402


def test_block_table_reads_one_slot_per_page():
    page, g = 16, torch.Generator().manual_seed(0)
    pages = torch.randperm(40, generator=g)[:9].view(3, 3)  # 3 requests, 3 scattered pages each
    req_to_token = torch.zeros(5, 64, dtype=torch.int32)
    rows = torch.tensor([4, 0, 2])  # req_pool_indices, out of order
    for r, ps in zip(rows.tolist(), pages):
        req_to_token[r, :48] = (ps[:, None] * page + torch.arange(page)).reshape(-1).to(torch.int32)
    bt = block_table(req_to_token, rows, width=40, page_size=page)  # positions < 40: pages 0, 1, 2
    assert bt.dtype == torch.int32 and bt.tolist() == pages.tolist()
    assert block_table(req_to_token, rows, width=40, page_size=1).tolist() == req_to_token[rows, :40].tolist()


def test_pool_is_viewed_as_pages_without_a_copy():
    buf = torch.randn(64, 2, 8)
    view = paged(buf, 16)
    assert view.shape == (4, 16, 2, 8) and view.data_ptr() == buf.data_ptr()
    assert torch.equal(view[2, 5], buf[2 * 16 + 5])
    with pytest.raises(ValueError, match="whole number of 16-token pages"):
        paged(torch.randn(65, 2, 8), 16)


def test_tree_rows_pack_per_request():
    rows = torch.rand(3, 40, 40, generator=torch.Generator().manual_seed(1)) < 0.5
    words = pack_tree_rows(rows)
    assert words.dtype == torch.int32 and words.shape == (120, 2)
    assert torch.equal(unpack_bits(words, 40).view(3, 40, 40), rows)
    assert not torch.equal(unpack_bits(pack_tree_rows(rows.transpose(1, 2)), 40).view(3, 40, 40), rows)
