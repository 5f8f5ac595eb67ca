"""Prometheus metrics: requests, latency and queue time per model, loaded models, job states, GPU memory."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from medserve.errors import MedserveError
from medserve.server.errors import ApiError, from_core
from medserve.server.states import JOB_STATES

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)


class _LiveCollector(Collector):
    """Values read at scrape time (job states from SQLite, GPU memory) rather than tracked on every change."""

    def __init__(self, job_counts: Callable[[], dict[str, int]]) -> None:
        self.job_counts = job_counts

    def collect(self) -> Iterable[GaugeMetricFamily]:
        jobs = GaugeMetricFamily("medserve_jobs", "Jobs by state", labels=["state"])
        counts = self.job_counts()
        for state in JOB_STATES:
            jobs.add_metric([state], counts.get(state, 0))
        yield jobs
        import torch

        if torch.cuda.is_available():
            gpu = GaugeMetricFamily("medserve_gpu_memory_bytes", "GPU memory allocated by torch", labels=["device"])
            for index in range(torch.cuda.device_count()):
                gpu.add_metric([str(index)], torch.cuda.memory_allocated(index))
            yield gpu


UNKNOWN_MODEL = ""  # the label of requests naming no model in the store: one series, however many names are tried


class RequestCount:
    """One request's line in medserve_requests: the model, UNKNOWN_MODEL until its name is found in the store,
    and the status, 500 until the handler sets its own or an error gives one."""

    def __init__(self) -> None:
        self.model = UNKNOWN_MODEL
        self.status = "500"


class Metrics:
    """One registry per app, so that several apps in one process (tests) do not collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("medserve_requests", "Inference requests", ["model", "endpoint", "status"],
                                registry=self.registry)
        self.latency = Histogram("medserve_request_seconds", "Inference latency", ["model", "endpoint"],
                                 buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.queue = Histogram("medserve_queue_seconds", "Time waiting for a model slot", ["model"],
                               buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.loaded = Gauge("medserve_models_loaded", "Models held in memory", registry=self.registry)
        self.model_memory = Gauge("medserve_model_memory_bytes", "Parameter+buffer bytes of loaded models",
                                  ["model"], registry=self.registry)

    def watch_jobs(self, job_counts: Callable[[], dict[str, int]]) -> None:
        self.registry.register(_LiveCollector(job_counts))

    def store_changed(self, store: object) -> None:
        entries = store.entries()  # type: ignore[attr-defined]
        self.loaded.set(sum(1 for e in entries if e.predictor is not None))
        self.model_memory.clear()
        for e in entries:
            if e.predictor is not None:
                self.model_memory.labels(e.name).set(e.memory)

    @contextlib.contextmanager
    def counted(self, endpoint: str) -> Iterator[RequestCount]:
        """Count the request the block answers, errors included, once."""
        count = RequestCount()
        try:
            yield count
        except ApiError as error:
            count.status = str(error.status)
            raise
        except MedserveError as error:
            count.status = str(from_core(error).status)
            raise
        finally:
            self.requests.labels(count.model, endpoint, count.status).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
