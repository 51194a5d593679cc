"""L11 soak over loopback: many requests at once, some hanging up mid-stream, some malformed, on a
pool small enough to preempt; then every block free, every reference count zero, the allocator's
invariants hold, and every greedy answer equals the engine's offline answer for its prompt."""

from __future__ import annotations

import json
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from helpers import budget
from l5_eviction import WorkItem, load_engine_model
from l11_serve import Server, build_server, make_serve_engine
from serve_helpers import TIMEOUT_S, assert_no_leak, sse_chunks, wait_idle

pytestmark = [pytest.mark.l11, pytest.mark.usefixtures("one_torch_thread")]

SYSTEM = "And the LORD spake unto Moses, saying, Speak unto the children of Israel, and say unto them,"
TAILS = ["Blessed are the", "Thus saith the LORD", "Hear, O Israel", "In the beginning", "And it came to pass"]
MAX_TOKENS = 24
BAD_BODIES = [{"max_tokens": -3}, {"temperature": "warm"}, {"prompt": [10**8]}, {"stop": [""]}, {"n": "two"},
              {"max_tokens": 5000}, {"frobnicate": 1}]


def offline_greedy(model_dir, tokenizer, prompts: list[str]) -> dict[str, list[int]]:
    engine = make_serve_engine(load_engine_model(model_dir), 256, 16)
    done = engine.run([WorkItem(tokenizer.encode(p, add_special_tokens=False), MAX_TOKENS) for p in prompts])
    return {p: r.output_ids for p, r in zip(prompts, done.values())}


def one_request(url: str, i: int, seed: int, reference: dict) -> str:
    """Send request i (its kind drawn from seed); check what comes back; return its kind."""
    rng = random.Random(seed * 100_003 + i)
    prompt = SYSTEM + " " + rng.choice(TAILS) if rng.random() < 0.7 else rng.choice(TAILS)
    body = {"prompt": prompt, "max_tokens": rng.randint(1, MAX_TOKENS), "temperature": 0}
    roll = rng.random()
    if roll < 0.1:
        r = httpx.post(f"{url}/v1/completions", json={**body, **rng.choice(BAD_BODIES)}, timeout=TIMEOUT_S)
        assert r.status_code == 400 and "\n" not in r.json()["error"]["message"], r.text
        return "bad"
    if roll < 0.3:  # hang up after a few events
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "max_tokens": MAX_TOKENS, "stream": True,
                                                                "n": rng.randint(1, 3), "temperature": 0.9},
                          timeout=TIMEOUT_S) as r:
            lines = r.iter_lines()
            for _ in range(rng.randint(1, 6)):
                next(lines, None)
        return "disconnect"
    if roll < 0.5:  # sampled, n > 1, maybe a stop string
        body.update(temperature=0.8, n=rng.randint(2, 3), seed=rng.randrange(1000), stop=rng.choice([[], [" the"]]))
    stream = rng.random() < 0.5
    if stream:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT_S) as r:
            assert r.status_code == 200
            chunks = sse_chunks(r.iter_lines())
        assert chunks[-1] == "[DONE]"
        ids, finish = {}, {}
        for c in chunks[:-1]:
            for ch in c["choices"]:
                ids.setdefault(ch["index"], []).extend(ch["token_ids"])
                finish[ch["index"]] = ch["finish_reason"] or finish.get(ch["index"])
        choices = [{"token_ids": ids[k], "finish_reason": finish[k]} for k in sorted(ids)]
    else:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
    assert len(choices) == body.get("n", 1)
    for ch in choices:
        assert ch["finish_reason"] in ("stop", "length") and len(ch["token_ids"]) <= body["max_tokens"]
        if body["temperature"] == 0:
            assert ch["token_ids"] == reference[prompt][:body["max_tokens"]], prompt
    return "sampled" if body["temperature"] else "greedy"


def soak(model_dir, count: int, seed: int) -> Counter:
    app, loop, tok = build_server(model_dir, num_blocks=12, block_size=16, max_waiting=1000)
    prompts = [SYSTEM + " " + t for t in TAILS] + TAILS
    reference = offline_greedy(model_dir, tok, prompts)
    with Server(app) as url, ThreadPoolExecutor(8) as pool:
        kinds = Counter(pool.map(lambda i: one_request(url, i, seed, reference), range(count)))
        wait_idle(loop)
        metrics = httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).text
        pool_page = httpx.get(f"{url}/pool", timeout=TIMEOUT_S).json()
    assert_no_leak(loop)
    assert loop.alive is False  # stopped with the server
    assert pool_page["blocks_used"] == 0 and not pool_page["running"] and not pool_page["waiting"]
    assert loop.engine.preemptor.counters.preempted_recompute > 0  # the pool was tight enough to preempt
    assert "kvcourse_kv_blocks_used 0.0" in metrics
    kinds["preemptions"] = loop.engine.preemptor.counters.preempted_recompute
    print(json.dumps(kinds))  # the figures the lesson quotes: requests, disconnects, bad requests
    return kinds


@pytest.mark.points(2)
def test_soak_with_disconnects_and_bad_requests_leaks_nothing(embedded_model_dir):
    kinds = soak(embedded_model_dir, budget(200, 40), seed=1)
    assert kinds["disconnect"] > 0 and kinds["bad"] > 0 and kinds["greedy"] > 0 and kinds["sampled"] > 0


@pytest.mark.slow
def test_long_soak(embedded_model_dir):
    kinds = soak(embedded_model_dir, 1000, seed=2)
    assert kinds["disconnect"] > 100 and kinds["bad"] > 50
