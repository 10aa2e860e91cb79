"""GPU check: every Triton kernel against its PyTorch reference at realistic sizes, timed against the copy
bandwidth measured in the same run, then the engine end to end on a random Llama-3-8B-shaped model.

Needs a CUDA GPU (finishes in about 5 minutes on an H200). `--smoke` runs the same code at toy sizes on the CPU
under Triton's interpreter (timings meaningless) so the script itself is tested without a GPU.
Run, with sluice installed (on a host whose torch is already there and no index is reachable:
`pip install --no-deps --no-build-isolation -e .`): python bench/gpu_check.py [--smoke] [--skip-engine]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192)
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=256, vocab_size=512, max_position_embeddings=512)
BANDWIDTH_TARGET = 0.70  # decode attention and W4A16/W8A16 at M <= 16, of the measured copy bandwidth
ROOFLINE_TARGET = 0.50  # end-to-end bf16 decode at batch 256, of the weights-plus-KV bandwidth roofline


@dataclass
class Sizes:
    dtype: torch.dtype
    kv_heads: int
    heads: int
    head_dim: int
    block_size: int
    decode_seqs: int
    decode_context: int
    prefill_seqs: int
    prefill_new: int
    prefill_cached: int
    mlp: tuple[int, int]
    ms: tuple[int, ...]
    copy_bytes: int
    engine_batches: tuple[int, ...]
    engine_prompt: int
    engine_steps: int
    shape: dict


REAL = Sizes(torch.bfloat16, 8, 32, 128, 16, 64, 4096, 4, 1024, 1024, (14336, 4096), (1, 4, 16, 64, 256, 2048),
             1 << 30, (1, 64, 256), 256, 32, LLAMA3_8B)
SMOKE = Sizes(torch.float32, 2, 8, 32, 16, 3, 70, 2, 20, 13, (96, 64), (1, 3, 17), 1 << 20, (1, 4), 8, 2, TINY)


def timer(smoke: bool):
    """Milliseconds per call: triton's do_bench on the GPU; one plain call under the interpreter."""
    if not smoke:
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100)

    def once(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return once


def copy_bandwidth(s: Sizes, device, bench) -> float:
    src = torch.empty(s.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * s.copy_bytes / (bench(lambda: dst.copy_(src)) * 1e-3)  # read + write


def close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    err = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()
    ok = bool(torch.isfinite(got).all()) and err <= tol
    print(f"  {name:48s} rel err {err:.2e} {'ok' if ok else 'MISMATCH'}")
    return ok


def paged_cache(s: Sizes, context_lens: list[int], device, int8: bool):
    """A KV cache holding random contexts in shuffled blocks, with its block table."""
    from sluice.kernels.quant import quantize_kv_int8

    blocks_per_seq = [-(-n // s.block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 8
    perm = torch.randperm(num_blocks, device=device)
    width = max(blocks_per_seq)
    table = torch.zeros(len(context_lens), width, dtype=torch.int32, device=device)
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        table[i, :nb] = perm[used:used + nb]
        used += nb
    shape = (num_blocks, s.block_size, s.kv_heads, s.head_dim)
    k, v = torch.randn(shape, device=device, dtype=s.dtype), torch.randn(shape, device=device, dtype=s.dtype)
    if not int8:
        return k, v, None, None, table
    (kq, ks), (vq, vs) = quantize_kv_int8(k), quantize_kv_int8(v)
    return kq, vq, ks, vs, table


def check_kernels(s: Sizes, device, bench, bandwidth: float) -> tuple[list[bool | None], bool]:
    """Checks and times each kernel, printing its row as soon as it is measured (a run cut short keeps them);
    returns whether each met its bandwidth target (True/False, or None when not bandwidth-bound) and whether every
    kernel matched its reference."""
    checks = [(functools.partial(check, int8=int8), f"{check.__name__} int8={int8}")
              for int8 in (False, True) for check in (check_store, check_decode, check_prefill)]
    checks += [(functools.partial(check_matmul, m=m, int4=int4), f"check_matmul M={m} int4={int4}")
               for m in s.ms for int4 in (False, True)]
    print(f"{'kernel':70s} {'ms':>9s} {'GB/s':>8s} {'of copy':>8s} target")
    targets: list[bool | None] = []
    ok = True
    for check, name in checks:
        try:
            (label, ms, gbs, met), good = check(s, device, bench, bandwidth)
        except Exception:  # one GPU run may be all there is: a failing check must not lose the others' figures
            traceback.print_exc()
            (label, ms, gbs, met), good = (f"{name} ERROR", float("nan"), 0.0, None), False
        target = "" if met is None else ("PASS" if met else "FAIL")
        print(f"{label:70s} {ms:9.3f} {gbs:8.0f} {gbs / (bandwidth / 1e9):8.0%} {target}")
        targets.append(met)
        ok &= good
    return targets, ok


def tolerance(s: Sizes) -> float:
    return 2e-2 if s.dtype != torch.float32 else 1e-4


def check_store(s: Sizes, device, bench, bandwidth: float, int8: bool):
    from sluice.kernels.kv_store import store_kv, store_kv_ref

    tag = " int8 KV" if int8 else ""
    tokens = s.decode_seqs * 16
    k, v, ks, vs, _ = paged_cache(s, [tokens], device, int8)
    new_k = torch.randn(tokens, s.kv_heads, s.head_dim, device=device, dtype=s.dtype)
    new_v = torch.randn_like(new_k)
    slots = torch.randperm(k.shape[0] * s.block_size, device=device)[:tokens]
    ref = [t.clone() if t is not None else None for t in (k, v, ks, vs)]
    store_kv(new_k, new_v, k, v, slots, ks, vs)
    store_kv_ref(new_k, new_v, *ref[:2], slots, *ref[2:])
    ok = True
    for part, got, want in zip(("K", "V", "K scale", "V scale"), (k, v, ks, vs), ref):
        if got is not None:
            ok &= close(f"store_kv{tag} {part}", got.float(), want.float(), 0)
    ms = bench(lambda: store_kv(new_k, new_v, k, v, slots, ks, vs))
    moved = 2 * new_k.numel() * (new_k.element_size() + (1 if int8 else new_k.element_size()))
    return (f"store_kv {tokens} tokens{tag}", ms, moved / ms / 1e6, None), ok


def check_decode(s: Sizes, device, bench, bandwidth: float, int8: bool):
    """Decode attention over long contexts: the bandwidth-bound kernel."""
    from sluice.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref

    tag = " int8 KV" if int8 else ""
    step = s.decode_context // (2 * s.decode_seqs)
    lens = [s.decode_context - i * step for i in range(s.decode_seqs)]
    k, v, ks, vs, table = paged_cache(s, lens, device, int8)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), s.heads, s.head_dim, device=device, dtype=s.dtype)
    out = torch.full_like(q, float("nan"))
    scale = s.head_dim ** -0.5
    paged_decode_attention(q, k, v, table, ctx, scale, ks, vs, out=out)
    want = paged_decode_attention_ref(q, k, v, table, ctx, scale, ks, vs)
    ok = close(f"decode attention{tag}", out, want, tolerance(s))
    ms = bench(lambda: paged_decode_attention(q, k, v, table, ctx, scale, ks, vs, out=out))
    per_token = 2 * s.kv_heads * (s.head_dim + 4 if int8 else s.head_dim * k.element_size())
    gbs = sum(lens) * per_token / ms / 1e6
    label = f"decode attention {len(lens)} seqs x ~{s.decode_context}{tag}"
    return (label, ms, gbs, gbs >= BANDWIDTH_TARGET * bandwidth / 1e9), ok


def check_prefill(s: Sizes, device, bench, bandwidth: float, int8: bool):
    """Prefill over a cached prefix, as prefix caching and chunked prefill run it."""
    from sluice.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

    tag = " int8 KV" if int8 else ""
    lens = [s.prefill_cached + s.prefill_new] * s.prefill_seqs
    k, v, ks, vs, table = paged_cache(s, lens, device, int8)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    cu = torch.arange(0, (s.prefill_seqs + 1) * s.prefill_new, s.prefill_new, dtype=torch.int32, device=device)
    q = torch.randn(s.prefill_seqs * s.prefill_new, s.heads, s.head_dim, device=device, dtype=s.dtype)
    out = torch.full_like(q, float("nan"))
    scale = s.head_dim ** -0.5
    paged_prefill_attention(q, k, v, table, cu, ctx, scale, ks, vs, out=out)
    want = paged_prefill_attention_ref(q, k, v, table, cu, ctx, scale, ks, vs)
    ok = close(f"prefill attention{tag}", out, want, tolerance(s))
    ms = bench(lambda: paged_prefill_attention(q, k, v, table, cu, ctx, scale, ks, vs, out=out))
    flops = 4 * s.heads * s.head_dim * s.prefill_seqs * s.prefill_new * (s.prefill_cached + s.prefill_new / 2)
    label = (f"prefill attention {s.prefill_seqs} x {s.prefill_new} new + {s.prefill_cached} cached{tag} "
             f"({flops / ms / 1e9:.0f} TFLOP/s)")
    return (label, ms, 0.0, None), ok


def check_matmul(s: Sizes, device, bench, bandwidth: float, m: int, int4: bool):
    from sluice.kernels.quant import quantize_int4, quantize_int8
    from sluice.kernels.w4a16 import w4a16_matmul, w4a16_matmul_ref
    from sluice.kernels.w8a16 import w8a16_matmul, w8a16_matmul_ref

    n, kdim = s.mlp
    torch.manual_seed(n)
    w = torch.randn(n, kdim, device=device, dtype=s.dtype) * 0.02
    x = torch.randn(m, kdim, device=device, dtype=s.dtype)
    if int4:
        group = 128 if kdim % 128 == 0 else 32
        q, scales, zeros = quantize_int4(w, group)
        args, fn, ref, name = (x, q, scales, zeros, group), w4a16_matmul, w4a16_matmul_ref, "W4A16"
        nbytes = q.numel() + 2 * scales.numel() * scales.element_size()
    else:
        q, scale = quantize_int8(w)
        args, fn, ref, name = (x, q, scale), w8a16_matmul, w8a16_matmul_ref, "W8A16"
        nbytes = q.numel() + scale.numel() * scale.element_size()
    ok = close(f"{name} M={m} N={n} K={kdim}", fn(*args), ref(*args), tolerance(s))
    ms = bench(lambda: fn(*args))
    gbs = (nbytes + (x.numel() + m * n) * x.element_size()) / ms / 1e6
    label = f"{name} M={m} ({2 * m * n * kdim / ms / 1e9:.0f} TFLOP/s)"
    return (label, ms, gbs, gbs >= BANDWIDTH_TARGET * bandwidth / 1e9 if m <= 16 else None), ok


def model_dir(shape: dict) -> Path:
    """config.json and a tokenizer only: the engine fills the weights randomly (load_format='dummy')."""
    from sluice.worker.engine.demo import train_tokenizer

    path = Path(tempfile.mkdtemp(prefix="sluice-gpu-check-"))
    train_tokenizer(path)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "torch_dtype": "bfloat16", "eos_token_id": 1, **shape}
    (path / "config.json").write_text(json.dumps(config))
    return path


def engine_run(s: Sizes, path: Path, device: str, bandwidth: float, smoke: bool) -> tuple[bool, bool]:
    """Prints decode tokens/s per weight format and batch as each is measured; returns (every run finished, the
    bf16 target was met)."""
    from sluice.worker.engine import LLM

    print(f"engine, random {'Llama-3-8B' if not smoke else 'toy'}-shaped model, decode output tokens/s:")
    print(f"{'weights':8s} {'GiB':>6s} {'batch':>6s} {'tok/s':>10s} {'of roofline':>12s}")
    ran, met = True, False
    extra = dict(attention_backend="triton", linear_backend="triton") if smoke else {}
    for label, quant in (("bf16", {}), ("int8", dict(quantization="int8")), ("int4", dict(quantization="int4"))):
        llm = None
        try:
            start = time.perf_counter()
            llm = LLM(str(path), load_format="dummy", dtype="float32" if smoke else "bfloat16", device=device,
                      max_num_seqs=max(s.engine_batches), max_num_batched_tokens=8192,
                      kv_cache_memory=(8 << 20) if smoke else (24 << 30), **quant, **extra)
            weight_bytes = llm.stats()["weight_bytes"]
            print(f"{label:8s} {weight_bytes / 2**30:6.2f} built in {time.perf_counter() - start:.0f} s")
            for batch in s.engine_batches:
                rate, kv_bytes = decode_rate(llm, batch, s, device)
                roofline = batch * bandwidth / (weight_bytes - unread_embedding_bytes(llm) + kv_bytes)
                mark = ""
                if label == "bf16" and batch == max(s.engine_batches):
                    met = rate >= ROOFLINE_TARGET * roofline
                    mark = "PASS" if met else "FAIL"
                print(f"{label:8s} {weight_bytes / 2**30:6.2f} {batch:6d} {rate:10.1f} {rate / roofline:12.0%} {mark}")
        except Exception:  # as in check_kernels: the other formats still run
            traceback.print_exc()
            ran = False
        del llm
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return ran, met


def unread_embedding_bytes(llm) -> int:
    """The embedding table, counted in the weights but not read by a decode step (it gathers one row per sequence),
    unless the lm_head shares it (Llama-3-8B's does not: 1 GiB of its 15 GiB)."""
    model = llm.runner.model
    table = model.model.embed_tokens.weight
    return 0 if getattr(model.lm_head, "weight", None) is table else table.numel() * table.element_size()


def decode_rate(llm, batch: int, s: Sizes, device: str) -> tuple[float, float]:
    """Decode tokens/s of `batch` sequences after their prefill, and the KV bytes one decode step reads."""
    from sluice.worker.engine import SamplingParams

    # A large batch prefills over several steps, in which its first sequences already decode: with a fixed small
    # max_tokens they finished inside the timed steps (batch 256 of REAL fell to 101 sequences). Nothing finishes
    # here; the sequences are aborted once timed.
    params = SamplingParams(max_tokens=llm.max_request_tokens - s.engine_prompt, temperature=0, ignore_eos=True)
    for i in range(batch):
        llm.add_request([3 + (i * 31 + j) % 500 for j in range(s.engine_prompt)], params, f"b{batch}-{i}")
    while any(q.num_remaining > 1 for q in llm.scheduler.running) or llm.scheduler.num_waiting:
        llm.step()
    for _ in range(3):
        llm.step()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    context = sum(q.num_tokens for q in llm.scheduler.running)
    generated = 0
    start = time.perf_counter()
    for _ in range(s.engine_steps):
        llm.step()
        generated += llm.last_step.num_generated
    sync()
    rate = generated / (time.perf_counter() - start)
    for request_id in list(llm.requests):
        llm.abort(request_id)
    kv_per_token = llm.runner.bytes_per_block() / llm.block_manager.block_size
    return rate, (context + batch * s.engine_steps / 2) * kv_per_token


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU under Triton's interpreter")
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # a run killed at its time limit keeps every line it printed
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False). This script measures the "
              "Triton kernels and the engine on a GPU; use --smoke to exercise it on the CPU.", file=sys.stderr)
        return 2
    s, device = (SMOKE, "cpu") if args.smoke else (REAL, "cuda")
    torch.manual_seed(0)
    bench = timer(args.smoke)
    name = "CPU (interpreter)" if args.smoke else torch.cuda.get_device_name()
    bandwidth = copy_bandwidth(s, device, bench)
    print(f"device: {name}; copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write, measured now)")
    start = time.perf_counter()
    targets, ok = check_kernels(s, device, bench, bandwidth)
    print(f"kernels checked in {time.perf_counter() - start:.0f} s")
    passed = ok and all(met is not False for met in targets)
    if not args.skip_engine:
        ran, met = engine_run(s, model_dir(s.shape), device, bandwidth, args.smoke)
        ok &= ran
        passed &= ran and (met or args.smoke)
    if args.smoke:
        print("smoke run: numbers above are not performance figures")
        return 0 if ok else 1
    print("ALL TARGETS MET" if passed else "SOME TARGETS MISSED")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
