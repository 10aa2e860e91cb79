"""Peak memory and load time of loading the bench Llama in float32, INT8 and INT4 (quantized as it loads).

Each load runs in a fresh process that first loads the demo model (imports, kernels and PyTorch's one-time costs
paid), so the peak above its resident memory then is the load's own. Host memory is that process's VmRSS before
and VmHWM after (not ru_maxrss, which a child inherits from its parent); on CUDA also the device's peak allocation.
The bound is the final weights plus the largest float tensor of the checkpoint; ratios are against float32 in the
same run.
Run: python bench/load_memory.py [--device cpu|cuda] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model  # noqa: E402

from sluice.worker.engine.demo import demo_model_dir  # noqa: E402

CONFIGS = {"float32": {}, "int8": {"quantization": "int8"}, "int4 g128": {"quantization": "int4"}}
MEASURE = """
import gc, json, sys, time
from sluice.worker.engine import LLM
import torch

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(field + ":"))

demo, path, device, kwargs = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
warm = LLM(demo, device=device, num_kv_blocks=16, quantization="int4", quantization_group_size=32)
del warm
gc.collect()
cuda = device == "cuda"
if cuda:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    device_before = torch.cuda.memory_allocated()
before = status("VmRSS")
start = time.perf_counter()
llm = LLM(path, device=device, num_kv_blocks=16, **kwargs)
seconds = time.perf_counter() - start
print(json.dumps({"host_peak": status("VmHWM") - before, "seconds": seconds,
                  "weight_bytes": llm.stats()["weight_bytes"],
                  "device_peak": torch.cuda.max_memory_allocated() - device_before if cuda else None}))
"""


def measure(path: Path, device: str, kwargs: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, str(demo_model_dir()), str(path), device, json.dumps(kwargs)],
                         capture_output=True, text=True, cwd="/")  # not the repository root: its kernels/ shadows
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def largest_tensor_bytes(path: Path) -> int:
    sizes = {"F32": 4, "F16": 2, "BF16": 2}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return max(math.prod(f.get_slice(n).get_shape()) * sizes[f.get_slice(n).get_dtype()] for n in f.keys())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--repeat", type=int, default=1, help="loads per configuration; the fastest counts")
    args = ap.parse_args()
    path = bench_model()
    largest = largest_tensor_bytes(path)
    rows = {}
    for name, kwargs in CONFIGS.items():
        runs = [measure(path, args.device, kwargs) for _ in range(args.repeat)]
        rows[name] = {**min(runs, key=lambda r: r["seconds"]), "host_peak": max(r["host_peak"] for r in runs)}
    base = rows["float32"]
    mib = 1 << 20
    print(f"bench Llama on {args.device}; largest float tensor {largest / mib:.1f} MiB")
    print(f"{'weights':<10} {'final MiB':>9} {'host peak':>9} {'bound':>7} {'peak/bound':>10} {'vs fp32':>7} "
          f"{'device peak':>11} {'load s':>7} {'vs fp32':>7}")
    for name, r in rows.items():
        bound = r["weight_bytes"] + largest
        device = f"{r['device_peak'] / mib:9.1f}" if r["device_peak"] is not None else f"{'-':>9}"
        print(f"{name:<10} {r['weight_bytes'] / mib:9.1f} {r['host_peak'] / mib:9.1f} {bound / mib:7.1f} "
              f"{r['host_peak'] / bound:10.2f} {r['host_peak'] / base['host_peak']:7.2f} {device:>11} "
              f"{r['seconds']:7.2f} {r['seconds'] / base['seconds']:7.2f}")


if __name__ == "__main__":
    main()
