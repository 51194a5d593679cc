"""L11 in-process (Starlette's test client, no socket): the completions protocol, bad requests,
backpressure, and top_p. The server runs the embedded model and its tokenizer."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
import torch
from starlette.testclient import TestClient

from helpers import hf_ids
from l11_serve import build_server, nucleus
from serve_helpers import TIMEOUT_S, assert_no_leak, sse_chunks, wait_idle

pytestmark = [pytest.mark.l11, pytest.mark.usefixtures("one_torch_thread")]

PROMPT = "O give thanks unto the LORD; for he is good"  # harness.smoke's, no near tie for 24 tokens


@pytest.fixture(scope="module")
def served(embedded_model_dir):
    app, loop, tokenizer = build_server(embedded_model_dir, num_blocks=48, block_size=16)
    with TestClient(app) as client:  # runs the lifespan: the engine thread starts
        yield client, loop, tokenizer


def complete(client, **body):
    return client.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, **body})


def test_greedy_completion_equals_hf_with_text_usage_and_finish(served, embedded_model_dir):
    client, loop, tok = served
    r = complete(client, max_tokens=12)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    assert choice["token_ids"] == hf_ids(embedded_model_dir, prompt_ids, 12)
    assert choice["text"] == tok.decode(choice["token_ids"], skip_special_tokens=True)
    assert choice["finish_reason"] == "length" and body["object"] == "text_completion"
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 12,
                             "total_tokens": len(prompt_ids) + 12}
    # The same prompt as token ids is the same request.
    assert complete(client, prompt=prompt_ids, max_tokens=12).json()["choices"][0]["token_ids"] == choice["token_ids"]
    wait_idle(loop)
    assert_no_leak(loop)


def test_stream_sends_one_event_per_token_then_usage_then_done(served):
    client, loop, _ = served
    whole = complete(client, max_tokens=10).json()["choices"][0]
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "temperature": 0, "max_tokens": 10,
                                                        "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_chunks(r.iter_lines())
    assert chunks[-1] == "[DONE]"
    usage, tokens = chunks[-2], chunks[:-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    assert len(tokens) == 10 and all(len(c["choices"][0]["token_ids"]) == 1 for c in tokens)  # one step, one event
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 9 + ["length"]
    assert sum((c["choices"][0]["token_ids"] for c in tokens), []) == whole["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in tokens) == whole["text"]
    assert len({c["id"] for c in chunks[:-1]}) == 1


BATCH = ["In the beginning God created", [3, 14, 15, 92, 65], PROMPT]  # text, ids, text


def test_a_batch_of_prompts_gives_n_choices_each_numbered_prompt_by_prompt(served, embedded_model_dir):
    """OpenAI's batch form (a list of prompts, as lm-evaluation-harness sends with batch_size > 1):
    prompt k's samples are choices k*n .. k*n + n-1, each greedy one HF's ids for its own prompt,
    whole and streamed, and usage counts every prompt's tokens."""
    client, loop, tok = served
    ids = [tok.encode(p, add_special_tokens=False) if isinstance(p, str) else p for p in BATCH]
    want = [hf_ids(embedded_model_dir, p, 8) for p in ids]
    body = complete(client, prompt=BATCH, max_tokens=8, n=2).json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["token_ids"] for c in body["choices"]] == [w for w in want for _ in range(2)]
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids)) and body["usage"]["completion_tokens"] == 48
    with client.stream("POST", "/v1/completions", json={"prompt": BATCH, "temperature": 0, "max_tokens": 8,
                                                        "n": 2, "stream": True}) as r:
        chunks = sse_chunks(r.iter_lines())[:-1]
    streamed = {i: sum((c["choices"][0]["token_ids"] for c in chunks if c["choices"][0]["index"] == i), [])
                for i in range(6)}
    assert [streamed[i] for i in range(6)] == [w for w in want for _ in range(2)]
    wait_idle(loop)
    assert_no_leak(loop)


def test_a_batch_with_one_prompt_the_engine_refuses_runs_none_of_them(served):
    client, loop, _ = served
    wait_idle(loop)
    before = loop.generated
    r = complete(client, prompt=["And God said", [5] * 700, "Let there be light"], max_tokens=100)  # 50 blocks of 48
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt[1]: ")
    wait_idle(loop)
    assert loop.generated == before  # the accepted prompts were aborted before they decoded a token
    assert_no_leak(loop)


LOGPROB_TOL = 1e-4  # float32 log-softmax of logits that agree with HF's to ~1e-5 on this model


def test_logprobs_are_hfs_log_softmax_with_the_top_k_whole_and_streamed(served, embedded_model_dir):
    """`logprobs: 3`: each generated token's log-probability and the 3 most likely tokens, as HF's
    float32 log_softmax of the logits that chose it; the streamed chunks carry the same values, and
    text_offset counts the tokens' own characters."""
    from harness import hf_reference as hf

    client, loop, tok = served
    ids = tok.encode(PROMPT, add_special_tokens=False)
    body = complete(client, max_tokens=6, logprobs=3).json()
    choice = body["choices"][0]
    want = torch.log_softmax(hf.greedy_step_logits(hf.load_hf_model(str(embedded_model_dir)), ids,
                                                   choice["token_ids"]), dim=-1)
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in choice["token_ids"]]
    for j, token in enumerate(choice["token_ids"]):
        assert abs(lp["token_logprobs"][j] - float(want[j, token])) < LOGPROB_TOL
        top = want[j].topk(3)
        assert list(lp["top_logprobs"][j]) == [tok.decode([t]) for t in top.indices.tolist()]
        assert all(abs(a - b) < LOGPROB_TOL for a, b in zip(lp["top_logprobs"][j].values(), top.values.tolist()))
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(6)]
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "temperature": 0, "max_tokens": 6,
                                                        "logprobs": 3, "stream": True}) as r:
        chunks = [c["choices"][0]["logprobs"] for c in sse_chunks(r.iter_lines())[:-1]]
    assert {k: sum((c[k] for c in chunks), []) for k in lp} == lp
    assert complete(client, max_tokens=2).json()["choices"][0]["logprobs"] is None  # only when asked
    wait_idle(loop)


