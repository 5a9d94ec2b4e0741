"""Prometheus metrics of the service (``GET /metrics``), in a registry of its own (two
services in one process do not share counters).

What the service counts as it goes: HTTP requests by route and status and their
duration, ``/run_code`` answers by language and status, actions' completion times by
kind, the quota proxy's upstream responses by endpoint and status (429s included). What
it reads from the dispatcher at each scrape: queue and running counts, outcomes,
decisions and their latency, pool use (cores busy, calls in flight, what the API buckets
hold).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["ServiceMetrics"]

_ACT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)


class _DispatcherCollector(Collector):
    """Reads the dispatcher's status at scrape time."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        s = self.status()
        for name, help_, key in (
                ("submitted", "Requests the dispatcher accepted", "submitted"),
                ("done", "Requests that finished successfully", "done"),
                ("failed", "Requests that ran and failed (or could not run)", "failed"),
                ("rejected", "Requests rejected as invalid", "rejected"),
                ("cancelled", "Requests cancelled by their caller (dropped or killed)",
                 "cancelled"),
                ("decisions", "Scheduling decisions made", "decisions"),
                ("guard_fired", "Actions the starvation guard started", "guard_fired")):
            yield CounterMetricFamily(f"metasched_{name}", help_, value=s.get(key, 0))
        queued = GaugeMetricFamily("metasched_queued", "Actions waiting to start, by kind",
                                   labels=["kind"])
        for kind, n in s.get("queue", {}).items():
            queued.add_metric([kind], n)
        yield queued
        yield GaugeMetricFamily("metasched_running", "Actions running", value=s["running"])
        lat = GaugeMetricFamily("metasched_decision_latency_microseconds",
                                "Scheduling decision latency over the recent decisions",
                                labels=["quantile"])
        for q, v in s.get("decision_latency_us", {}).items():
            lat.add_metric([str(int(q[1:]) / 100)], v)
        yield lat
        pools = s.get("pools", {})
        cpu = pools.get("cpu")
        if cpu:
            yield GaugeMetricFamily("metasched_cores", "Cores actions may use",
                                    value=len(cpu["cores"]))
            yield GaugeMetricFamily("metasched_cores_busy", "Cores running actions",
                                    value=cpu["busy"])
        api = pools.get("api", {})
        if api:
            inflight = GaugeMetricFamily("metasched_api_in_flight", "API calls in flight",
                                         labels=["endpoint"])
            avail = GaugeMetricFamily("metasched_api_requests_available",
                                      "Requests the endpoint's RPM window still admits",
                                      labels=["endpoint"])
            for ep, e in api.items():
                inflight.add_metric([ep], e["in_flight"])
                avail.add_metric([ep], e["requests_available"])
            yield inflight
            yield avail
        util = GaugeMetricFamily("metasched_utilisation", "Mean utilisation since start",
                                 labels=["pool", "source"])
        for pool, v in s.get("granted_utilisation", {}).items():
            util.add_metric([pool, "granted"], v)
        for pool, v in s.get("measured_utilisation", {}).items():
            util.add_metric([pool, "measured"], v)
        yield util


class ServiceMetrics:
    """The service's metrics (see the module docstring)."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http = Counter("metasched_http_requests", "HTTP requests answered",
                            ["route", "status"], registry=r)
        self.http_seconds = Histogram("metasched_http_request_seconds",
                                      "Time to answer an HTTP request", ["route"],
                                      buckets=_ACT_BUCKETS, registry=r)
        self.run_code = Counter("metasched_run_code", "/run_code answers",
                                ["language", "status"], registry=r)
        self.act = Histogram("metasched_action_completion_seconds",
                             "Action completion time (queue wait + run) of actions "
                             "submitted through the service", ["kind"],
                             buckets=_ACT_BUCKETS, registry=r)
        self.cancels = Counter("metasched_cancellations",
                               "Actions cancelled through the service, by cause "
                               "(disconnect: its HTTP client left; request: an explicit "
                               "cancel)", ["cause"], registry=r)
        self.upstream = Counter("metasched_proxy_upstream_responses",
                                "Responses of the quota proxy's upstreams (each attempt)",
                                ["endpoint", "status"], registry=r)
        r.register(_DispatcherCollector(status))
