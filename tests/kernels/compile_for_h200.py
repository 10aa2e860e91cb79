"""Compiles the kernels' launch specializations for an H200 (sm_90) without a GPU, down to ptxas.

The interpreter checks numerics but not what only the compiler sees (types of loop-carried values, tl.dot
shapes and dtypes, shared memory). Run without TRITON_INTERPRET; test_compile_h200.py does.
"""

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from sluice.kernels.decode_attention import _decode_partial_kernel, _decode_reduce_kernel
from sluice.kernels.kv_store import _store_kv_kernel
from sluice.kernels.prefill_attention import _prefill_kernel
from sluice.kernels.w4a16 import _w4a16_kernel
from sluice.kernels.w8a16 import _w8a16_kernel, tiles_for

H200 = GPUTarget("cuda", 90, 32)
H200_SHARED_MEMORY = 232448  # bytes one program may use on sm_90 (227 KiB)
HEAD_DIM = 128  # Llama-family head size; the group of 4 query heads per KV head is Llama-3-8B's


def _specializations():
    """(kernel, pointer/float arg types, constexprs, num_warps, num_stages) as the launchers would pass them."""
    for dt in ("fp16", "bf16"):
        for cache in (dt, "i8"):
            paged = dict(k_cache_ptr=f"*{cache}", v_cache_ptr=f"*{cache}", k_scale_ptr="*fp32", v_scale_ptr="*fp32",
                         block_tables_ptr="*i32", context_lens_ptr="*i32", q_ptr=f"*{dt}", out_ptr=f"*{dt}",
                         qk_scale="fp32")
            yield (_store_kv_kernel, dict(paged, k_ptr=f"*{dt}", v_ptr=f"*{dt}", slot_ptr="*i64"),
                   dict(BLOCK_SIZE=16, NUM_HEADS=8, HEAD_DIM=HEAD_DIM, HEADS_PAD=8, DIM_PAD=HEAD_DIM,
                        QUANTIZE=cache == "i8"), 4, 2)
            for split in (False, True):
                yield (_decode_partial_kernel, dict(paged, part_out_ptr="*fp32", part_lse_ptr="*fp32"),
                       dict(BLOCK_SIZE=16, GROUP=4, GROUP_PAD=16, HEAD_DIM=HEAD_DIM, DIM_PAD=HEAD_DIM, BLOCK_N=64,
                            INT8_KV=cache == "i8", SPLIT=split, DOT_PRECISION=None), 4, 2)
            yield (_prefill_kernel, dict(paged, cu_seqlens_ptr="*i32"),
                   dict(BLOCK_SIZE=16, GROUP=4, HEAD_DIM=HEAD_DIM, DIM_PAD=HEAD_DIM, BLOCK_M=64, BLOCK_N=64,
                        INT8_KV=cache == "i8", DOT_PRECISION=None), 4, 2)
        partials = dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", context_lens_ptr="*i32", out_ptr=f"*{dt}")
        yield _decode_reduce_kernel, partials, dict(HEAD_DIM=HEAD_DIM, DIM_PAD=HEAD_DIM, SPLITS_PAD=8), 4, 2
        for m in (1, 20, 40, 512):
            t = tiles_for(m)
            yield (_w8a16_kernel, dict(x_ptr=f"*{dt}", w_ptr="*i8", scale_ptr=f"*{dt}", out_ptr=f"*{dt}"),
                   dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, EVEN_K=True, DOT_PRECISION=None),
                   t.num_warps, t.num_stages)
            yield (_w4a16_kernel,
                   dict(x_ptr=f"*{dt}", w_ptr="*u8", scales_ptr=f"*{dt}", zeros_ptr=f"*{dt}", out_ptr=f"*{dt}"),
                   dict(GROUP_SIZE=128, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=min(t.block_k, 128),
                        DOT_PRECISION=None), t.num_warps, t.num_stages)
    # float32 models take exact ("ieee") dots; one matmul shows that path compiles.
    yield (_w8a16_kernel, dict(x_ptr="*fp32", w_ptr="*i8", scale_ptr="*fp32", out_ptr="*fp32"),
           dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, EVEN_K=False, DOT_PRECISION="ieee"), 4, 4)


def main() -> None:
    for kernel, types, constexprs, num_warps, num_stages in _specializations():
        signature = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in kernel.arg_names}
        compiled = compile(ASTSource(kernel, signature, constexprs), target=H200,
                           options=dict(num_warps=num_warps, num_stages=num_stages))
        print(f"{kernel.__name__} {constexprs}: {compiled.metadata.shared} bytes of shared memory")
        if compiled.metadata.shared > H200_SHARED_MEMORY:
            raise SystemExit(f"{kernel.__name__} {constexprs} needs more shared memory than an H200 has")


if __name__ == "__main__":
    main()