def test_echo_scores_every_prompt_token_as_hf_does_even_when_the_prompt_is_cached(served, embedded_model_dir):
    """lm-evaluation-harness's loglikelihood request: `echo: true, logprobs: 1, max_tokens: 1` (or 0)
    on context + continuation ids. token_logprobs[0] is null, token_logprobs[p] is HF's float32
    log_softmax at position p - 1 for the prompt's token p. The prompt is cached before it is
    scored, so a hit would skip the very positions asked for: the scoring request takes none."""
    from harness import hf_reference as hf

    client, loop, tok = served
    ids = tok.encode(PROMPT + " and his mercy endureth for ever", add_special_tokens=False)
    with torch.inference_mode():
        model = hf.load_hf_model(str(embedded_model_dir))
        want = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, V]
    assert complete(client, prompt=ids, max_tokens=2).status_code == 200  # now its blocks are cached
    wait_idle(loop)
    hits = loop.engine.prefix.prefix_hit_tokens
    for max_tokens in (1, 0):
        body = complete(client, prompt=ids, max_tokens=max_tokens, echo=True, logprobs=1).json()
        choice = body["choices"][0]
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + max_tokens and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None and lp["tokens"][:len(ids)] == [tok.decode([t]) for t in ids]
        for p in range(1, len(ids)):
            assert abs(lp["token_logprobs"][p] - float(want[p - 1, ids[p]])) < LOGPROB_TOL, p
            (top_text, top_value), = lp["top_logprobs"][p].items()
            assert top_text == tok.decode([int(want[p - 1].argmax())]) and abs(top_value - float(want[p - 1].max())) < LOGPROB_TOL
        assert choice["text"] == tok.decode(ids) + tok.decode(choice["token_ids"], skip_special_tokens=True)
        assert len(choice["token_ids"]) == max_tokens and body["usage"]["completion_tokens"] == max_tokens
    wait_idle(loop)
    assert loop.engine.prefix.prefix_hit_tokens == hits  # neither scoring request took a cached block
    with client.stream("POST", "/v1/completions", json={"prompt": ids, "max_tokens": 1, "echo": True,
                                                        "logprobs": 1, "temperature": 0, "stream": True}) as r:
        chunks = [c["choices"][0] for c in sse_chunks(r.iter_lines())[:-1]]
    assert chunks[0]["text"] == tok.decode(ids) and chunks[0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:len(ids)]
    echoed = complete(client, prompt=ids, max_tokens=2, echo=True).json()["choices"][0]  # no scores: a hit is fine
    assert echoed["logprobs"] is None and echoed["text"].startswith(tok.decode(ids))
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "echo": True})
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]
    wait_idle(loop)
    assert_no_leak(loop)


@pytest.mark.parametrize("sharing", [True, False])
def test_prompt_scores_survive_chunked_prefill_preemption_and_forks(embedded_model_dir, sharing):
    """In the engine: prompts scored in chunks of 16 in a pool of 24 blocks of 4 that preempts, one
    of them cached beforehand and one sampled n = 2. Every score is HF's; every sample carries them."""
    import random

    from harness import hf_reference as hf
    from l5_eviction import load_engine_model
    from l11_serve.engine import ServeItem, make_serve_engine

    model = load_engine_model(embedded_model_dir)
    rng = random.Random(0)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in (40, 33, 17, 70)]
    engine = make_serve_engine(model, 24, 4, prefill_chunk=16, prefix_sharing=sharing)
    engine.add_request(ServeItem(prompts[0], 4))
    engine.run()
    hits = engine.prefix.prefix_hit_tokens
    reqs = [engine.add_request(ServeItem(p, 5, prompt_logprobs=2, n=2 if i == 1 else 1, temperature=0.8 if i == 1 else 0))
            for i, p in enumerate(prompts)]
    engine.run()
    assert engine.preemptor.counters.preempted_recompute > 0 and engine.prefix.prefix_hit_tokens == hits
    hf_model = hf.load_hf_model(str(embedded_model_dir))
    for req, prompt in zip(reqs, prompts):
        with torch.inference_mode():
            want = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
        samples = [r for r in engine.requests.values() if r.group == req.group]
        assert len(samples) == (2 if req is reqs[1] else 1)
        for sample in samples:
            scores = sample.prompt_token_logprobs
            assert len(scores) == len(prompt) and scores[0] is None
            for p in range(1, len(prompt)):
                assert abs(scores[p].logprob - float(want[p - 1, prompt[p]])) < LOGPROB_TOL, (p, sharing)
                assert [t for t, _ in scores[p].top] == want[p - 1].topk(2).indices.tolist()


