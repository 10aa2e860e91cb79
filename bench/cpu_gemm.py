"""sluice's CPU GEMM (kernels/cpu_gemm.py) against oneDNN's packed GEMM, the engine's other CPU path, on the bench
Llama's projection shapes, in bfloat16 (and float32 where sluice's kernel takes it).

Each shape runs as a decode step runs it: the weights of 8 layers (one packed copy per GEMM and layer), taken in
turn, so every call reads a weight that is not in cache; the rows are a step's tokens (1-64 a decode step, 2048 a
prefill chunk). gate_up is timed as the engine runs it: sluice's with SiLU fused (its [M, 2I] output never written),
oneDNN's followed by the SiLU kernel. Prints GFLOP/s of each and sluice/oneDNN per shape and row count, fastest of
--repeat interleaved runs.

Run: python bench/cpu_gemm.py [--repeat 3] [--rows 1,4,8,16,32,64,2048] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import time

# sluice first: it sets OpenMP's spin before torch loads
# isort: off
import sluice  # noqa: F401
import torch
# isort: on

from sluice.kernels import cpu_gemm, cpu_layers
from sluice.worker.engine.linear import PACK_ROWS, _onednn_linear

# the bench Llama's projections: (out_features, in_features, gated)
SHAPES = {"qkv": (1536, 1024, False), "o": (1024, 1024, False), "gate_up": (5632, 1024, True),
          "down": (1024, 2816, False)}
LAYERS = 8


def onednn():
    def pack(w: torch.Tensor, gated: bool):
        return torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS), gated

    def run(x: torch.Tensor, packed) -> torch.Tensor:
        w, gated = packed
        y = _onednn_linear(x, w, None)  # as the engine calls it: rows bucketed
        return cpu_layers.silu_and_mul(y) if gated else y
    return pack, run


def sluice_gemm():
    def pack(w: torch.Tensor, gated: bool):
        return cpu_gemm.pack(w, None, gated)

    def run(x: torch.Tensor, packed) -> torch.Tensor:
        return (cpu_gemm.linear_silu_and_mul if packed.gated else cpu_gemm.linear)(x, packed)
    return pack, run


def time_shape(run, weights: list, x: torch.Tensor, calls: int) -> float:
    for w in weights:  # warm: every primitive built
        run(x, w)
    start = time.perf_counter()
    for i in range(calls):
        run(x, weights[i % len(weights)])
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rows", default="1,4,8,16,32,64,2048")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"threads {torch.get_num_threads()}; sluice's GEMM built for {[str(d) for d in cpu_gemm.dtypes()]}")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        if dtype not in cpu_gemm.dtypes():
            print(f"{name}: sluice's GEMM was not built for it on this CPU; skipped")
            continue
        engines = {"onednn": onednn(), "sluice": sluice_gemm()}
        gen = torch.Generator().manual_seed(0)
        raw = {s: [(torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype) for _ in range(LAYERS)]
               for s, (n, k, _) in SHAPES.items()}
        packed = {e: {s: [pack(w, SHAPES[s][2]) for w in ws] for s, ws in raw.items()}
                  for e, (pack, _) in engines.items()}
        print(f"\n{name}: GFLOP/s (fastest of {args.repeat}), sluice/oneDNN")
        print(f"{'shape':8s} {'rows':>5s} {'oneDNN':>8s} {'sluice':>8s} {'ratio':>6s}")
        for shape, (n, k, _) in SHAPES.items():
            for rows in rows_list:
                x = torch.randn(rows, k, generator=gen).to(dtype)
                flops = 2 * rows * n * k
                calls = max(LAYERS, min(200, int(2e10 / flops)))
                best = {e: float("inf") for e in engines}
                for r in range(args.repeat):
                    for e in (engines if r % 2 == 0 else list(engines)[::-1]):
                        best[e] = min(best[e], time_shape(engines[e][1], packed[e][shape], x, calls))
                rate = {e: flops / t / 1e9 for e, t in best.items()}
                print(f"{shape:8s} {rows:5d} {rate['onednn']:8.0f} {rate['sluice']:8.0f} "
                      f"{rate['sluice'] / rate['onednn']:6.2f}", flush=True)


if __name__ == "__main__":
    main()
