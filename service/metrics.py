"""Prometheus metrics on a per-app registry: request count/latency by route template, jobs, queue depth."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("peagle.metrics")

# Label values come from a fixed set: a client inventing HTTP methods must not add a series per method.
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class _StateCollector(Collector):
    """Jobs by status (from the DB) and RQ queue depth (from Redis), read at scrape time."""

    def __init__(self, job_counts: Callable[[], dict[str, int]], queue_depths: Callable[[], dict[str, int]]):
        self.job_counts, self.queue_depths = job_counts, queue_depths

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Names only: registering must not query the DB or Redis.
        yield GaugeMetricFamily("peagle_jobs", "Jobs by status.", labels=["status"])
        yield GaugeMetricFamily("peagle_queue_depth", "Jobs waiting in each RQ queue.", labels=["queue"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs = GaugeMetricFamily("peagle_jobs", "Jobs by status.", labels=["status"])
        try:
            for status, n in sorted(self.job_counts().items()):
                jobs.add_metric([status], n)
        except Exception as exc:  # a scrape must not fail because the DB is down
            log.warning("jobs metric unavailable: %s", exc.__class__.__name__)
        yield jobs
        depth = GaugeMetricFamily("peagle_queue_depth", "Jobs waiting in each RQ queue.", labels=["queue"])
        try:
            for queue, n in sorted(self.queue_depths().items()):
                depth.add_metric([queue], n)
        except Exception as exc:
            log.warning("queue metric unavailable: %s", exc.__class__.__name__)
        yield depth


class Metrics:
    """The registries and instruments of one app: `registry` (HTTP traffic) and `state` (the jobs and
    queue gauges, which span every project and can be put behind `PEAGLE_METRICS_TOKEN`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.state = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "peagle_http_requests_total",
            "HTTP requests by method, route template and status.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "peagle_http_request_duration_seconds",
            "HTTP request latency by method and route template.",
            ["method", "route"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )

    def track_state(
        self, job_counts: Callable[[], dict[str, int]], queue_depths: Callable[[], dict[str, int]]
    ) -> None:
        self.state.register(_StateCollector(job_counts, queue_depths))


class MetricsMiddleware:
    """Pure ASGI middleware (no body buffering, streaming-safe) timing each HTTP request."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route: Any = scope.get("route")
            # The template (/v1/jobs/{job_id}), never the raw path: ids would explode label cardinality.
            template = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "")
            method = method if method in _METHODS else "other"
            self.metrics.requests.labels(method, template, str(status[0])).inc()
            self.metrics.latency.labels(method, template).observe(time.perf_counter() - start)