def test_chat_logprobs_and_top_logprobs_and_a_sampled_fork_gets_its_own(served):
    """Chat's form (`logprobs: true`, `top_logprobs: 2`): per token its text, log-probability and
    UTF-8 bytes; with n = 2 sampled, each sample's logprobs are of its own tokens (the fork's first
    token included, drawn from its parent's row), and equal to those the same tokens get greedily
    where the two agree on the prefix."""
    client, loop, tok = served
    messages = [{"role": "user", "content": "Blessed are the"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "temperature": 0,
                                                  "logprobs": True, "top_logprobs": 20})
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [tok.decode([t]) for t in choice["token_ids"]]
    assert all(c["bytes"] == list(c["token"].encode()) and len(c["top_logprobs"]) == 20 for c in content)
    assert all(c["top_logprobs"][0]["logprob"] == c["logprob"] for c in content)  # greedy: its pick is the top
    # The first row's 20 most likely tokens: where both samples draw their first token from.
    first_row = {e["token"]: e["logprob"] for e in content[0]["top_logprobs"]}
    sampled = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "temperature": 0.8,
                                                        "n": 4, "seed": 7, "logprobs": True}).json()["choices"]
    matched = 0
    for c in sampled:
        entries = c["logprobs"]["content"]
        assert [e["token"] for e in entries] == [tok.decode([t]) for t in c["token_ids"]]
        assert all(e["logprob"] <= 0 and e["top_logprobs"] == [] for e in entries)
        if entries[0]["token"] in first_row:  # samples 1..3 are forks: their first logprob is from the parent's row
            assert abs(entries[0]["logprob"] - first_row[entries[0]["token"]]) < LOGPROB_TOL
            matched += 1
    assert matched >= 3, "the samples' first tokens should mostly lie in the row's top 20"
    r = client.post("/v1/chat/completions", json={"messages": messages, "top_logprobs": 2})
    assert r.status_code == 400 and "top_logprobs needs logprobs: true" in r.json()["error"]["message"]
    wait_idle(loop)


def test_models_health_and_pool_routes(served):
    client, loop, _ = served
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-qwen3-kjv"
    assert client.get("/health").json() == {"status": "ok"}
    wait_idle(loop)
    pool = client.get("/pool").json()
    assert pool["num_blocks"] == len(pool["blocks"]) == 48 and pool["blocks_used"] == 0
    assert {state for state, _, _ in pool["blocks"]} <= {"free", "cached"}
    assert "blocks" not in loop.snapshot  # the per-block walk is made only when /pool asks, not every step
    assert "<title>KV pool" in client.get("/").text


BAD = [  # (body change, words the one-line message must contain)
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n must be"),
    ({"stop": 5}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"max_token": 5}, "unknown field 'max_token'"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": [1, "a"]}, "prompt must be a list of integer"),
    ({"prompt": [10**9]}, "outside the vocabulary"),
    ({"prompt": ["And God said", ""]}, "prompt[1] is empty"),
    ({"prompt": ["And God said", [10**9]]}, "prompt[1]: "),  # the engine's verdict, on the batch's second prompt
    ({"prompt": ["a"] * 65}, "at most 64 prompts"),
    ({"max_tokens": 2040}, "positions"),  # the context: 2048 positions
    ({"prompt": [5] * 700, "max_tokens": 100}, "blocks"),  # 50 blocks: this pool of 48 can never hold it
    ({"model": "gpt-4"}, "not served here"),
    ({"logprobs": 21}, "logprobs must be an integer in 0..20"),
    ({"echo": "yes"}, "echo must be true or false"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),  # 0 only with echo (scoring the prompt)
    ({"suffix": "amen"}, "not supported"),
    ({"top_k": -2}, "top_k must be an integer >= -1"),  # vLLM: -1 or 0 is off, else at least 1
    ({"top_k": 2.5}, "top_k"),
    ({"min_p": 1.5}, "min_p must be a number in [0.0, 1.0]"),
    ({"min_p": -0.1}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a number in (0.0, 2.0]"),
    ({"min_tokens": 5}, "min_tokens must be an integer in 0..4"),  # more than max_tokens (4)
    ({"seed": -1}, "seed must be an integer"),
    ({"use_beam_search": True}, "not supported"),  # vLLM's extras: accepted at their defaults only
    ({"guided_json": {"type": "object"}}, "not supported"),
]


@pytest.mark.parametrize("change, words", BAD, ids=[next(iter(c)) + str(i) for i, (c, _) in enumerate(BAD)])
def test_bad_request_is_a_400_with_one_line_and_the_engine_keeps_serving(served, change, words):
    client, loop, _ = served
    r = complete(client, **{"max_tokens": 4, **change})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and "\n" not in error["message"]
    assert error["type"] == "invalid_request_error"
    assert complete(client, max_tokens=2).status_code == 200  # still serving
    wait_idle(loop)
    assert_no_leak(loop)


def test_body_that_is_not_json_is_a_400(served):
    client, _, _ = served
    r = client.post("/v1/completions", content=b"{prompt:", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_full_waiting_queue_answers_429_with_an_openai_error_then_recovers(embedded_model_dir):
    app, loop, _ = build_server(embedded_model_dir, num_blocks=16, max_waiting=1)
    release = threading.Event()
    real_step = loop.engine.step

    def held_step():  # the first step waits until the test lets it go: the request stays waiting
        assert release.wait(TIMEOUT_S)
        return real_step()

    loop.engine.step = held_step
    with TestClient(app) as client:
        first = {}
        worker = threading.Thread(target=lambda: first.update(r=complete(client, max_tokens=3)))
        worker.start()
        while client.get("/pool").json()["waiting_http"] < 1:
            assert worker.is_alive()
        r = complete(client, max_tokens=3)
        while not loop.snapshot["waiting"]:  # published just before the held step begins
            time.sleep(0.01)
        started = time.monotonic()
        held = client.get("/pool").json()  # the engine thread is mid-step: the counts, without the blocks
        assert held["blocks"] is None and held["waiting_http"] == 1 and time.monotonic() - started < 5
        release.set()
        worker.join(TIMEOUT_S)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        assert "retry" in r.json()["error"]["message"] and r.headers["retry-after"] == "1"
        assert first["r"].status_code == 200
        assert complete(client, max_tokens=3).status_code == 200  # room again
        assert 'kvcourse_requests_rejected_total{reason="overloaded"} 1.0' in client.get("/metrics").text
        wait_idle(loop)
        assert_no_leak(loop)
        assert loop.alive and len(client.get("/pool").json()["blocks"]) == 16  # the poll that gave up hurt nothing


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    import torch

    row = torch.log(torch.tensor([0.5, 0.05, 0.3, 0.15]))
    kept = nucleus(row, 1.0, 0.8).isfinite().tolist()
    assert kept == [True, False, True, False]  # 0.5 + 0.3 reach 0.8
    assert nucleus(row, 1.0, 0.81).isfinite().tolist() == [True, False, True, True]
    assert nucleus(row, 1.0, 1e-6).isfinite().sum() == 1  # only the top token: greedy


def test_tiny_top_p_sampling_is_greedy(served):
    client, _, _ = served
    greedy = complete(client, max_tokens=8).json()["choices"][0]["token_ids"]
    sampled = complete(client, max_tokens=8, temperature=1.5, top_p=1e-6, seed=3).json()["choices"][0]
    assert sampled["token_ids"] == greedy


def test_a_model_without_a_tokenizer_takes_ids_and_says_what_needs_text(tiny_model_dir):
    app, loop, tokenizer = build_server(tiny_model_dir, num_blocks=16, block_size=4)
    assert tokenizer is None
    with TestClient(app) as client:
        ok = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 4
        assert ok.json()["choices"][0]["text"] == ""  # no tokenizer: ids only
        for body, words in [({"prompt": "text"}, "no tokenizer"), ({"prompt": [1, 2], "stop": ["x"]}, "stop_token_ids")]:
            r = client.post("/v1/completions", json={"max_tokens": 4, **body})
            assert r.status_code == 400 and words in r.json()["error"]["message"]
        wait_idle(loop)
        assert_no_leak(loop)


def test_a_failure_while_making_the_text_is_a_500_that_names_it_and_the_server_goes_on(served, monkeypatch):
    """Not the client's fault, so not a 499: a whole completion is a 500 with the error's line, a
    stream ends with an OpenAI-style error event; the samples are aborted and the next request works."""
    client, loop, _ = served

    def feed(self, token_ids):
        raise RuntimeError("the detokenizer broke")

    monkeypatch.setattr("l11_serve.app.StopMatcher.feed", feed)
    r = complete(client, max_tokens=6)
    assert r.status_code == 500 and r.json()["error"]["message"] == "the server failed: RuntimeError: the detokenizer broke"
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "temperature": 0, "max_tokens": 6,
                                                        "stream": True}) as streamed:
        chunks = sse_chunks(streamed.iter_lines())
    assert chunks == [{"error": {"message": "the server failed: RuntimeError: the detokenizer broke",
                                 "type": "server_error", "param": None, "code": None}}]
    wait_idle(loop)
    assert_no_leak(loop)
    monkeypatch.undo()
    assert complete(client, max_tokens=4).json()["choices"][0]["finish_reason"] == "length"


