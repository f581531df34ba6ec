"""Prometheus metrics of one server replica (prometheus-client), on a registry of its own.

Names follow Prometheus conventions (`_total` counters, `_seconds` units) under the `dspark_` prefix.
Latencies are measured in the server, from the moment a request's body is parsed:

- time to first token (TTFT): until the first committed token of the request reaches the server;
- inter-token latency: the gap between two deliveries divided by the tokens delivered (a
  verification round commits several tokens at once, each gets the round's share);
- end-to-end: until the request's last event.

Acceptance length τ (tokens committed per verification round, bonus included) and verification length
(draft tokens sent to verification per round) are per-request means, from `RequestStats`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the /metrics route)

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_LENGTH_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0)


class ServerMetrics:
    """The server's metrics; `render()` is the /metrics body (text exposition format)."""

    def __init__(self, model: str):
        self.registry = r = CollectorRegistry()
        labels = ["model"]
        self.requests = Counter("dspark_requests", "Finished requests by OpenAI finish reason "
                                "(stop, length, error, cancelled = the client left)", labels + ["finish_reason"],
                                registry=r)
        self.rejected = Counter("dspark_rejected_requests", "Requests refused before generation, by HTTP status",
                                labels + ["status"], registry=r)
        self.prompt_tokens = Counter("dspark_prompt_tokens", "Prompt tokens of admitted requests", labels, registry=r)
        self.completion_tokens = Counter("dspark_completion_tokens", "Generated tokens", labels, registry=r)
        self.acceptance_length = Histogram("dspark_acceptance_length", "Per-request acceptance length tau "
                                           "(tokens committed per verification round, bonus included)", labels,
                                           buckets=_LENGTH_BUCKETS, registry=r)
        self.verify_length = Histogram("dspark_verification_length", "Per-request mean draft tokens sent to "
                                       "verification per round", labels, buckets=(0.0,) + _LENGTH_BUCKETS, registry=r)
        self.step_seconds = Histogram("dspark_step_seconds", "Wall time of one runtime step (all batched requests)",
                                      labels, buckets=_STEP_BUCKETS, registry=r)
        self.queue_depth = Gauge("dspark_queue_depth", "Requests waiting for a KV-cache slot", labels, registry=r)
        self.running = Gauge("dspark_running_requests", "Requests holding a KV-cache slot", labels, registry=r)
        self.ttft = Histogram("dspark_time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("dspark_inter_token_latency_seconds", "Inter-token latency", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("dspark_e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.model = model

    def finished(self, finish_reason: str, stats: dict) -> None:
        """Count a finished request from its final event's stats (`RequestStats.to_dict()`)."""
        m = self.model
        self.requests.labels(m, finish_reason).inc()
        self.prompt_tokens.labels(m).inc(stats.get("prompt_tokens", 0))
        rounds = stats.get("rounds", 0)
        if rounds:
            self.acceptance_length.labels(m).observe(stats.get("acceptance_length", 0.0))
            self.verify_length.labels(m).observe(stats.get("draft_tokens", 0) / rounds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
