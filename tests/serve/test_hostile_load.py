"""A few seconds of benchmarks/serve-hostile-clients' mix against a tiny model: every hostile client
gets its quick refusal, and every normal client its full, correct answer, with /health answering
throughout."""

from __future__ import annotations

import diffdraft
from diffdraft.serve.app import create_app
from diffdraft.serve.hostile_load import HOSTILE_KINDS, MixSettings, run_mix
from diffdraft.serve.limits import ServerLimits
from diffdraft.serve.scheduler import Scheduler

from diffdraft_testing.serving import LiveServer, make_chat_checkpoint

EXPECTED_OUTCOMES = {
    "huge body": {"413", "closed while the body was sent"},
    "lying length": {"413"},
    "malformed JSON": {"400"},
    "invalid UTF-8": {"400"},
    "over-cap max_tokens": {"400"},
    "tiny temperature": {"200, the greedy text"},
    "slow sender": {"408"},
}


def test_normal_clients_are_served_beside_hostile_ones(tmp_path):
    checkpoint = make_chat_checkpoint(tmp_path / "target")
    body = {"prompt": "hello world", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    expected = diffdraft.load(checkpoint, method="pld").generate(
        "hello world", max_new_tokens=8, ignore_eos=True
    )
    limits = ServerLimits(max_request_bytes=4096, max_tokens_cap=48, body_timeout=1.0)
    scheduler = Scheduler(diffdraft.load(checkpoint, method="pld"), max_batch_size=4).start()
    try:
        with LiveServer(create_app(scheduler, "tiny", limits=limits)) as live:
            settings = MixSettings(
                live.url,
                body,
                expected.text,
                duration=4.0,
                normal_clients=2,
                max_tokens_cap=48,
                huge_bytes=2**20,
                slow_send_seconds=0.3,
                slow_read_seconds=0.2,
                timeout=30.0,
            )
            report = run_mix(settings)
    finally:
        scheduler.close()
    assert report.normal_wrong == [] and report.normal_correct >= 4
    assert max(report.normal_latencies) < 10
    assert report.health_failures == 0 and max(report.health_latencies) < 2
    assert set(report.outcomes) == set(HOSTILE_KINDS)
    for kind, outcomes in EXPECTED_OUTCOMES.items():
        seen = set(report.outcomes[kind]) - {"gave up at the deadline"}  # the last try, cut short
        assert seen and seen <= outcomes, (kind, report.outcomes[kind])
    assert sum(report.outcomes["slow reader"].values()) == 1
