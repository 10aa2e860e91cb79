"""Loading in bounded memory: the bench-sized Llama (bench/common.py's BENCH_SHAPE, 91M parameters, 394 MB in
float32) loaded with INT4 on CPU peaks at its final weights plus its largest float tensor plus a small margin, where
loading the float model and quantizing it afterwards peaked above the float model's 376 MiB."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from safetensors import safe_open

from sluice.worker.engine.demo import build_checkpoint

BENCH_SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                   intermediate_size=2816, vocab_size=4096, max_position_embeddings=2048)
MARGIN = 24 << 20  # measured: 6 MiB over weights + largest tensor (rotary tables, KV cache, quantization scratch)

# A fresh process: the one-time costs (imports, the C++ kernels, PyTorch's meta-device registrations) paid on a tiny
# model first, then resident memory measured around loading the big one. The peak is VmHWM, this process's own: the
# ru_maxrss of a child starts at its parent's (Linux keeps the larger across fork and exec), pytest's here.
MEASURE = """
import gc, json, sys
from sluice.worker.engine import LLM

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(field + ":"))

warm = LLM(sys.argv[1], num_kv_blocks=16, quantization="int4", quantization_group_size=32)
del warm
gc.collect()
before = status("VmRSS")
llm = LLM(sys.argv[2], num_kv_blocks=16, **json.loads(sys.argv[3]))
print(json.dumps({"before": before, "after": status("VmRSS"), "peak": status("VmHWM"),
                  "weight_bytes": llm.stats()["weight_bytes"]}))
"""


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory, tokenizer_dir):
    return build_checkpoint(tmp_path_factory.mktemp("bench"), "LlamaForCausalLM", seed=0, tokenizer_dir=tokenizer_dir,
                            **BENCH_SHAPE)


def load_measured(small: str, path: str, **kwargs) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, small, path, json.dumps(kwargs)], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def largest_tensor_bytes(path) -> int:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return max(math.prod(f.get_slice(name).get_shape()) * 4 for name in f.keys())  # a float32 checkpoint


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_int4_load_peaks_at_its_weights_plus_one_float_tensor(bench_dir, llama_dir):
    m = load_measured(str(llama_dir), str(bench_dir), quantization="int4")
    assert m["after"] - m["before"] >= 0.9 * m["weight_bytes"]  # the weights are resident: the peak saw them
    bound = m["weight_bytes"] + largest_tensor_bytes(bench_dir) + MARGIN
    assert m["peak"] - m["before"] <= bound, {k: v >> 20 for k, v in m.items()}
