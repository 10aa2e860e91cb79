"""`sluice plan` against figures computed by hand from published model shapes (config.json only, no weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.worker.cli import main
from sluice.worker.plan import parse_size

GiB = 1 << 30
# published config.json values (Hugging Face: meta-llama/Meta-Llama-3-8B, meta-llama/Llama-2-70b-hf, Qwen/Qwen2-7B)
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu",
             "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
LLAMA2_70B = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 8192,
              "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu",
              "tie_word_embeddings": False, "torch_dtype": "float16"}
QWEN2_7B = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584,
            "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
            "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 131072,
            "max_window_layers": 28, "torch_dtype": "bfloat16"}
CONFIGS = {"llama3-8b": LLAMA3_8B, "llama2-70b": LLAMA2_70B, "qwen2-7b": QWEN2_7B}

# Parameters by hand. Llama-3-8B, per layer: q and o 4096 x 4096 (16,777,216 each), k and v 1024 x 4096 (4,194,304
# each), gate, up and down 4096 x 14336 (58,720,256 each), two norms of 4096: 218,112,000; x 32 = 6,979,584,000;
# embeddings and lm_head 128256 x 4096 (525,336,576 each) and the final norm: 8,030,261,248 (the published 8.03B).
# Llama-2-70B, per layer: q, o 8192^2 (67,108,864), k, v 1024 x 8192 (8,388,608), MLP 3 x 8192 x 28672
# (704,643,072), norms 16,384: 855,654,400; x 80 + 2 x 32000 x 8192 + 8192 = 68,976,648,192.
# Qwen2-7B, per layer: q, o 3584^2 (12,845,056), k, v 512 x 3584 (1,835,008), q/k/v biases 4,608, MLP
# 3 x 3584 x 18944 (203,685,888), norms 7,168: 233,057,792; x 28 + 2 x 152064 x 3584 + 3584 = 7,615,616,512.
PARAMS = {"llama3-8b": 8_030_261_248, "llama2-70b": 68_976_648_192, "qwen2-7b": 7_615_616_512}
# Llama-3-8B in bfloat16 with INT8 projections: per layer 218,103,808 one-byte weights, a bfloat16 scale per output
# row (6144 + 4096 + 28672 + 4096 = 43,008 rows: 86,016 bytes), norms 16,384 bytes: 218,206,208; x 32 =
# 6,982,598,656; embeddings, lm_head and the final norm stay bfloat16: 2,101,354,496. Total 9,083,953,152.
# With INT4 (groups of 128): 109,051,904 bytes of nibbles, 1,703,936 groups x (scale + zero) x 2 bytes = 6,815,744,
# norms 16,384: 115,884,032 per layer; x 32 + 2,101,354,496 = 5,809,643,520.
# Llama-2-70B in float16 with INT4: per layer 427,819,008 + 6,684,672 groups x 4 bytes (26,738,688) + 32,768 =
# 454,590,464; x 80 + (524,288,000 + 8,192) x 2 = 37,415,829,504.
WEIGHTS = {
    ("llama3-8b", "bfloat16", None): 16_060_522_496,
    ("llama3-8b", "float16", None): 16_060_522_496,
    ("llama3-8b", "float32", None): 32_121_044_992,
    ("llama3-8b", "bfloat16", "int8"): 9_083_953_152,
    ("llama3-8b", "bfloat16", "int4"): 5_809_643_520,
    ("llama2-70b", "float16", None): 137_953_296_384,
    ("llama2-70b", "float16", "int4"): 37_415_829_504,
    ("qwen2-7b", "bfloat16", None): 15_231_233_024,
}
# KV bytes per token: 2 (K, V) x layers x KV heads x 128 x bytes per element; INT8 adds a 4-byte scale per head
KV_PER_TOKEN = {
    ("llama3-8b", "bfloat16", "auto"): 2 * 32 * 8 * 128 * 2,  # 131,072
    ("llama3-8b", "float32", "auto"): 2 * 32 * 8 * 128 * 4,  # 262,144
    ("llama3-8b", "bfloat16", "int8"): 2 * 32 * 8 * (128 + 4),  # 67,584
    ("llama2-70b", "float16", "auto"): 2 * 80 * 8 * 128 * 2,  # 327,680
    ("llama2-70b", "float16", "int8"): 2 * 80 * 8 * (128 + 4),  # 168,960
    ("qwen2-7b", "bfloat16", "auto"): 2 * 28 * 4 * 128 * 2,  # 57,344
}
# activation headroom: 4096 batched tokens x (2 x intermediate + vocab) x 4 bytes
ACTIVATIONS = {"llama3-8b": 4096 * (2 * 14336 + 128256) * 4, "llama2-70b": 4096 * (2 * 28672 + 32000) * 4,
               "qwen2-7b": 4096 * (2 * 18944 + 152064) * 4}


def shape(name: str) -> dict:
    c = CONFIGS[name]
    return dict(V=c["vocab_size"], H=c["hidden_size"], I=c["intermediate_size"], L=c["num_hidden_layers"],
                heads=c["num_attention_heads"], kv=c["num_key_value_heads"], bias=name.startswith("qwen2"))


def weight_bytes_by_hand(name: str, itemsize: int, quant: str | None, group: int = 128) -> int:
    """The formats spelled out: each projection [out, in] int8 (a scale per row) or int4 (two per byte, a scale and
    a zero per group of `group` inputs), scales in the model dtype; biases, norms, embeddings, lm_head unquantized."""
    s = shape(name)
    hd = s["H"] // s["heads"]
    projections = [(s["heads"] * hd + 2 * s["kv"] * hd, s["H"]), (s["H"], s["heads"] * hd), (2 * s["I"], s["H"]),
                   (s["H"], s["I"])]
    per_layer = 2 * s["H"] * itemsize + (s["heads"] * hd + 2 * s["kv"] * hd) * itemsize * s["bias"]
    for out, inp in projections:
        if quant is None:
            per_layer += out * inp * itemsize
        elif quant == "int8":
            per_layer += out * inp + out * itemsize
        else:
            per_layer += out * inp // 2 + 2 * out * (inp // group) * itemsize
    return s["L"] * per_layer + (2 * s["V"] * s["H"] + s["H"]) * itemsize


def kv_tokens_by_hand(memory: int, weights: int, activations: int, per_token: int, block_size: int = 16) -> int:
    """The engine's rule on CUDA: 90% of what weights and activations leave, in whole blocks."""
    budget = int((memory - weights - activations) * 0.9)
    return budget // (per_token * block_size) * block_size


