"""Multi-LoRA shrink/expand kernels against their reference, the reference against a per-row loop over unpadded
adapters, and the grouping of rows into segments."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_test_utils import DEVICE, TOLERANCE, assert_close, strided_copy

from sluice.kernels import lora
from sluice.kernels.lora import lora_expand, lora_reference, lora_segments, lora_shrink

K, N_OUT = 48, 80  # neither a multiple of its tile (32 over K, 64 over the output): the masked edges are exercised
MIXED = (8, 16, 64, 16)  # one stack of adapters of different ranks, zero-padded to 64


def _adapters(gen, ranks, dtype, k=K, n_out=N_OUT):
    """a [S, R, K], b [S, Nout, R] with R = max(ranks); adapter s uses only its first ranks[s] ranks (zeros after)."""
    r = max(ranks)
    a = torch.zeros(len(ranks), r, k, device=DEVICE)
    b = torch.zeros(len(ranks), n_out, r, device=DEVICE)
    for s, rank in enumerate(ranks):
        a[s, :rank] = torch.randn(rank, k, generator=gen, device=DEVICE) * k**-0.5
        b[s, :, :rank] = torch.randn(n_out, rank, generator=gen, device=DEVICE) * rank**-0.5
    return a.to(dtype), b.to(dtype)


def _per_row(x, a, b, slots, ranks):
    """delta row by row from each adapter's own unpadded matrices, in float32."""
    out = torch.zeros(x.shape[0], b.shape[1], device=DEVICE)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            out[i] = x[i].float() @ a[s, : ranks[s]].float().T @ b[s, :, : ranks[s]].float().T
    return out


def _slots(gen, case: str, num_adapters: int) -> torch.Tensor:
    if case == "single_row":
        return torch.tensor([2], device=DEVICE)
    if case == "one_row_per_adapter":  # decode: segments of one row, adapters in no particular order
        return torch.tensor([3, 0, -1, 2, 1], device=DEVICE)
    if case == "shuffled":  # adapters interleaved in the rows, some rows without one
        return torch.randint(-1, num_adapters, (23,), generator=gen, device=DEVICE)
    # long_segment: 70 rows of adapter 1 (two 64-row tiles, the second mostly masked) among a few others
    slots = torch.cat([torch.full((70,), 1, device=DEVICE), torch.tensor([0, 3, -1, 0, -1, 2], device=DEVICE)])
    return slots[torch.randperm(slots.numel(), generator=gen, device=DEVICE)]


def _run(x, a, b, slots, y, **kw):
    order, seg_starts, seg_slots = lora_segments(slots)
    t = lora_shrink(x, a, order, seg_starts, seg_slots, **kw)
    lora_expand(t, b, order, seg_starts, seg_slots, y, **kw)
    return t, order


def _check(gen, slots, ranks, dtype):
    x = torch.randn(slots.numel(), K, generator=gen, device=DEVICE).to(dtype)
    a, b = _adapters(gen, ranks, dtype)
    y0 = torch.randn(slots.numel(), N_OUT, generator=gen, device=DEVICE).to(dtype)
    y = y0.clone()
    t, order = _run(x, a, b, slots, y)
    assert t.dtype == torch.float32 and t.shape == (order.numel(), max(ranks))
    t_ref = torch.stack([x[i].float() @ a[slots[i]].float().T for i in order.tolist()])
    torch.testing.assert_close(t, t_ref, atol=TOLERANCE[dtype][0], rtol=TOLERANCE[dtype][1])
    for m, i in enumerate(order.tolist()):  # padding is exact: an adapter's unused ranks stay zero in t
        assert (t[m, ranks[slots[i]] :] == 0).all()
    delta = _per_row(x, a, b, slots, ranks)
    assert_close(y, (y0.float() + delta).to(dtype))
    assert_close(lora_reference(x, a, b, slots), delta.to(dtype))
    none = slots < 0
    assert torch.equal(y[none], y0[none])  # rows without an adapter are not touched


@pytest.mark.parametrize("case", ["single_row", "one_row_per_adapter", "shuffled", "long_segment"])
def test_shrink_expand_match_reference(gen, dot_dtype, case):
    _check(gen, _slots(gen, case, len(MIXED)), MIXED, dot_dtype)


@pytest.mark.parametrize("rank", [8, 16, 64, 128])  # 8 is narrower than tl.dot's 16 (masked); 128 the widest tile
def test_one_rank_for_every_adapter(gen, dot_dtype, rank):
    _check(gen, _slots(gen, "shuffled", 3), (rank,) * 3, dot_dtype)


def test_reference_matches_a_per_row_loop(gen):
    slots = _slots(gen, "shuffled", len(MIXED))
    x = torch.randn(slots.numel(), K, generator=gen, device=DEVICE)
    a, b = _adapters(gen, MIXED, torch.float32)
    delta = lora_reference(x, a, b, slots)
    torch.testing.assert_close(delta, _per_row(x, a, b, slots, MIXED))
    assert (delta[slots < 0] == 0).all()


