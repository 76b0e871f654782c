"""rowgemm: multi-row CPU linears as W @ X^T are the same maths as F.linear, one row is bit-identical, and the patch
comes off again."""
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from jetflow_sglang.core import rowgemm


@pytest.fixture(autouse=True)
def transposed_on():
    """These tests check the transposed product's maths; where it pays is rowgemm.tune's measurement, which a stack
    loaded earlier in the same process may have made for some shapes."""
    was, limits = rowgemm.active(), rowgemm.limits()
    rowgemm.activate(True)
    rowgemm.set_limits({})
    yield
    rowgemm.activate(was)
    rowgemm.set_limits(limits)


def test_tune_takes_the_transposed_product_only_up_to_where_it_measured_faster(tmp_path, monkeypatch):
    """W @ X^T won on every layer of an AVX2 EPYC, lost on every layer of an AMX Xeon, and on an AVX512-BF16 EPYC won
    only on the LM head at up to 4-8 rows: the choice is per weight shape and row count, measured (fake timings here),
    cached on disk per machine, and linear() follows it."""
    stops = {(48, 32): 10**6, (40, 32): 8, (24, 32): 0}  # most rows at which the transposed product is faster

    def fake(weight, rows, reps=3):
        return (1.0, 0.5 if rows <= stops[tuple(weight.shape)] else 0.95)  # (stock s, W @ X^T s): 0.95 is noise

    monkeypatch.setattr(rowgemm, "measure", fake)
    always, some, never = torch.randn(48, 32), torch.randn(40, 32), torch.randn(24, 32)
    cache = tmp_path / "gemm_limits.json"
    got = rowgemm.tune([always, some, never, never.clone(), torch.randn(8, 32, dtype=torch.bfloat16)], cache_file=cache,
                       machine="CPU A")
    assert got == {(48, 32): rowgemm.MAX_ROWS, (40, 32): 8, (24, 32): 0}  # bfloat16 is never measured (always stock)
    x8, x9 = torch.randn(8, 32), torch.randn(9, 32)
    assert rowgemm.linear(x8, some).stride() == (1, 8)  # transposed
    assert torch.equal(rowgemm.linear(x9, some), F.linear(x9, some))  # past the limit: stock, bit for bit
    assert torch.equal(rowgemm.linear(x8, never), F.linear(x8, never))
    assert rowgemm.linear(torch.randn(300, 32), always).stride() == (1, 300)
    rowgemm.set_limits({})  # a new process on the same machine reads the cache and measures nothing
    monkeypatch.setattr(rowgemm, "measure", lambda *a, **k: pytest.fail("measured a cached shape again"))
    assert rowgemm.tune([some], cache_file=cache, machine="CPU A") == {(40, 32): 8}
    monkeypatch.setattr(rowgemm, "measure", fake)  # another machine measures again
    stops[(24, 32)] = 2
    rowgemm.set_limits({})
    assert rowgemm.tune([never], cache_file=cache, machine="CPU B") == {(24, 32): 2}
    assert len(json.loads(cache.read_text())) == 2


def test_tune_measures_real_products():
    """The real timing runs, and its answer is one of the measured row counts."""
    got = rowgemm.tune([torch.randn(64, 48)], reps=1)
    assert got[(64, 48)] in (0, rowgemm.MAX_ROWS) + rowgemm.ROWS[:-1]


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


@pytest.mark.parametrize("shape", [(1536, 576), (4096, 576)])
def test_exact_rows_round_as_a_one_row_step_at_any_row_count(shape):
    """min_rows > 1 (exact rows): each of 100 bfloat16 rows equals the same row multiplied alone (padded). On an AMX
    Xeon oneDNN takes another kernel above 32 rows for these shapes, and without the 32-row chunks rows differed."""
    torch.manual_seed(0)
    w = torch.randn(*shape).bfloat16()
    x = torch.randn(100, shape[1]).bfloat16()
    many = rowgemm.linear(x, w, min_rows=4)
    assert many.shape == (100, shape[0])
    for r in range(100):
        assert torch.equal(many[r], rowgemm.linear(x[r:r + 1], w, min_rows=4)[0]), r
