"""system_fingerprint: the same configuration gives the same one across copies, runs and workers; changing any part
(weights' headers or sizes, dtype, quantization, KV-cache dtype, adapter, version) gives another; every result of
`sluice run` and of the service carries it, and the batch lists its results' distinct ones."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace

import pytest
import torch
from lora_fixtures import completion_line
from safetensors.torch import save_file
from sdk_batches import chat_line, run_batch

from sluice.worker.adapters import ServedModels
from sluice.worker.cli import main
from sluice.worker.engine import LLMEngine
from sluice.worker.engine.demo import build_checkpoint
from sluice.worker.fingerprint import Fingerprints, adapter_identity, engine_fingerprint, weights_identity


def fingerprint(model_dir, **config) -> str:
    return engine_fingerprint(LLMEngine(str(model_dir), num_kv_blocks=8, **config)).value()


@pytest.fixture(scope="module")
def base(llama_dir) -> str:
    return fingerprint(llama_dir)


def test_the_format_is_openais(base):
    assert re.fullmatch(r"fp_[0-9a-f]{12}", base)


def test_a_copy_elsewhere_and_a_second_engine_give_the_same_fingerprint(llama_dir, base, tmp_path):
    copy = shutil.copytree(llama_dir, tmp_path / "elsewhere" / "model")
    assert fingerprint(copy) == fingerprint(llama_dir) == base
    # engine settings that do not change what is computed leave it alone
    assert fingerprint(llama_dir, max_num_seqs=3, block_size=8, enable_prefix_caching=False) == base


@pytest.mark.parametrize("config", [dict(dtype="bfloat16"), dict(kv_cache_dtype="int8"), dict(quantization="int8"),
                                    dict(quantization="int4", quantization_group_size=32),
                                    dict(quantization="int8", quantize_lm_head=True), dict(load_format="dummy")])
def test_each_part_of_the_configuration_changes_it(llama_dir, base, config):
    assert fingerprint(llama_dir, **config) != base


def test_the_int4_group_size_changes_it(tmp_path, tokenizer_dir):
    model = build_checkpoint(tmp_path, intermediate_size=128, tokenizer_dir=tokenizer_dir)  # both sizes divide it
    assert fingerprint(model, quantization="int4", quantization_group_size=32) != fingerprint(
        model, quantization="int4", quantization_group_size=64)


def test_the_version_changes_it(llama_dir):
    parts = engine_fingerprint(LLMEngine(str(llama_dir), num_kv_blocks=8))
    assert replace(parts, version="0.0.0-other").value() != parts.value()


def _checkpoint(path, tensors: dict[str, torch.Tensor], metadata: dict | None = None):
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata=metadata)
    return path / "model.safetensors"


def test_the_weights_identity_is_the_headers_and_sizes(tmp_path):
    """What it promises: any tensor's name, dtype or shape, and any file's size; the data bytes alone are not read."""
    tensors = {"a": torch.zeros(4, 8), "b": torch.ones(8)}
    reference = weights_identity([_checkpoint(tmp_path / "ref", tensors)])
    assert weights_identity([_checkpoint(tmp_path / "same", dict(tensors))]) == reference
    for name, changed in [("renamed", {"a": tensors["a"], "c": tensors["b"]}),
                          ("dtype", {**tensors, "b": tensors["b"].half()}),
                          ("shape", {**tensors, "a": tensors["a"].reshape(8, 4)}),
                          ("added", {**tensors, "d": torch.zeros(1)})]:
        assert weights_identity([_checkpoint(tmp_path / name, changed)]) != reference, name
    grown = _checkpoint(tmp_path / "grown", tensors)
    with grown.open("ab") as f:
        f.write(b"\0")
    assert weights_identity([grown]) != reference
    data_only = _checkpoint(tmp_path / "data", {**tensors, "b": torch.full((8,), 2.0)})
    assert weights_identity([data_only]) == reference  # same header and size: the identity does not read the data


def test_adapters_have_their_own_fingerprints_by_content_not_path(llama_dir, lora_dir, base, tmp_path):
    parts = engine_fingerprint(LLMEngine(str(llama_dir), num_kv_blocks=8))
    copy = shutil.copytree(lora_dir / "a", tmp_path / "copy_of_a")
    served = ServedModels.of("tiny", {"a": str(lora_dir / "a"), "b": str(lora_dir / "b"), "a2": str(copy)})
    fingerprints = Fingerprints(parts, served)
    assert fingerprints.of("tiny") == base
    assert len({fingerprints.of("tiny"), fingerprints.of("a"), fingerprints.of("b")}) == 3
    assert fingerprints.of("a2") == fingerprints.of("a")  # the same files elsewhere, under another name
    config_path = copy / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "base_model_name_or_path": "/somewhere/else"}))
    assert adapter_identity(copy) == adapter_identity(lora_dir / "a")
    config_path.write_text(json.dumps({**config, "lora_alpha": config["lora_alpha"] * 2}))
    assert adapter_identity(copy) != adapter_identity(lora_dir / "a")  # a scaling changes what it computes


def test_sluice_run_puts_it_on_every_line_the_same_in_every_run(llama_dir, lora_dir, base, tmp_path):
    lines = [completion_line(f"{model}-{i}", model, "The zen of") for i in range(2) for model in ("tiny", "a", "b")]
    found = []
    for run in ("first", "second"):
        source, out = tmp_path / f"{run}.jsonl", tmp_path / f"{run}.out.jsonl"
        source.write_text("".join(json.dumps(line) + "\n" for line in lines))
        assert main(["run", str(source), "-o", str(out), "--model", str(llama_dir), "--served-model-name", "tiny",
                     "--lora-dir", str(lora_dir), "--max-num-seqs", "4"]) == 0
        bodies = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, out.read_text().splitlines())}
        found.append({k: b["system_fingerprint"] for k, b in bodies.items()})
    first, second = found
    assert first == second and len(first) == len(lines)
    assert first["tiny-0"] == first["tiny-1"] == base
    assert first["a-0"] == first["a-1"] != first["b-0"] == first["b-1"] != base


def test_a_batch_through_the_service_carries_it_and_the_batch_shows_it(cluster, base):
    ran = run_batch(cluster, [chat_line(f"r{i}", f"Say {i}", max_tokens=4) for i in range(6)])
    assert ran.batch.status == "completed" and len(ran.outputs) == 6
    assert {body["system_fingerprint"] for body in ran.outputs.values()} == {base}  # as `sluice run`'s engine
    assert ran.batch.system_fingerprints == [base]
    assert all(row.response["system_fingerprint"] == base for row in cluster.result_rows(ran.batch.id))
