"""Prometheus metrics of one app: its own registry (two apps in one process never share counts).

The server counts what it sees (requests by endpoint and status, prompt and completion tokens);
the engine's gauges and totals (queue depth, slots in use, steps, acceptance, step times) are read
from ``engine.metrics()`` at scrape time by a collector, so they are never stale copies.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
STEP_QUANTILES = (0.5, 0.9, 0.99)


class ServerMetrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("specdec_http_requests", "HTTP requests by endpoint and status code",
                                ("endpoint", "status"), registry=self.registry)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "prompt tokens of finished requests",
                                     registry=self.registry)
        self.completion_tokens = Counter("specdec_completion_tokens", "tokens generated for finished requests",
                                         registry=self.registry)
        self.registry.register(_EngineCollector(engine))

    def count_request(self, path: str, status: int) -> None:
        self.requests.labels(path if path in ENDPOINTS else "other", str(status)).inc()

    def count_tokens(self, prompt: int, completion: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.completion_tokens.inc(completion)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class CountRequests:
    """ASGI middleware: every HTTP response, errors included, counted by endpoint and status."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]  # what a response that never started counts as

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.count_request(scope.get("path", ""), status[0])


class _EngineCollector:
    """``engine.metrics()`` as Prometheus families, read at every scrape."""

    def __init__(self, engine):
        self.engine = engine

    def describe(self):
        return []  # families depend on what the engine reports; nothing to pre-register

    def collect(self):
        m = self.engine.metrics()
        for key, doc in (("queue_depth", "requests waiting for a slot"), ("slots_in_use", "slots generating"),
                         ("max_slots", "slots of the engine")):
            if key in m:
                yield GaugeMetricFamily(f"specdec_{key}", doc, value=m[key])
        for key, doc in (("requests_total", "requests the engine accepted"),
                         ("requests_finished", "requests that ended with stop or length"),
                         ("requests_cancelled", "requests cancelled (stop strings, clients gone)"),
                         ("requests_failed", "requests the engine failed"),
                         ("prompt_tokens_total", "prompt tokens the engine prefilled"),
                         ("tokens_total", "tokens the engine committed"), ("steps_total", "engine steps"),
                         ("accepted_total", "drafted tokens accepted"), ("drafted_total", "tokens drafted")):
            if key in m:
                yield CounterMetricFamily(f"specdec_engine_{key.removesuffix('_total')}", doc, value=m[key])
        steps = m.get("steps_total", 0)
        if steps:
            # tau: tokens committed per target step, the bonus token included
            yield GaugeMetricFamily("specdec_tau", "mean tokens committed per step ((accepted + steps) / steps)",
                                    value=(m.get("accepted_total", 0) + steps) / steps)
        k_steps, k_seconds = m.get("k_chosen") or {}, m.get("k_seconds") or {}
        if k_steps:  # what the cost controller chose, and what those steps cost in all
            c = CounterMetricFamily("specdec_engine_steps_by_draft_tokens",
                                    "engine steps by the drafts per slot the controller chose (k)", labels=["k"])
            t = CounterMetricFamily("specdec_engine_step_seconds_by_draft_tokens",
                                    "seconds in engine steps by the drafts per slot chosen (k)", labels=["k"])
            for k in sorted(k_steps):
                c.add_metric([str(k)], k_steps[k])
                t.add_metric([str(k)], k_seconds.get(k, 0.0))
            yield c
            yield t
        times = sorted(m.get("step_seconds") or [])
        if times:
            s = Metric("specdec_recent_step_seconds", "engine step times over the engine's recent steps", "summary")
            for q in STEP_QUANTILES:
                s.add_sample("specdec_recent_step_seconds", {"quantile": str(q)},
                             times[min(len(times) - 1, int(q * len(times)))])
            s.add_sample("specdec_recent_step_seconds_count", {}, len(times))
            s.add_sample("specdec_recent_step_seconds_sum", {}, sum(times))
            yield s