def test_n_2_streams_one_choice_per_chunk_and_every_sample_arrives(served):
    """As OpenAI and vLLM send: each event carries one choice; reading `choices[0]` of every chunk
    (what the lesson's example does) collects both samples whole."""
    client = served[0]
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 6, "n": 2}
    whole = client.post("/v1/completions", json=body).json()
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as streamed:
        chunks = sse_chunks(streamed.iter_lines())
    assert chunks[-1] == "[DONE]"
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        assert len(chunk["choices"]) == 1, chunk
        texts[chunk["choices"][0]["index"]] += chunk["choices"][0]["text"]
    assert [texts[0], texts[1]] == [c["text"] for c in whole["choices"]]


def test_an_error_body_has_openais_shape_with_a_null_code(served):
    r = served[0].post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] is None and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


# ---------------------------------------------------------------- robust at the door (issue 33's probe)

BAD_BODIES = {
    "not UTF-8": b'{"prompt": "\xff\xfe", "max_tokens": 2}',
    "a lone surrogate in the prompt": b'{"prompt": "Blessed \\ud800", "max_tokens": 2}',
    "a lone surrogate in a stop string": b'{"prompt": "Blessed", "stop": ["\\udfff"], "max_tokens": 2}',
    "100,000-deep nesting": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "a 5,000-digit integer": b'{"prompt": "Blessed", "max_tokens": ' + b"9" * 5000 + b"}",
    "17 stop strings": json.dumps({"prompt": "Blessed", "stop": [f"s{i}" for i in range(17)]}).encode(),
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_a_body_that_cannot_be_a_request_is_a_json_400(served, name):
    client, loop, _ = served
    r = client.post("/v1/completions", content=BAD_BODIES[name], headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text[:300]
    assert complete(client, max_tokens=2).status_code == 200  # and the server goes on


def test_a_body_over_the_limit_is_a_413_before_it_is_read(served):
    from l11_serve.app import MAX_BODY_BYTES

    client = served[0]
    r = client.post("/v1/completions", content=b"x" * (MAX_BODY_BYTES + 1), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/chat/nothing", 404), ("GET", "/nope", 404),
                                                ("GET", "/v1/completions", 405), ("DELETE", "/v1/models", 405)])
def test_unknown_routes_and_methods_answer_in_openais_error_shape(served, method, path, status):
    r = served[0].request(method, path)
    assert r.status_code == status and r.headers["content-type"].startswith("application/json")
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_one_model_by_id_and_a_request_id_on_every_answer(served):
    client, loop, _ = served
    listed = client.get("/v1/models").json()["data"][0]
    assert client.get(f"/v1/models/{listed['id']}").json() == listed
    assert client.get("/v1/models/another-model").status_code == 404
    mine = client.get("/health", headers={"x-request-id": "trace-42"})
    assert mine.headers["x-request-id"] == "trace-42"
    assert len(client.get("/health").headers["x-request-id"]) == 32


def test_max_waiting_is_a_bound_under_a_burst(embedded_model_dir):
    """20 requests at once with --max-waiting 2: the check and the count used to straddle an await,
    and 12-13 got in. Now at most 2 are admitted while none has its first token yet."""
    import asyncio

    import httpx

    app, loop, _ = build_server(embedded_model_dir, num_blocks=64, block_size=16, max_waiting=2)
    real_step = loop._step
    loop._step = lambda: (time.sleep(0.05), real_step())  # slow steps: the burst lands before any token

    async def burst():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
            return await asyncio.gather(*[client.post("/v1/completions", json=body, timeout=TIMEOUT_S)
                                          for _ in range(20)])

    with TestClient(app):  # the lifespan: the engine thread runs
        answers = asyncio.run(burst())
    codes = sorted(r.status_code for r in answers)
    assert codes.count(200) <= 2 and codes.count(429) >= 18, codes


def test_tokenize_and_detokenize_in_vllms_shape(served):
    client, loop, tok = served
    r = client.post("/tokenize", json={"prompt": PROMPT}).json()
    assert r["tokens"] == tok.encode(PROMPT, add_special_tokens=False) and r["count"] == len(r["tokens"])
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": tok.decode(r["tokens"])}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Amen"}]}).json()["tokens"]
    assert tok.decode(chat) == "user: Amen\nassistant:"
    for path, body in (("/tokenize", {"prompt": 3}), ("/detokenize", {"tokens": [-1]}), ("/detokenize", {})):
        assert client.post(path, json=body).status_code == 400


