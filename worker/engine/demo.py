"""Tiny random checkpoints with an offline-trained tokenizer: `--model demo`, tests and benchmarks use them."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

DEMO_VERSION = 3  # 3: the chat template renders tools
SPECIAL_TOKENS = ["<s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}  # where it is not <kind>Config (Gemma3Config is multimodal)
DEMO_SHAPE = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048)


def _corpus() -> list[str]:
    """English text that ships with Python itself, so training needs no download."""
    import codecs
    import contextlib
    import io
    import json as json_mod
    import textwrap
    import unittest

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen of Python
        import this
    zen = codecs.decode(this.s, "rot13")
    docs = [zen, json_mod.__doc__, textwrap.__doc__, unittest.__doc__, codecs.__doc__, os.__doc__]
    return [d for d in docs if d] * 4


def train_tokenizer(out_dir: Path, vocab_size: int = 512):
    """A byte-level BPE tokenizer (any text encodes) saved as a transformers fast tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    from tokenizers.processors import TemplateProcessing

    tok.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                            special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|end|>", pad_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_checkpoint(out_dir: str | Path, architecture: str = "LlamaForCausalLM", seed: int = 0,
                     dtype: str = "float32", tokenizer_dir: str | Path | None = None, **overrides) -> Path:
    """Write a random checkpoint of the given architecture (and a tokenizer) to out_dir."""
    import torch
    import transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        tokenizer = train_tokenizer(out_dir)
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
        tokenizer.save_pretrained(str(out_dir))
    kind = architecture.removesuffix("ForCausalLM")
    shape = {**DEMO_SHAPE, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
             "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, **overrides}
    config = getattr(transformers, CONFIG_CLASSES.get(architecture, f"{kind}Config"))(**shape)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(getattr(torch, dtype))
    model.save_pretrained(str(out_dir))
    return out_dir


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "sluice"


def demo_model_dir() -> Path:
    """The demo checkpoint, built once per user; its text is meaningless (random weights)."""
    target = cache_dir() / f"demo-v{DEMO_VERSION}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".demo-"))
    try:
        build_checkpoint(tmp)
        (tmp / "DEMO.json").write_text(json.dumps({"note": "random weights: the text is meaningless"}))
        try:
            tmp.rename(target)
        except OSError:  # another process built it first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_lora_adapter(base_dir: str | Path, out_dir: str | Path, rank: int = 8, alpha: float = 16,
                       targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"), seed: int = 0, use_rslora: bool = False) -> Path:
    """Write a random LoRA adapter for the checkpoint at base_dir with PEFT (needs `peft`): B random too, not PEFT's
    zeros, so that the adapter changes the model's outputs."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                             use_rslora=use_rslora)
    model = peft.get_peft_model(base, config)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)
