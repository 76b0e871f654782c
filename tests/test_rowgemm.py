"""rowgemm: multi-row CPU linears as W @ X^T are the same maths as F.linear, one row is bit-identical, and the patch
comes off again."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from jetflow_sglang.core import rowgemm


@pytest.fixture(autouse=True)
def transposed_on():
    """These tests check the transposed product's maths; whether it pays is profiling.tune_gemm's measurement, which
    a stack loaded earlier in the same process may have switched off."""
    was = rowgemm.active()
    rowgemm.activate(True)
    yield
    rowgemm.activate(was)


def test_linear_matches_f_linear():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(300, 64, generator=g), torch.randn(300, generator=g)
    for shape in [(1, 64), (1, 1, 64), (2, 64), (3, 7, 64), (1, 256, 64)]:
        x = torch.randn(*shape, generator=g)
        for bias in (None, b):
            got, ref = rowgemm.linear(x, w, bias), F.linear(x, w, bias)
            assert got.shape == ref.shape
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            if x.numel() == 64:  # plain decoding keeps the stock kernel bit for bit
                assert torch.equal(got, ref)


def test_enable_disable_roundtrip_and_grad():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False))
    x = torch.randn(5, 16)
    ref = model(x)
    rowgemm.enable(model)
    rowgemm.enable(model)  # idempotent
    assert rowgemm.enabled(model)
    got = model(x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    got.sum().backward()  # still differentiable
    assert model[0].weight.grad is not None
    rowgemm.disable(model)
    assert not rowgemm.enabled(model)
    assert "forward" not in vars(model[0])
    assert torch.equal(model(x), ref)


def test_contiguous_output_for_row_major_kernels():
    x, w = torch.randn(6, 32), torch.randn(40, 32)
    assert not rowgemm.linear(x, w).is_contiguous()  # the fast path returns the transposed view
    out = rowgemm.linear(x, w, contiguous=True)
    assert out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_only_float32_takes_the_transposed_product():
    """bfloat16 stays on F.linear (oneDNN's native small-row kernels beat W @ X^T there): bit-identical to it."""
    import torch
    import torch.nn.functional as F

    from jetflow_sglang.core import rowgemm

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 32, generator=g), torch.randn(5, 32, generator=g)
    assert torch.equal(rowgemm.linear(x.bfloat16(), w.bfloat16()), F.linear(x.bfloat16(), w.bfloat16()))
    out = rowgemm.linear(x, w)
    assert out.stride() == (1, 5)  # float32: the transposed product (a transposed view)
    torch.testing.assert_close(out, F.linear(x, w))
