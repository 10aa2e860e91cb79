"""A GPU worker's live engine metrics for Prometheus (`sluice worker --metrics-port`), vLLM's names under
`sluice:engine_`: per engine and live, where the API's /metrics are cluster-wide and read from the database."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from sluice.worker.engine_protocol import LiveStats

LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class EngineMetrics:
    def __init__(self, model: str):
        self.registry = CollectorRegistry()
        self.model = model
        gauge = lambda name, doc: Gauge(f"sluice:engine_{name}", doc, ["model_name"], registry=self.registry)
        counter = lambda name, doc: Counter(f"sluice:engine_{name}", doc, ["model_name"], registry=self.registry)
        self.running = gauge("num_requests_running", "Sequences in the engine's running batch")
        self.waiting = gauge("num_requests_waiting", "Requests in the engine waiting to be scheduled")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use, 0 to 1")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled (recomputation included)")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.preemptions = counter("num_preemptions", "Sequences preempted for lack of KV blocks")
        self.step = Histogram("sluice:engine_step_seconds", "Wall time of one engine step", ["model_name"],
                              buckets=STEP_BUCKETS, registry=self.registry)
        self.ttft = Histogram("sluice:engine_time_to_first_token_seconds", "From the request's submission to its "
                              "first token", ["model_name"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("sluice:engine_e2e_request_latency_seconds", "From the request's submission to its "
                             "last token", ["model_name"], buckets=LATENCY_BUCKETS, registry=self.registry)

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)

    def observe(self, live: LiveStats) -> None:
        """After each engine step, and after aborts in an idle engine, with what the engine process reported."""
        m, step = self.model, live.step
        self.running.labels(m).set(live.num_running)
        self.waiting.labels(m).set(live.num_waiting)
        self.kv_usage.labels(m).set(live.kv_blocks_used / live.kv_blocks_total)
        if step is not None:  # None: requests were aborted, no step ran
            self.generation_tokens.labels(m).inc(step.num_generated)
            self.prompt_tokens.labels(m).inc(step.num_prefill_tokens)
            self.preemptions.labels(m).inc(step.num_preemptions)
            self.step.labels(m).observe(step.seconds)
        for ttft, e2e in live.latencies:
            self.ttft.labels(m).observe(ttft)
            self.e2e.labels(m).observe(e2e)