def test_strided_x_and_a_column_slice_of_y(gen):
    """y as a slice of a fused projection's output: the columns beside it are not touched."""
    slots = _slots(gen, "shuffled", len(MIXED))
    x = strided_copy(torch.randn(slots.numel(), K, generator=gen, device=DEVICE))
    a, b = _adapters(gen, MIXED, torch.float32)
    full = torch.randn(slots.numel(), N_OUT + 16, generator=gen, device=DEVICE)
    before = full.clone()
    order, seg_starts, seg_slots = lora_segments(slots)
    longest = int(torch.bincount(slots[slots >= 0]).max())  # as a caller that knows the counts passes it
    t = lora_shrink(x, a, order, seg_starts, seg_slots, max_seg_len=longest)
    lora_expand(t, b, order, seg_starts, seg_slots, full[:, 8 : 8 + N_OUT], max_seg_len=longest)
    assert_close(full[:, 8 : 8 + N_OUT], before[:, 8 : 8 + N_OUT] + _per_row(x, a, b, slots, MIXED))
    assert torch.equal(full[:, :8], before[:, :8]) and torch.equal(full[:, 8 + N_OUT :], before[:, 8 + N_OUT :])


def test_no_adapter_rows_launch_nothing(gen, monkeypatch):
    monkeypatch.setattr(lora, "_lora_shrink_kernel", None)  # a launch would fail: None[grid]
    monkeypatch.setattr(lora, "_lora_expand_kernel", None)
    slots = torch.full((5,), -1, device=DEVICE)
    x = torch.randn(5, K, generator=gen, device=DEVICE)
    a, b = _adapters(gen, MIXED, torch.float32)
    y0 = torch.randn(5, N_OUT, generator=gen, device=DEVICE)
    y = y0.clone()
    t, _ = _run(x, a, b, slots, y)
    assert t.shape == (0, 64) and torch.equal(y, y0)


@pytest.mark.parametrize("n, num_adapters", [(1, 1), (9, 2), (50, 5), (40, 1)])
def test_segments_group_rows_stably_by_slot(gen, n, num_adapters):
    slots = torch.randint(-1, num_adapters, (n,), generator=gen, device=DEVICE)
    slots[0] = num_adapters - 1  # at least one row with an adapter
    order, seg_starts, seg_slots = lora_segments(slots)
    assert (order.dtype, seg_starts.dtype, seg_slots.dtype) == (torch.int64, torch.int32, torch.int32)
    present = sorted(set(slots.tolist()) - {-1})
    assert seg_slots.tolist() == present  # one segment per distinct slot
    expected = [i for s in present for i in range(n) if slots[i] == s]  # each slot's rows in their own order
    assert order.tolist() == expected
    counts = [int((slots == s).sum()) for s in present]
    assert seg_starts.tolist() == [sum(counts[:g]) for g in range(len(counts) + 1)]


def test_segments_without_adapters_are_empty():
    order, seg_starts, seg_slots = lora_segments(torch.full((4,), -1, device=DEVICE))
    assert order.shape == (0,) and seg_starts.tolist() == [0] and seg_slots.shape == (0,)


def test_bad_arguments_say_what_is_wrong(gen):
    slots = torch.tensor([0, 1, 0], device=DEVICE)
    x = torch.randn(3, K, generator=gen, device=DEVICE)
    a, b = _adapters(gen, (8, 8), torch.float32)
    order, seg_starts, seg_slots = lora_segments(slots)
    with pytest.raises(ValueError, match="seg_slots must be a contiguous 1-D torch.int32"):
        lora_shrink(x, a, order, seg_starts, seg_slots.long())
    with pytest.raises(ValueError, match="order must be .* \\(not contiguous\\)"):
        lora_shrink(x, a, torch.stack([order, order], 1)[:, 0], seg_starts, seg_slots)
    with pytest.raises(ValueError, match="x and a must share one float dtype"):
        lora_shrink(x, a.half(), order, seg_starts, seg_slots)
    with pytest.raises(ValueError, match=r"a \(2, 8, 48\) = \[S, R, K\]"):
        lora_shrink(x[:, :32], a, order, seg_starts, seg_slots)
    t = torch.zeros(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="y and b must share one dtype"):
        lora_expand(t, b, order, seg_starts, seg_slots, torch.zeros(3, N_OUT, device=DEVICE).half())
    with pytest.raises(ValueError, match="order \\[3\\] must have M = 2"):
        lora_expand(t[:2], b, order, seg_starts, seg_slots, torch.zeros(3, N_OUT, device=DEVICE))


SCRIPT = """
import sys
sys.modules["triton"] = None  # import triton now raises ImportError, as on a host without it
import torch
from sluice.kernels.lora import lora_expand, lora_reference, lora_segments, lora_shrink
x, a, b = torch.randn(3, 16), torch.randn(2, 8, 16), torch.randn(2, 12, 8)
assert lora_reference(x, a, b, torch.tensor([1, -1, 0])).shape == (3, 12)
segments = lora_segments(torch.tensor([-1, -1, -1]))
lora_expand(lora_shrink(x, a, *segments), b, *segments, torch.zeros(3, 12))  # no rows: nothing to launch
try:
    lora_shrink(x, a, *lora_segments(torch.tensor([1, -1, 0])))
except ModuleNotFoundError as e:
    assert "triton" in str(e)
else:
    raise AssertionError("launch without triton did not fail")
"""


def test_reference_imports_and_runs_without_triton():
    subprocess.run([sys.executable, "-c", SCRIPT], cwd=Path(__file__).resolve().parents[2], check=True, timeout=120)