# ---------------------------------------------------------------- sampling options, against direct computations


def _hf_penalised_greedy(model_dir, prompt: list[int], n: int, presence=0.0, frequency=0.0, repetition=1.0):
    """Greedy decoding with the penalties applied to HF's logits by their published rules
    (OpenAI: presence once per generated id, frequency per occurrence; vLLM/CTRL: a seen id's
    logit divided by r if positive, multiplied if not), written here independently of the engine."""
    from collections import Counter

    from harness import hf_reference as hf

    model, out = hf.load_hf_model(str(model_dir)), []
    for _ in range(n):
        row = hf.hf_logits(model, prompt + out)[-1].double()
        for t in set(prompt) | set(out):
            row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
        for t, c in Counter(out).items():
            row[t] -= presence + frequency * c
        out.append(int(row.argmax()))
    return out


@pytest.mark.parametrize("penalties", [dict(presence_penalty=1.5), dict(frequency_penalty=0.7),
                                       dict(repetition_penalty=1.8), dict(presence_penalty=-0.5, frequency_penalty=1.2),
                                       dict(repetition_penalty=1.0, presence_penalty=0, frequency_penalty=0)])
def test_penalties_follow_their_published_rules(served, embedded_model_dir, penalties):
    client, _, tok = served
    prompt = tok.encode(PROMPT, add_special_tokens=False)
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0, **penalties}).json()
    ids = r["choices"][0]["token_ids"]
    want = _hf_penalised_greedy(embedded_model_dir, prompt, 24, penalties.get("presence_penalty", 0.0),
                                penalties.get("frequency_penalty", 0.0), penalties.get("repetition_penalty", 1.0))
    assert ids == want[:len(ids)] and len(ids) == 24, (ids, want)
    if any(v not in (0, 1.0) for v in penalties.values()):  # the penalty changed the text: it was applied
        assert want != _hf_penalised_greedy(embedded_model_dir, prompt, 24)


@pytest.fixture(scope="module")
def eos_model(embedded_model_dir, tmp_path_factory):
    """The embedded model with its EOS id moved to the id greedy decoding picks 3rd for PROMPT."""
    import shutil

    from transformers import AutoTokenizer

    from harness import hf_reference as hf

    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir))
    prompt = tok.encode(PROMPT, add_special_tokens=False)
    free = _hf_penalised_greedy(embedded_model_dir, prompt, 12)
    eos = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i])
    folder = tmp_path_factory.mktemp("eos") / "model"
    shutil.copytree(embedded_model_dir, folder)
    for name in ("config.json", "generation_config.json"):
        raw = json.loads((folder / name).read_text())
        raw["eos_token_id"] = eos
        (folder / name).write_text(json.dumps(raw))
    return folder, prompt, eos, free, hf


def test_ignore_eos_and_min_tokens_equal_hf(eos_model):
    """Against HF on the same folder: greedy stops at the EOS id; ignore_eos follows HF's argmax path
    through it (HF's generate cannot be told to ignore a configured EOS, so its step-by-step argmax
    is the oracle); min_tokens equals HF generate's min_new_tokens."""
    folder, prompt, eos, free, hf = eos_model
    from transformers import GenerationConfig

    model = hf.load_hf_model(str(folder))

    def hf_generate(**kwargs):
        config = GenerationConfig(max_new_tokens=12, do_sample=False, pad_token_id=0, **kwargs)
        ids = torch.tensor([prompt])
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)[0, len(prompt):].tolist()

    app, loop, _ = build_server(folder, num_blocks=32, block_size=16)
    with TestClient(app) as client:
        def ours(**body):
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0, **body}).json()
            return r["choices"][0]["token_ids"], r["choices"][0]["finish_reason"]

        plain, reason = ours()
        assert plain == hf_generate(eos_token_id=eos) and plain[-1] == eos and reason == "stop"
        kept_on, reason = ours(ignore_eos=True)
        assert kept_on == free and reason == "length"  # HF's argmax path, EOS treated as any id
        late, _ = ours(min_tokens=6)
        assert late == hf_generate(eos_token_id=eos, min_new_tokens=6) and len(late) > len(plain)
        assert eos not in late[:6]
        assert client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "min_tokens": 5}).status_code == 400