@pytest.fixture
def model_dir(tmp_path):
    def write(name: str) -> Path:
        path = tmp_path / name
        path.mkdir(exist_ok=True)
        (path / "config.json").write_text(json.dumps(CONFIGS[name]))
        return path

    return write


def plan_json(capsys, *args: str) -> tuple[int, dict]:
    code = main(["plan", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_hand_formula_matches_published_parameter_counts():
    for name, params in PARAMS.items():
        assert weight_bytes_by_hand(name, 1, None) == params


@pytest.mark.parametrize("name,dtype,quant", list(WEIGHTS))
def test_weight_bytes(capsys, model_dir, name, dtype, quant):
    flags = ["--dtype", dtype] + (["--quantization", quant] if quant else [])
    _, plan = plan_json(capsys, "--model", str(model_dir(name)), "--gpu-memory", "1TiB", *flags)
    assert plan["weight_bytes"] == WEIGHTS[name, dtype, quant]
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    assert plan["weight_bytes"] == weight_bytes_by_hand(name, itemsize, quant)
    assert plan["dtype"] == dtype and plan["quantization"] == quant


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("quant", [None, "int8", "int4"])
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_every_dtype_and_quantization(capsys, model_dir, name, dtype, quant, kv):
    """Weights, KV per token, activations, KV tokens and sequences at a workload, each against the hand rules."""
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    flags = ["--dtype", dtype, "--kv-cache-dtype", kv, "--prompt-tokens", "1000", "--output-tokens", "500"]
    flags += ["--quantization", quant] if quant else []
    code, plan = plan_json(capsys, "--model", str(model_dir(name)), "--gpu-memory", "320GiB", *flags)
    s = shape(name)
    per_token = 2 * s["L"] * s["kv"] * (128 + 4 if kv == "int8" else 128 * itemsize)
    weights = weight_bytes_by_hand(name, itemsize, quant)
    tokens = kv_tokens_by_hand(320 * GiB, weights, ACTIVATIONS[name], per_token)
    assert (code, plan["fits"]) == (0, True)
    assert plan["weight_bytes"] == weights
    assert plan["kv_cache_bytes_per_token"] == per_token
    assert plan["activation_bytes"] == ACTIVATIONS[name]
    assert plan["kv_cache_tokens"] == tokens
    assert plan["max_concurrent_sequences"] == tokens // 16 // 94  # 1500 tokens: 94 blocks of 16
    assert plan["recommended_max_num_seqs"] == min(tokens // 16 // 94, 256)


def test_kv_bytes_per_token(capsys, model_dir):
    for (name, dtype, kv), expected in KV_PER_TOKEN.items():
        _, plan = plan_json(capsys, "--model", str(model_dir(name)), "--gpu-memory", "1TiB", "--dtype", dtype,
                            "--kv-cache-dtype", kv)
        assert plan["kv_cache_bytes_per_token"] == expected, (name, dtype, kv)


def test_llama3_8b_on_80gib(capsys, model_dir):
    """80 GiB - 16,060,522,496 of weights - 2,571,108,352 of activations = 67,267,715,072; x 0.9 =
    60,540,943,564; / 2,097,152 bytes per block = 28,868 blocks = 461,888 tokens; 8192-token sequences take 512 blocks
    each: 56 of them."""
    code, plan = plan_json(capsys, "--model", str(model_dir("llama3-8b")), "--gpu-memory", "80GiB")
    assert code == 0
    assert plan["activation_bytes"] == 2_571_108_352
    assert plan["kv_cache_tokens"] == 461_888
    assert plan["kv_cache_bytes"] == 28_868 * 2_097_152
    assert plan["max_model_len"] == 8192 and plan["sequence_tokens_p95"] == 8192
    assert plan["max_concurrent_sequences"] == plan["max_concurrent_sequences_p95"] == 56
    assert plan["recommended_max_num_seqs"] == 56


def test_max_concurrent_sequences_is_not_capped(capsys, model_dir):
    """int4 weights and an int8 cache: 1500-token sequences fit by the hundreds; the recommendation stops at 256."""
    code, plan = plan_json(capsys, "--model", str(model_dir("llama3-8b")), "--gpu-memory", "80GiB",
                           "--quantization", "int4", "--kv-cache-dtype", "int8", "--prompt-tokens", "1000",
                           "--output-tokens", "500")
    tokens = kv_tokens_by_hand(80 * GiB, 5_809_643_520, 2_571_108_352, 67_584)
    assert plan["kv_cache_tokens"] == tokens
    assert plan["max_concurrent_sequences"] == tokens // 16 // 94 > 256
    assert plan["recommended_max_num_seqs"] == 256


def test_70b_does_not_fit_in_80gib(capsys, model_dir):
    """137,953,296,384 of weights and 1,463,812,096 of activations: 129.84 GiB, 49.84 GiB more than 80."""
    code, plan = plan_json(capsys, "--model", str(model_dir("llama2-70b")), "--gpu-memory", "80GiB")
    assert code == 1 and plan["fits"] is False
    assert "49.84 GiB more than the 80.00 GiB given" in plan["message"]
    assert plan["kv_cache_tokens"] is None and plan["max_concurrent_sequences"] is None
    assert plan["recommended_max_num_seqs"] is None
    main(["plan", "--model", str(model_dir("llama2-70b")), "--gpu-memory", "80GiB"])
    assert "does not fit" in capsys.readouterr().out


def test_70b_int4_fits_in_80gib(capsys, model_dir):
    code, plan = plan_json(capsys, "--model", str(model_dir("llama2-70b")), "--gpu-memory", "80GiB",
                           "--quantization", "int4")
    tokens = kv_tokens_by_hand(80 * GiB, 37_415_829_504, 1_463_812_096, 327_680)
    assert (code, plan["fits"], plan["kv_cache_tokens"]) == (0, True, tokens)
    assert plan["max_concurrent_sequences"] == tokens // 16 // 256  # 4096-token sequences: 256 blocks


def test_json_keys(capsys, model_dir):
    _, plan = plan_json(capsys, "--model", str(model_dir("qwen2-7b")), "--gpu-memory", "24GB")
    assert {"fits", "weight_bytes", "kv_cache_bytes_per_token", "kv_cache_tokens", "max_concurrent_sequences",
            "recommended_max_num_seqs"} <= set(plan)
    assert plan["gpu_memory_bytes"] == 24 * 10**9


@pytest.mark.parametrize("text,expected", [("80GiB", 80 * 2**30), ("24GB", 24 * 10**9), ("123456", 123456),
                                           ("1.5 TiB", 3 * 2**39), ("512mib", 512 * 2**20), ("7B", 7)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["80GiBs", "", "-1", "GiB", "1e9"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


def test_usage_errors(capsys, model_dir):
    path = str(model_dir("llama3-8b"))
    cases = [(["--gpu-memory", "eighty"], "--gpu-memory: 'eighty' is not a size"),
             (["--gpu-memory", "80GiB", "--prompt-tokens", "5"], "go together"),
             (["--gpu-memory", "80GiB", "--max-model-len", "9000"], "max_model_len (9000)"),
             (["--gpu-memory", "80GiB", "--prompt-tokens", "8000", "--output-tokens", "500"],
              "more than max_model_len"),
             (["--gpu-memory", "80GiB", "--quantization", "int4", "--quantization-group-size", "64",
               "--input", "missing.jsonl"], "not found")]
    for flags, message in cases:
        assert main(["plan", "--model", path, *flags]) == 2
        assert message in capsys.readouterr().err


def test_int4_group_that_does_not_divide(capsys, tmp_path):
    """An MLP 4000 wide (31.25 groups of 128) cannot be held in INT4 groups of 128: refused, naming the width."""
    path = tmp_path / "odd"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**LLAMA3_8B, "intermediate_size": 4000}))
    assert main(["plan", "--model", str(path), "--gpu-memory", "80GiB", "--quantization", "int4"]) == 2
    assert "in_features 4000 is not a multiple of int4 group_size 128" in capsys.readouterr().err


def test_input_lengths(capsys, llama_dir, tmp_path):
    """Token-id prompts of 1..20 tokens with max_tokens 10: lengths 11..30, mean 20.5, p95 29.05 -> 30; a chat line
    without max_tokens takes the rest of the context (max_model_len 64); a bad line is left out."""
    lines = [{"custom_id": f"c{k}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": list(range(1, k + 1)), "max_tokens": 10}} for k in range(1, 21)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines) + "not json\n")
    code, plan = plan_json(capsys, "--model", str(llama_dir), "--gpu-memory", "1GiB", "--input", str(source))
    assert code == 0
    assert (plan["num_sequences"], plan["skipped_lines"]) == (20, 1)
    assert plan["sequence_tokens_mean"] == 20.5 and plan["sequence_tokens_p95"] == 30
    chat = {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "Hello there"}]}}
    source.write_text(json.dumps(chat) + "\n")
    _, plan = plan_json(capsys, "--model", str(llama_dir), "--gpu-memory", "1GiB", "--max-model-len", "64",
                        "--input", str(source))
    assert plan["sequence_tokens_mean"] == 64


