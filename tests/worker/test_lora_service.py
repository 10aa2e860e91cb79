"""LoRA adapters through the service: a `sluice worker` and `sluice serve` started with --lora-dir serve a batch
that mixes the base model and two adapters, each line as the engine gives it alone; /v1/models lists them; an
unknown adapter is refused at batch creation; a bad adapter stops the worker before it takes work."""

from __future__ import annotations

import json
import time

import openai
import pytest
from lora_fixtures import check_mixed, completion_line, engine_texts, mixed_lines
from servers import serve_app, start_sluice_serve
from test_openai_e2e import upload, wait_for

from sluice.api import store
from sluice.api.server import create_app
from sluice.api.settings import Settings

MODEL = "tiny"  # the cluster's workers' served name


def run_mixed(client: openai.OpenAI, llama_dir, lora_dir) -> None:
    """/v1/models, the mixed batch, and an unknown adapter's batch refused."""
    deadline = time.monotonic() + 60
    while True:  # until the worker is live: before, /v1/models lists the names it accepts, without their paths
        models = {m.id: m.model_dump() for m in client.models.list()}
        if models.get("a", {}).get("root") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert set(models) == {MODEL, "a", "b"} and models[MODEL]["parent"] is None
    assert (models["a"]["parent"], models["a"]["root"]) == (MODEL, str(lora_dir / "a"))
    lines = mixed_lines(MODEL)
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/completions",
                                  completion_window="24h")
    assert batch.model == MODEL and batch.request_counts.failed == 0
    batch = wait_for(client, batch.id, ("completed",), timeout=120)
    bodies = {o["custom_id"]: o["response"]["body"]
              for o in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())}
    texts = {k: b["choices"][0]["text"] for k, b in bodies.items()}
    check_mixed(texts, engine_texts(llama_dir, lora_dir, lines, MODEL), MODEL)
    assert {b["model"] for k, b in bodies.items() if k.startswith("a-")} == {"a"}
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=upload(client, [completion_line("x", "c", "Hi")]),
                              endpoint="/v1/completions", completion_window="24h")
    assert refused.value.body["code"] == "model_not_found" and "'c'" in refused.value.body["message"]


def test_a_worker_serves_adapters_beside_its_base_model(cluster, llama_dir, lora_dir):
    cluster.start_worker("--lora-dir", str(lora_dir), "--max-num-seqs", "4")
    cluster.wait_live(1)
    with cluster.sessions.begin() as session:  # registered under each name, as models are
        assert {w.served_model_name: w.parent for w in store.live_workers(session)} == {MODEL: None, "a": MODEL,
                                                                                      "b": MODEL}
        _, key = store.create_api_key(session, store.get_or_create_tenant(session, "acme").id)
    with serve_app(create_app(cluster.sessions, cluster.app, Settings())) as url:
        run_mixed(openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0), llama_dir, lora_dir)


def test_a_bad_adapter_stops_the_worker_naming_it(cluster, lora_dir):
    proc = cluster.start_worker("--lora", f"a={lora_dir / 'a'}", "--lora", "gone=/nonexistent/adapter")
    assert proc.wait(timeout=90) == 2
    log = cluster.log_text()
    assert "adapter 'gone'" in log and "/nonexistent/adapter/adapter_config.json not found" in log
    with cluster.sessions.begin() as session:
        assert store.live_workers(session) == []


def test_sluice_serve_with_adapters(tmp_path, llama_dir, lora_dir):
    proc, port = start_sluice_serve(tmp_path, "--model", str(llama_dir), "--served-model-name", MODEL, "--lora-dir",
                                    str(lora_dir))
    try:
        key = (tmp_path / "data" / "api_key").read_text().strip()
        run_mixed(openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0), llama_dir,
                  lora_dir)
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
