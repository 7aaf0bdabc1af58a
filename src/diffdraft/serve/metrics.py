"""Prometheus metrics of one server, on a registry of its own (two apps in one process, as in the
tests, never share or clash over counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from diffdraft.runtime.stats import GenerationStats
from diffdraft.serve.scheduler import Scheduler

CLIENT_CLOSED = 499
"""The status recorded for a request whose client went away before it finished (nginx's code)."""

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """What ``GET /metrics`` shows: traffic, tokens, speculation quality and the scheduler's load."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "diffdraft_requests",
            "HTTP requests by endpoint and status code (499: the client went away first).",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "diffdraft_prompt_tokens", "Prompt tokens of finished requests.", registry=self.registry
        )
        self.completion_tokens = Counter(
            "diffdraft_completion_tokens", "Generated tokens of finished requests.", registry=self.registry
        )
        self.tau = Histogram(
            "diffdraft_request_tau",
            "Per finished request: mean tokens committed per target forward (bonus token included).",
            buckets=(1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8, 12, 16),
            registry=self.registry,
        )
        self.acceptance_length = Histogram(
            "diffdraft_acceptance_length",
            "Per verification round: tokens committed (1 = no draft token accepted).",
            buckets=tuple(range(1, 17)),
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "diffdraft_time_to_first_token_seconds",
            "From the request's arrival to its first generated text.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.latency = Histogram(
            "diffdraft_request_latency_seconds",
            "From the request's arrival to its last token.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        queue = Gauge(
            "diffdraft_queue_depth", "Requests waiting for a place in the batch.", registry=self.registry
        )
        queue.set_function(lambda: scheduler.queue_depth)
        running = Gauge("diffdraft_running_requests", "Requests in the batch now.", registry=self.registry)
        running.set_function(lambda: scheduler.running)

    def count(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def finished(self, prompt_tokens: int, completion_tokens: int, stats: GenerationStats) -> None:
        """Record a request that generated to its end."""
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        if stats.acceptance_lengths:
            self.tau.observe(stats.tau)
        for length in stats.acceptance_lengths:
            self.acceptance_length.observe(length)

    def render(self) -> bytes:
        return generate_latest(self.registry)