def test_usage_is_null_in_every_chunk_but_the_last_or_running_when_asked(served):
    client = served[0]
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}

    def chunks(options):
        with client.stream("POST", "/v1/completions", json={**body, "stream_options": options}) as r:
            return sse_chunks(r.iter_lines())[:-1]

    plain = chunks({"include_usage": True})
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 4
    running = [c["usage"]["completion_tokens"] for c in chunks({"continuous_usage_stats": True})]
    # A running count in every chunk. Tokens that arrive while the reader lags share a chunk (as in
    # vLLM, whose output collector merges them), so the count may step by more than one.
    assert running == sorted(running) and running[0] >= 1 and running[-1] == 4, running


def test_a_client_gone_before_its_body_arrived_is_no_traceback(served, caplog):
    """The ASGI receive reports a disconnect while the body is read: an abort of nothing, quietly."""
    import asyncio

    client, loop, _ = served
    app = client.app
    sent = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "headers": [(b"content-type", b"application/json"), (b"content-length", b"50")],
             "http_version": "1.1", "scheme": "http", "server": ("test", 80), "client": ("test", 1), "root_path": "",
             "app": app}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 499 and "Traceback" not in caplog.text
    assert complete(client, max_tokens=2).status_code == 200


def test_the_default_queue_takes_a_load_generators_connections():
    from l11_serve.server import default_max_waiting

    assert default_max_waiting(512) >= 512 and default_max_waiting(4) == 64


def test_parsing_and_tokenizing_run_off_the_event_loop(served, monkeypatch):
    """So that a huge prompt never holds every other stream: the parse (tokenizer included) runs
    on a worker thread, not on the event loop's thread that serves the streams."""
    import l11_serve.app as app_module

    client = served[0]
    threads = {}
    real_parse, real_body = app_module.parse_completion, app_module._body_within_limit

    def recording_parse(body, tokenizer, name):
        threads["parse"] = threading.current_thread()
        return real_parse(body, tokenizer, name)

    async def recording_body(request):
        threads["loop"] = threading.current_thread()  # an async function: it runs on the loop
        return await real_body(request)

    monkeypatch.setattr(app_module, "parse_completion", recording_parse)
    monkeypatch.setattr(app_module, "_body_within_limit", recording_body)
    assert complete(client, max_tokens=2).status_code == 200
    assert threads["parse"] is not threads["loop"]


# ---------------------------------------------------------------- issue 53: errors and finishes counted as what they are


def _sample(loop, name: str, **labels) -> float:
    return loop.metrics.registry.get_sample_value(name, labels) or 0.0


def test_every_400_says_its_own_line_and_is_counted_as_a_bad_request(served):
    """An InputError is a ValueError: caught after `except ValueError` it read "the body cannot be
    read as a completion request (InputError: ...)" and went uncounted (about 60 bad requests
    showed as 10). Each 400 now carries its own line and counts once in rejected{bad_request}."""
    client, loop, _ = served
    before = _sample(loop, "kvcourse_requests_rejected_total", reason="bad_request")
    for change, words in BAD:
        r = complete(client, **{"max_tokens": 4, **change})
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and words in message and "cannot be read" not in message, message
    for raw in (b"{prompt:", BAD_BODIES["not UTF-8"], BAD_BODIES["a 5,000-digit integer"]):
        assert client.post("/v1/completions", content=raw, headers={"content-type": "application/json"}).status_code == 400
    assert _sample(loop, "kvcourse_requests_rejected_total", reason="bad_request") == before + len(BAD) + 3
    wait_idle(loop)


def test_a_sample_ended_by_its_stop_string_is_counted_as_stop_not_aborted(served):
    client, loop, _ = served
    free = complete(client, max_tokens=16).json()["choices"][0]["text"]
    stop = free[free.index(" ", 3):][:4]
    wait_idle(loop)
    stopped, aborted = (_sample(loop, "kvcourse_requests_finished_total", reason=r) for r in ("stop", "aborted"))
    whole = complete(client, max_tokens=16, stop=[stop]).json()["choices"][0]
    streamed = sse_chunks(complete(client, max_tokens=16, stop=[stop], stream=True).iter_lines())
    assert whole["finish_reason"] == streamed[-2]["choices"][0]["finish_reason"] == "stop"
    wait_idle(loop)
    assert _sample(loop, "kvcourse_requests_finished_total", reason="stop") == stopped + 2
    assert _sample(loop, "kvcourse_requests_finished_total", reason="aborted") == aborted


# ---------------------------------------------------------------- issue 53: seeds of a batch


def test_a_batch_without_a_seed_samples_every_prompt_on_its_own(served):
    """Four equal prompts at T = 1 without a seed: one seed for the whole request gave all four
    the same draws, so the same text. Each prompt now draws its own seed, as vLLM samples them."""
    client, loop, _ = served
    body = {"prompt": [PROMPT] * 4, "max_tokens": 12, "temperature": 1.0}
    texts = [c["text"] for c in client.post("/v1/completions", json=body).json()["choices"]]
    assert len(set(texts)) >= 3, texts
    wait_idle(loop)


