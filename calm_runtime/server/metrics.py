"""Prometheus metrics of one server process (its own registry, so apps never collide).

Besides traffic (requests, errors, queue depth, batch sizes, tokens, latencies) it keeps the
running distribution of what was served: token confidences, sequence confidences and
P(True). A shift of these histograms on live traffic is the first sign of calibration drift.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]

_PROBABILITY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("calm_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "code"], registry=r)
        self.errors = Counter("calm_errors", "error responses by OpenAI error type", ["type"],
                              registry=r)
        self.queue_depth = Gauge("calm_queue_depth", "rows waiting for a batch", registry=r)
        self.in_flight = Gauge("calm_requests_in_flight", "/v1 requests being handled", registry=r)
        self.cancelled = Counter("calm_requests_cancelled",
                                 "requests whose client went away before the answer was "
                                 "complete; their decoding was stopped", registry=r)
        self.running_rows = Gauge("calm_running_rows", "rows in the running batch (its "
                                  "occupancy)", registry=r)
        self.batch_size = Histogram("calm_batch_size", "rows per decode step",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r)
        self.prompt_tokens = Counter("calm_prompt_tokens", "prompt tokens processed", registry=r)
        self.generated_tokens = Counter("calm_generated_tokens",
                                        "tokens generated (rate() gives tokens/s)", registry=r)
        self.batch_tokens_per_second = Gauge("calm_batch_tokens_per_second",
                                             "tokens/s of the last batched decode", registry=r)
        self.latency = Histogram("calm_request_latency_seconds", "request latency by endpoint",
                                 ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("calm_queue_wait_seconds",
                                    "time from arrival to the start of its batch",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.token_confidence = Histogram("calm_token_confidence",
                                          "calibrated confidence of each served token",
                                          buckets=_PROBABILITY_BUCKETS, registry=r)
        self.sequence_confidence = Histogram("calm_sequence_confidence",
                                             "calibrated sequence confidence of each choice",
                                             buckets=_PROBABILITY_BUCKETS, registry=r)
        self.p_true = Histogram("calm_p_true", "P(True) of each choice that asked for it",
                                buckets=_PROBABILITY_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
