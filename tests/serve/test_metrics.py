"""Server metrics: a registry per app, gauges read live from the scheduler, per-round acceptance."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from diffdraft.runtime.stats import GenerationStats
from diffdraft.serve.metrics import ServerMetrics


def samples(metrics: ServerMetrics) -> dict:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_two_servers_in_one_process_keep_their_own_counts():
    scheduler = SimpleNamespace(queue_depth=0, running=0)
    first, second = ServerMetrics(scheduler), ServerMetrics(scheduler)
    first.count("/v1/completions", 200)
    first.count("/v1/completions", 200)
    second.count("/v1/completions", 400)
    key = ("diffdraft_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    assert samples(first)[key] == 2 and key not in samples(second)


def test_gauges_show_the_scheduler_at_scrape_time():
    scheduler = SimpleNamespace(queue_depth=0, running=0)
    metrics = ServerMetrics(scheduler)
    scheduler.queue_depth, scheduler.running = 3, 5
    got = samples(metrics)
    assert got[("diffdraft_queue_depth", ())] == 3 and got[("diffdraft_running_requests", ())] == 5


def test_a_finished_request_adds_its_tokens_tau_and_every_rounds_acceptance():
    metrics = ServerMetrics(SimpleNamespace(queue_depth=0, running=0))
    metrics.finished(10, 7, GenerationStats(rounds=3, acceptance_lengths=[1, 2, 4]))
    got = samples(metrics)
    assert got[("diffdraft_prompt_tokens_total", ())] == 10
    assert got[("diffdraft_completion_tokens_total", ())] == 7
    assert got[("diffdraft_request_tau_sum", ())] == 7 / 3 and got[("diffdraft_request_tau_count", ())] == 1
    assert got[("diffdraft_acceptance_length_count", ())] == 3
    assert got[("diffdraft_acceptance_length_bucket", (("le", "2.0"),))] == 2