def test_a_seeded_batch_repeats_and_choice_c_draws_with_seed_plus_c(served):
    """With a seed, choice c of the response (prompt c // n, sample c % n) draws with seed + c:
    the same request gives the same choices, and each equals a one-prompt request seeded seed + c."""
    client, loop, _ = served
    ask = {"prompt": [PROMPT, "And God said", PROMPT], "n": 2, "max_tokens": 8, "temperature": 1.0, "seed": 11}
    first = [c["token_ids"] for c in client.post("/v1/completions", json=ask).json()["choices"]]
    again = [c["token_ids"] for c in client.post("/v1/completions", json=ask).json()["choices"]]
    assert first == again and first[0] != first[4]  # prompts 0 and 2 are equal, their draws are not
    for c, ids in enumerate(first):
        alone = {"prompt": ask["prompt"][c // 2], "max_tokens": 8, "temperature": 1.0, "seed": 11 + c}
        assert client.post("/v1/completions", json=alone).json()["choices"][0]["token_ids"] == ids, c
    r = client.post("/v1/completions", json={**ask, "seed": 2**64 - 3})  # choice 5 would draw with 2**64 + 2
    assert r.status_code == 400 and "seed" in r.json()["error"]["message"]
    wait_idle(loop)


# ---------------------------------------------------------------- issue 53: how long a request runs by default


def test_chat_without_max_tokens_runs_to_the_context_end_and_completions_default_to_16(embedded_model_dir):
    """vLLM's defaults: chat (and completions with `max_tokens: null`) run to EOS, a stop or the end
    of the context: max_model_len minus the prompt; completions without the field make 16 tokens
    (OpenAI's legacy default, vLLM's too). Here the pool (8 blocks of 16) is smaller than the
    model's 2,048 positions, so a request's end is 8 * 16 + 1 = 129 positions (its last token is
    never written), which /v1/models reports as max_model_len."""
    app, loop, _ = build_server(embedded_model_dir, num_blocks=8, block_size=16)
    messages = [{"role": "user", "content": "Blessed are the"}]
    with TestClient(app) as client:
        assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 129
        for path, body in (("/v1/chat/completions", {"messages": messages}),
                           ("/v1/completions", {"prompt": PROMPT, "max_tokens": None}),
                           ("/v1/responses", {"input": "Blessed are the"})):
            r = client.post(path, json={"temperature": 0, **body}).json()
            usage = r["usage"]
            total = usage.get("total_tokens")
            finish = r["choices"][0]["finish_reason"] if "choices" in r else r["status"]
            assert total == 129 and finish in ("length", "incomplete"), (path, usage, finish)
        r = client.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0}).json()
        assert r["usage"]["completion_tokens"] == 16 and r["choices"][0]["finish_reason"] == "length"
        wait_idle(loop)
        assert_no_leak(loop)


# ---------------------------------------------------------------- issue 53: vLLM's sampling fields


def test_top_k_1_and_min_p_1_sample_the_greedy_tokens(served):
    """top_k 1 keeps only the most likely token, and so does min_p 1: sampled at T = 1.5 with any
    seed, the tokens are greedy's. top_k -1 and 0 (vLLM's "off") and min_p 0 change nothing."""
    client, loop, _ = served
    greedy = complete(client, max_tokens=10).json()["choices"][0]["token_ids"]
    for cut in ({"top_k": 1}, {"min_p": 1.0}, {"top_k": 1, "min_p": 0.5, "top_p": 0.9}):
        r = complete(client, max_tokens=10, temperature=1.5, seed=3, n=2, **cut).json()
        assert [c["token_ids"] for c in r["choices"]] == [greedy, greedy], cut
    plain = complete(client, max_tokens=10, temperature=1.0, seed=4).json()["choices"][0]["token_ids"]
    for off in ({"top_k": -1}, {"top_k": 0}, {"min_p": 0}):
        assert complete(client, max_tokens=10, temperature=1.0, seed=4, **off).json()["choices"][0]["token_ids"] == plain
    wait_idle(loop)


@pytest.mark.parametrize("cut", [{"top_k": 3}, {"min_p": 0.2}, {"top_k": 5, "min_p": 0.1}])
def test_sampled_tokens_lie_within_top_k_and_min_p_of_hfs_logits(served, embedded_model_dir, cut):
    """Every token sampled (T = 1, 4 samples of 10 tokens, chat and completions) is one the cut
    keeps, by HF's logits for its prefix: among the top_k largest, and with a probability at least
    min_p times the largest. And the draws are not all greedy: the cut still samples."""
    from harness import hf_reference as hf

    client, loop, tok = served
    model = hf.load_hf_model(str(embedded_model_dir))
    prompt = tok.encode(PROMPT, add_special_tokens=False)
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 1.0, "n": 4, "seed": 21, **cut}
    choices = client.post("/v1/completions", json=body).json()["choices"]
    off_greedy = 0
    for c in choices:
        for j, token in enumerate(c["token_ids"]):
            row = hf.hf_logits(model, prompt + c["token_ids"][:j])[-1].double()
            if "top_k" in cut:  # ties with the k-th included; 1e-4: our logits and HF's differ by ~1e-5
                assert row[token] >= row.topk(cut["top_k"]).values[-1] - 1e-4, (j, token)
            if "min_p" in cut:
                probs = torch.softmax(row, dim=-1)
                assert probs[token] >= cut["min_p"] * probs.max() * (1 - 1e-3), (j, token)
            off_greedy += token != int(row.argmax())
    assert off_greedy > 0
    chat = {"messages": [{"role": "user", "content": "Blessed"}], "max_tokens": 4, "temperature": 1.0, **cut}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    wait_idle(loop)


