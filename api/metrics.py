"""GET /metrics for Prometheus: figures computed at scrape time from the database and Redis, under vLLM's names with
the `sluice:` prefix, so they are the same whichever API host is scraped and survive restarts.

sluice:num_requests_running, sluice:num_requests_waiting {model}    requests running / queued now
sluice:kv_cache_usage_perc {model, worker}                          KV-cache use (0..1) in the worker's latest window
sluice:prompt_tokens_total, sluice:generation_tokens_total {model}  over every result
sluice:time_to_first_token_seconds, sluice:e2e_request_latency_seconds {model}  histograms over every result
sluice:queue_depth {model}                                          messages waiting in the model's Redis queue

`model` is the batch's served model name. A batch whose every line failed validation, with no model given, has
none: it is in no series (nothing of it ran), rather than in series labelled model="".
"""

from __future__ import annotations

from collections.abc import Iterator

from kombu.exceptions import OperationalError
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from redis.exceptions import RedisError

from sluice.api import store
from sluice.api.deps import Services
from sluice.api.queue import model_queue, queue_depth
from sluice.api.tables import Result

TTFT_BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
E2E_BOUNDS = (0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0)
BROKER_SECONDS = 2.0
BY_MODEL = (", by their batch's served model (a batch whose every line failed validation ran nothing and is in no "
            "series)")


class SluiceCollector:
    def __init__(self, svc: Services):
        self.svc = svc

    def collect(self) -> Iterator[Metric]:
        with self.svc.sessions.begin() as session:
            counts = store.requests_by_status(session, ("queued", "running"))
            tokens = store.token_totals(session)
            ttft = store.latency_histogram(session, Result.ttft_seconds, TTFT_BOUNDS)
            e2e = store.latency_histogram(session, Result.e2e_seconds, E2E_BOUNDS)
            kv = store.kv_cache_use(session)
            models = sorted(set(self.svc.settings.models) | {w.served_model_name for w in store.live_workers(session)}
                            | set(store.models_with_waiting_requests(session)))
        for status, name, doc in (("running", "num_requests_running", "Requests running on workers"),
                                  ("queued", "num_requests_waiting", "Requests waiting to be run")):
            family = GaugeMetricFamily(f"sluice:{name}", doc, labels=["model"])
            for model in models:
                family.add_metric([model], counts.get((model, status), 0))
            yield family
        family = GaugeMetricFamily("sluice:kv_cache_usage_perc", "KV-cache use, 0 to 1, in the worker's latest "
                                   "efficiency window", labels=["model", "worker"])
        for worker, model, use in kv:
            family.add_metric([model, worker], use)
        yield family
        for index, name, doc in ((0, "prompt_tokens", f"Prompt tokens of finished requests{BY_MODEL}"),
                                 (1, "generation_tokens", f"Generated tokens of finished requests{BY_MODEL}")):
            family = CounterMetricFamily(f"sluice:{name}", doc, labels=["model"])
            for model, sums in tokens.items():
                family.add_metric([model], sums[index])
            yield family
        yield _histogram("time_to_first_token_seconds", "Time to first token of finished requests", ttft, TTFT_BOUNDS)
        yield _histogram("e2e_request_latency_seconds", "End-to-end latency of finished requests", e2e, E2E_BOUNDS)
        yield from self._queue_depth(models)

    def _queue_depth(self, models: list[str]) -> Iterator[Metric]:
        family = GaugeMetricFamily("sluice:queue_depth", "Messages waiting in the model's queue", labels=["model"])
        try:
            with self.svc.celery.connection_for_read() as connection:  # fail fast when the broker is down
                connection.ensure_connection(max_retries=1, timeout=BROKER_SECONDS)
            for model in models:
                family.add_metric([model], queue_depth(self.svc.celery, model_queue(model)))
        except (OperationalError, RedisError, OSError):
            return  # the broker is down: /readyz says so; the database's figures are still worth scraping
        yield family


def _histogram(name: str, doc: str, figures: dict, bounds: tuple[float, ...]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(f"sluice:{name}", doc, labels=["model"])
    for model, (cumulative, total, count) in figures.items():
        buckets = [(str(bound), n) for bound, n in zip(bounds, cumulative)] + [("+Inf", count)]
        family.add_metric([model], buckets, total)
    return family


def make_registry(svc: Services) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(SluiceCollector(svc))
    return registry
