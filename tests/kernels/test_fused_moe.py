"""The fused-MoE kernel against its reference, and the reference against a per-token loop over experts."""

import pytest
import torch
import torch.nn.functional as F
from kernel_test_utils import DEVICE, assert_close

from sluice.kernels.fused_moe import expert_blocks, fused_moe, fused_moe_ref
from sluice.kernels.quant import quantize_int8


def _operands(gen, t, e, top_k, h, i, dtype):
    x = torch.randn(t, h, generator=gen, device=DEVICE).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=gen, device=DEVICE) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen, device=DEVICE) * i**-0.5).to(dtype)
    logits = torch.randn(t, e, generator=gen, device=DEVICE)
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return x, w13, w2, weights.to(dtype), ids


def _per_token(x, w13, w2, weights, ids):
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (w13[e].float() @ x[t].float()).chunk(2)
            out[t] += w * (w2[e].float() @ (F.silu(gate) * up))
    return out


def test_reference_matches_a_per_token_loop(gen):
    x, w13, w2, weights, ids = _operands(gen, 7, 4, 2, 32, 24, torch.float32)
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, weights, ids), _per_token(x, w13, w2, weights, ids))


@pytest.mark.parametrize("t, e, top_k", [(1, 8, 2), (5, 4, 2), (37, 8, 3), (300, 4, 2)])
def test_expert_blocks_group_every_slot_once(gen, t, e, top_k):
    ids = torch.stack([torch.randperm(e, generator=gen, device=DEVICE)[:top_k] for _ in range(t)])
    ids[: t // 2] = ids[0]  # crowd one expert set: several blocks for them, none for others
    b = expert_blocks(ids, e, 16)
    slots = b.sorted_slots[: int(b.num_padded)].view(-1, 16)
    real = slots < t * top_k
    assert sorted(slots[real].tolist()) == list(range(t * top_k))
    assert (b.sorted_slots[int(b.num_padded):] == t * top_k).all()
    for block, expert in zip(slots, b.block_experts.tolist()):
        filled = block[block < t * top_k].long()
        assert filled.numel() > 0  # no block is padding only
        assert (ids.flatten()[filled] == expert).all()


@pytest.mark.parametrize("t", [1, 6, 70])  # decode (thin blocks), a few tokens, a prefill's 64-row blocks
@pytest.mark.parametrize("h, i", [(64, 32), (48, 40)], ids=["even", "ragged_k"])
def test_fused_moe_matches_reference(gen, dot_dtype, t, h, i):
    x, w13, w2, weights, ids = _operands(gen, t, 8, 2, h, i, dot_dtype)
    assert_close(fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids))


@pytest.mark.parametrize("t", [3, 70])
def test_int8_experts_dequantized_in_kernel(gen, t):
    x, w13, w2, weights, ids = _operands(gen, t, 4, 2, 64, 32, torch.float32)
    (q13, s13), (q2, s2) = (quantize_int8(w.reshape(-1, w.shape[-1])) for w in (w13, w2))
    q13, s13, q2, s2 = q13.view(w13.shape), s13.view(w13.shape[:2]), q2.view(w2.shape), s2.view(w2.shape[:2])
    got = fused_moe(x, q13, q2, weights, ids, s13, s2)
    assert_close(got, fused_moe_ref(x, q13, q2, weights, ids, s13, s2))
    dequantized = fused_moe_ref(x, q13.float() * s13[..., None], q2.float() * s2[..., None], weights, ids)
    assert_close(got, dequantized)