def test_truncated_keeps_what_vllms_rules_keep():
    """`truncated` (min_p, then top_k, then top_p over what is left) against the rules computed
    here one token at a time, on random rows."""
    from l11_serve import truncated

    import random

    gen, rng = torch.Generator().manual_seed(0), random.Random(0)
    for trial in range(300):
        row = torch.randn(50, generator=gen) * 3
        T, k = rng.choice([0.5, 1.0, 1.7]), rng.choice([0, 1, 4, 10, 60])
        min_p, top_p = rng.choice([0.0, 0.05, 0.3]), rng.choice([1.0, 0.9, 0.5])
        logits = [float(x) / T for x in row]
        best = max(logits)
        keep = [math.exp(l - best) >= min_p for l in logits]  # p_i / p_max = exp(l_i - l_max)
        if k:
            kth = sorted(row.tolist(), reverse=True)[min(k, 50) - 1]
            keep = [kept and float(x) >= kth for kept, x in zip(keep, row)]
        kept_mass = sum(math.exp(l - best) for l, kept in zip(logits, keep) if kept)
        order = sorted((i for i in range(50) if keep[i]), key=lambda i: -logits[i])
        above, nucleus_set = 0.0, set()
        for i in order:  # the smallest set of most likely tokens whose mass reaches top_p
            if above < top_p:
                nucleus_set.add(i)
            above += math.exp(logits[i] - best) / kept_mass
        want = [i in nucleus_set for i in range(50)]
        assert truncated(row, T, k, min_p, top_p).isfinite().tolist() == want, (trial, k, min_p, top_p)


def test_vllms_harmless_extras_are_accepted_at_their_defaults(served):
    """What vLLM's clients send along (its defaults, a request_id) changes nothing; a typo is still
    refused (vLLM would log it and sample with the default)."""
    client, loop, _ = served
    plain = complete(client, max_tokens=6).json()["choices"][0]["token_ids"]
    extras = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "use_beam_search": False,
              "length_penalty": 1.0, "include_stop_str_in_output": False, "skip_special_tokens": True,
              "spaces_between_special_tokens": True, "prompt_logprobs": None, "priority": 0,
              "request_id": "trace-7", "allowed_token_ids": None, "bad_words": [], "add_special_tokens": False}
    assert complete(client, max_tokens=6, **extras).json()["choices"][0]["token_ids"] == plain
    chat = {"messages": [{"role": "user", "content": "Amen"}], "max_tokens": 3, "temperature": 0}
    chat_extras = {**extras, "add_generation_prompt": True, "continue_final_message": False, "chat_template_kwargs": {},
                   "stop_token_ids": [], "include_reasoning": True}
    del chat_extras["add_special_tokens"]
    assert client.post("/v1/chat/completions", json={**chat, **chat_extras}).status_code == 200
    r = complete(client, max_tokens=6, top_kk=5)
    assert r.status_code == 400 and "unknown field 'top_kk'" in r.json()["error"]["message"]
    wait_idle(loop)


# ---------------------------------------------------------------- issue 53: /v1/responses, text only


def test_responses_answers_text_as_chat_would_and_the_openai_client_reads_it(served):
    """A string input is one user message; `instructions` a system message before the list of
    messages; the text equals chat's for the same messages, and OpenAI's client reads output_text.
    Streaming, tools and stored responses are refused with a 400 that names the field."""
    openai = pytest.importorskip("openai")
    client, loop, _ = served
    messages = [{"role": "system", "content": "Speak as the preacher."},
                {"role": "user", "content": "Vanity of vanities"}]
    chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0}).json()
    want = chat["choices"][0]["message"]["content"]
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
    answer = sdk.responses.create(model="tiny-qwen3-kjv", instructions=messages[0]["content"],
                                  input=[{"role": "user", "content": [{"type": "input_text", "text": "Vanity of vanities"}]}],
                                  max_output_tokens=8, temperature=0)
    assert answer.output_text == want and answer.status == "incomplete"  # max_output_tokens ran out
    assert answer.usage.input_tokens == chat["usage"]["prompt_tokens"] and answer.usage.output_tokens == 8
    one = client.post("/v1/responses", json={"input": "Vanity of vanities", "max_output_tokens": 8, "temperature": 0})
    alone = client.post("/v1/chat/completions", json={"messages": messages[1:], "max_tokens": 8, "temperature": 0})
    assert one.json()["output"][0]["content"][0]["text"] == alone.json()["choices"][0]["message"]["content"]
    for body, words in (({"input": "x", "stream": True}, "/v1/chat/completions"),
                        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
                        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
                        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
                        ({"inputs": "x"}, "unknown field 'inputs'")):
        r = client.post("/v1/responses", json=body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (body, r.text)
    wait_idle(loop)
    assert_no_leak(loop)


# ---------------------------------------------------------------- issue 53: a long stream's text


def test_a_long_stream_sends_the_whole_decode_of_its_ids(served):
    """700 tokens streamed (the incremental detokenizer's windows, sampled so that rare tokens and
    split characters come up): the chunks' texts joined are the decode of the chunks' ids."""
    client, loop, tok = served
    body = {"prompt": PROMPT, "max_tokens": 700, "temperature": 1.3, "seed": 5, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        chunks = [c["choices"][0] for c in sse_chunks(r.iter_lines())[:-1]]
    ids = sum((c["token_ids"] for c in chunks), [])
    assert len(ids) == 700 or chunks[-1]["finish_reason"] == "stop"
    assert "".join(c["text"] for c in chunks) == tok.decode(ids, skip_special_tokens=True)
    wait_idle(loop)
