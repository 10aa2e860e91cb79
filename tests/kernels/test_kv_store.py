"""store_kv against its reference: scattered and skipped slots, strided inputs, float and INT8 caches."""

import pytest
import torch
from kernel_test_utils import DEVICE, strided_copy

from sluice.kernels.kv_store import store_kv, store_kv_ref
from sluice.kernels.quant import dequantize_kv_int8

UNWRITTEN_INT8 = -128  # quantization never produces it, so an unwritten slot shows


def _caches(num_blocks, block_size, num_heads, head_dim, dtype, int8):
    shape = (num_blocks, block_size, num_heads, head_dim)
    if not int8:
        return [torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(2)] + [None, None]
    caches = [torch.full(shape, UNWRITTEN_INT8, dtype=torch.int8, device=DEVICE) for _ in range(2)]
    return caches + [torch.full(shape[:3], float("nan"), device=DEVICE) for _ in range(2)]


def _run_both(k, v, slots, num_blocks, block_size, dtype, int8):
    """Runs kernel and reference on identical NaN/sentinel-filled caches and checks they match bit for bit."""
    kernel_out = _caches(num_blocks, block_size, k.shape[1], k.shape[2], dtype, int8)
    ref_out = _caches(num_blocks, block_size, k.shape[1], k.shape[2], dtype, int8)
    store_kv(k, v, *kernel_out[:2], slots, *kernel_out[2:])
    store_kv_ref(k, v, *ref_out[:2], slots, *ref_out[2:])
    for got, want in zip(kernel_out, ref_out):
        if want is not None:
            torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)
    return kernel_out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("int8", [False, True], ids=["float_cache", "int8_cache"])
@pytest.mark.parametrize("num_heads, head_dim, block_size", [(2, 16, 16), (3, 24, 5)])
def test_store_kv_matches_reference(gen, dtype, int8, num_heads, head_dim, block_size):
    num_blocks, num_tokens = 6, 11
    k = (torch.randn(num_tokens, num_heads, head_dim, generator=gen, device=DEVICE) * 4).to(dtype)
    v = torch.randn(num_tokens, num_heads, head_dim, generator=gen, device=DEVICE).to(dtype)
    k[3, 0] = 0  # a zero head: scale guard
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens are skipped
    k_cache, v_cache, k_scale, v_scale = _run_both(k, v, slots, num_blocks, block_size, dtype, int8)

    written = slots[slots >= 0]
    pages, offsets = written // block_size, written % block_size
    stored_k = k_cache[pages, offsets]
    if int8:  # also against the inputs: half a quantization step per element
        want = k[slots >= 0].float()
        got = dequantize_kv_int8(stored_k, k_scale[pages, offsets], torch.float32)
        assert ((got - want).abs() <= k_scale[pages, offsets, :, None] / 2 + 1e-6 * want.abs()).all()
    else:
        assert torch.equal(stored_k, k[slots >= 0])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    rest = v_cache.flatten(0, 1)[untouched]
    assert (rest == UNWRITTEN_INT8).all() if int8 else rest.float().isnan().all()


@pytest.mark.parametrize("int8", [False, True], ids=["float_cache", "int8_cache"])
def test_store_kv_strided_inputs(gen, int8):
    """k and v as views into a fused qkv projection output, as the engine produces them."""
    num_tokens, num_heads, num_kv_heads, head_dim = 7, 4, 2, 16
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen, device=DEVICE)
    _, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    k, v = k.view(num_tokens, num_kv_heads, head_dim), v.view(num_tokens, num_kv_heads, head_dim)
    assert not k.is_contiguous()
    slots = torch.tensor([3, 4, 5, 30, 31, 0, -1], dtype=torch.int32, device=DEVICE)  # int32 slots work too
    _run_both(k, v, slots, 4, 8, torch.float32, int8)


@pytest.mark.parametrize("int8", [False, True], ids=["float_cache", "int8_cache"])
def test_store_kv_strided_slot_mapping(gen, int8):
    """A strided slot_mapping is read by value (the kernel had read it as if packed, writing to the wrong slots)."""
    k = torch.randn(5, 2, 16, generator=gen, device=DEVICE)
    v = torch.randn(5, 2, 16, generator=gen, device=DEVICE)
    slots = strided_copy(torch.tensor([3, 9, -1, 12, 1], device=DEVICE))
    assert not slots.is_contiguous()
    _run_both(k, v, slots, 4, 4, torch.float32, int8)


def test_store_kv_int8_needs_scales():
    k = torch.zeros(1, 1, 16, device=DEVICE)
    cache = torch.zeros(1, 4, 1, 16, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="k_scale"):
        store_kv(k, k, cache, cache.clone(), torch.zeros(1, dtype=torch.int64, device=DEVICE))