def test_input_chat_prompt_is_templated(capsys, llama_dir, tmp_path):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "The zen of Python, by Tim Peters"}]
    prompt = AutoTokenizer.from_pretrained(str(llama_dir)).apply_chat_template(messages, add_generation_prompt=True,
                                                                                return_dict=True)["input_ids"]
    chat = {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": messages, "max_tokens": 7}}
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps(chat) + "\n")
    _, plan = plan_json(capsys, "--model", str(llama_dir), "--gpu-memory", "1GiB", "--input", str(source))
    assert plan["sequence_tokens_p95"] == len(prompt) + 7


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_figures_are_the_engines(capsys, llama_dir, quant):
    """The tiny checkpoint loaded: the engine's own weight bytes and bytes per block are the plan's."""
    from sluice.worker.engine import LLMEngine

    flags = ["--dtype", "bfloat16", "--quantization-group-size", "32"] + (["--quantization", quant] if quant else [])
    _, plan = plan_json(capsys, "--model", str(llama_dir), "--gpu-memory", "1GiB", "--kv-cache-dtype", "int8", *flags)
    engine = LLMEngine(str(llama_dir), dtype="bfloat16", quantization=quant, quantization_group_size=32,
                       kv_cache_dtype="int8", num_kv_blocks=4)
    assert plan["weight_bytes"] == engine.stats()["weight_bytes"]
    assert plan["kv_cache_bytes_per_token"] * 16 == engine.runner.bytes_per_block()
