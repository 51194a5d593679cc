"""L11 §6: /metrics in Prometheus' text format, every figure checked against an independent count
of what the test sent and got back, and against the engine's own counters."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from l11_serve import Server, build_server
from l11_serve.metrics import ServeMetrics
from l5_eviction import State
from probes_l11 import admit, fake_engine, fake_request, hold_until_queued
from serve_helpers import TIMEOUT_S, assert_no_leak, wait_idle

pytestmark = [pytest.mark.l11, pytest.mark.usefixtures("one_torch_thread")]

SYSTEM = "And the LORD spake unto Moses, saying, Speak unto the children of Israel, and say unto them,"


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, parsed with prometheus_client's own parser."""
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(metrics: dict, name: str, **labels) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.points(2)
def test_metrics_count_tokens_latencies_forks_and_prefix_hits(embedded_model_dir):
    app, loop, tok = build_server(embedded_model_dir, num_blocks=64, block_size=16)
    asks = [dict(prompt=SYSTEM + " Blessed", max_tokens=5), dict(prompt=SYSTEM + " Hear", max_tokens=7),
            dict(prompt=SYSTEM + " Holy", max_tokens=4, n=3, temperature=1.0, seed=1)]
    with Server(app) as url:
        answers = [httpx.post(f"{url}/v1/completions", json={"temperature": 0, **a}, timeout=TIMEOUT_S).json()
                   for a in asks]  # one after another: each later prompt finds the system prompt cached
        wait_idle(loop)
        m = scrape(url)
    samples = sum(len(a["choices"]) for a in answers)
    out = sum(a["usage"]["completion_tokens"] for a in answers)
    assert samples == 5 and out == 5 + 7 + 12
    assert value(m, "kvcourse_generation_tokens_total") == out
    assert value(m, "kvcourse_prompt_tokens_total") == sum(a["usage"]["prompt_tokens"] for a in answers)
    assert value(m, "kvcourse_time_to_first_token_seconds_count") == samples  # one first token per sample
    assert value(m, "kvcourse_inter_token_latency_seconds_count") == out - samples  # the gaps between the rest
    assert value(m, "kvcourse_time_to_first_token_seconds_sum") > 0
    assert value(m, "kvcourse_forks_total") == 2  # n = 3: two forks of the prefilled prompt
    assert value(m, "kvcourse_requests_finished_total", reason="length") == samples
    prefix = loop.engine.prefix
    assert value(m, "kvcourse_prefix_cache_hits_tokens_total") == prefix.prefix_hit_tokens >= 2 * 16
    assert value(m, "kvcourse_prefix_cache_queries_tokens_total") == prefix.prefill_tokens_total
    assert value(m, "kvcourse_prefix_cache_hit_rate") == pytest.approx(prefix.prefix_hit_tokens / prefix.prefill_tokens_total)
    # Idle: nothing running or waiting, every block free, the keyed ones cached.
    assert value(m, "kvcourse_requests_running") == value(m, "kvcourse_requests_waiting") == 0
    assert value(m, "kvcourse_kv_blocks_used") == value(m, "kvcourse_kv_cache_usage_ratio") == 0
    assert value(m, "kvcourse_kv_blocks_free") == value(m, "kvcourse_kv_blocks_total") == 64
    assert value(m, "kvcourse_kv_blocks_cached") == len(loop.engine.alloc.cached_free) > 0
    assert_no_leak(loop)


@pytest.mark.points(1)
def test_gauges_show_a_running_request_and_preemptions_match_the_engine(embedded_model_dir):
    # 8 blocks of 16 tokens: three requests of ~6 + 40 tokens (3 blocks each) cannot all run at once.
    app, loop, _ = build_server(embedded_model_dir, num_blocks=8, block_size=16, prefix_sharing=False)
    hold_until_queued(loop, 3)  # else, on a busy machine, the first could finish before the third arrives
    with Server(app) as url:
        body = {"prompt": "Blessed are the", "max_tokens": 40, "temperature": 0, "stream": True}
        streams = [httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) for _ in range(3)]
        responses = [s.__enter__() for s in streams]
        lines = [r.iter_lines() for r in responses]
        next(lines[0])  # request 0 has a token: it holds blocks now
        during = scrape(url)
        for it in lines:
            list(it)
        for s in streams:
            s.__exit__(None, None, None)
        wait_idle(loop)
        after = scrape(url)
    assert value(during, "kvcourse_kv_blocks_used") >= 1 and value(during, "kvcourse_requests_running") >= 1
    assert value(during, "kvcourse_kv_cache_usage_ratio") == pytest.approx(
        value(during, "kvcourse_kv_blocks_used") / 8)
    c = loop.engine.preemptor.counters
    assert value(after, "kvcourse_preemptions_total") == c.preempted_recompute + c.preempted_swap >= 1
    assert value(after, "kvcourse_generation_tokens_total") == 3 * 40
    assert_no_leak(loop)


def sample(metrics: ServeMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


# observe_step's contract (lesson §2.6) step by step, with the clock in the test's hands.
@pytest.mark.points(4)
def test_observe_step_keeps_each_rule_of_its_contract():
    for sharing in (True, False):
        check_observe_step(sharing)


def check_observe_step(sharing: bool) -> None:
    m = ServeMetrics()
    r0, r1 = fake_request(group=0), fake_request(group=0, sample=1)  # r1: the fork of r0's prompt
    queued, swapped = fake_request(group=5), fake_request(group=6)
    engine = fake_engine(running=[r0], waiting=[queued], swapped=[swapped], requests={0: r0}, sharing=sharing)
    m.observe_step(engine, {0: 1}, {0: 4.0}, now=10.0)  # r0's first token, 6 s after its arrival
    assert sample(m, "kvcourse_requests_running") == 1  # the running list only
    assert sample(m, "kvcourse_requests_waiting") == 2  # waiting and swapped: neither runs
    admit(engine, 1, r1)
    m.observe_step(engine, {0: 1, 1: 1}, {0: 4.0}, now=11.0)  # r0's second token; the fork's first
    assert sample(m, "kvcourse_forks_total") == (1 if sharing else 0)  # a fork is one only with sharing on
    r0.state, r0.finish_reason = State.FINISHED, "length"
    m.observe_step(engine, {0: 1}, {0: 4.0}, now=14.0)  # r0's third and last token
    assert sample(m, "kvcourse_time_to_first_token_seconds_count") == 2
    assert sample(m, "kvcourse_time_to_first_token_seconds_sum") == pytest.approx(6.0 + 7.0)
    # Inter-token latency: from each token to the next of the same request (1 s, then 3 s).
    assert sample(m, "kvcourse_inter_token_latency_seconds_count") == 2
    assert sample(m, "kvcourse_inter_token_latency_seconds_sum") == pytest.approx(1.0 + 3.0)
    assert sample(m, "kvcourse_generation_tokens_total") == 4
    assert sample(m, "kvcourse_requests_finished_total", reason="length") == 1
    assert m.last_token_at == {1: 11.0}  # the finished request's clock is forgotten; the fork's kept
