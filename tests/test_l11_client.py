"""L11 over loopback (127.0.0.1, a free port) with the real `openai` client: the text equals the
engine's offline output and the ids HF's greedy ids; seeded samples repeat; streams interleave;
a client that hangs up gives every block back; SIGTERM stops the server cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from helpers import hf_ids
from l5_eviction import WorkItem, load_engine_model
from l11_serve import Server, build_server, make_serve_engine
from l11_serve.server import free_port
from probes_l11 import slow_steps
from serve_helpers import TIMEOUT_S, assert_no_leak, sse_chunks, wait_idle

pytestmark = [pytest.mark.l11, pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = ["Blessed are the", "Thus saith the LORD"]  # harness.smoke's: no near tie for 24 tokens
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(embedded_model_dir):
    app, loop, tokenizer = build_server(embedded_model_dir, num_blocks=64, block_size=16)
    with Server(app) as url:  # stopped and joined when the module's tests are done, whatever happened
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
        yield url, client, loop, tokenizer


def offline_text(model_dir, tokenizer, prompt_ids: list[int], n: int) -> str:
    """The same request through the engine alone, no server: what the server must return."""
    engine = make_serve_engine(load_engine_model(model_dir), 64, 16)
    (req,) = engine.run([WorkItem(prompt_ids, n)]).values()
    return tokenizer.decode(req.output_ids, skip_special_tokens=True)


def test_openai_client_text_equals_engine_offline_and_ids_equal_hf(server, embedded_model_dir):
    url, client, loop, tok = server
    for prompt in PROMPTS:
        ids = tok.encode(prompt, add_special_tokens=False)
        whole = client.completions.create(model="tiny-qwen3-kjv", prompt=prompt, max_tokens=16, temperature=0)
        streamed = client.completions.create(model="tiny-qwen3-kjv", prompt=prompt, max_tokens=16,
                                             temperature=0, stream=True)
        chunks = list(streamed)
        text = "".join(c.choices[0].text for c in chunks)
        assert whole.choices[0].text == text == offline_text(embedded_model_dir, tok, ids, 16)
        assert whole.choices[0].token_ids == hf_ids(embedded_model_dir, ids, 16)
        assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "length"
        assert whole.usage.completion_tokens == 16 and whole.usage.prompt_tokens == len(ids)
    wait_idle(loop)
    assert_no_leak(loop)


def test_three_seeded_samples_are_reproducible(server):
    _, client, loop, _ = server
    ask = dict(model="tiny-qwen3-kjv", prompt=PROMPTS[0], max_tokens=12, temperature=1.0, n=3)
    first = client.completions.create(seed=7, **ask)
    again = client.completions.create(seed=7, **ask)
    other = client.completions.create(seed=8, **ask)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert texts != [c.text for c in sorted(other.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # three draws, not one copied
    assert first.usage.completion_tokens == sum(len(c.token_ids) for c in first.choices)
    wait_idle(loop)
    assert_no_leak(loop)


def test_concurrent_streams_interleave(server):
    _, client, loop, _ = server
    order, lock = [], threading.Lock()

    def stream(tag: str) -> None:
        for _ in client.completions.create(model="tiny-qwen3-kjv", prompt=PROMPTS[tag == "b"], max_tokens=30,
                                           temperature=0, stream=True):
            with lock:
                order.append(tag)

    workers = [threading.Thread(target=stream, args=(tag,)) for tag in "ab"]
    for w in workers:
        w.start()
    for w in workers:
        w.join(TIMEOUT_S)
    assert order.count("a") == order.count("b") == 30
    last_a, first_b = max(i for i, t in enumerate(order) if t == "a"), order.index("b")
    last_b, first_a = max(i for i, t in enumerate(order) if t == "b"), order.index("a")
    assert first_b < last_a and first_a < last_b  # neither waited for the other to finish
    wait_idle(loop)
    assert_no_leak(loop)


@pytest.mark.points(2)
def test_a_client_that_hangs_up_mid_stream_gives_every_block_back(server):
    check_a_hang_up_mid_stream(server)


def check_a_hang_up_mid_stream(server) -> None:
    url, _, loop, _ = server
    wait_idle(loop)
    aborted = _aborted_total(url)
    before = loop.generated
    # n = 3: samples 1 and 2 are forks with request ids of their own; all three must stop.
    body = {"prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0.8, "n": 3, "seed": 5,
            "stream": True}  # the pool holds 1024 tokens: the 3 samples share the prompt's block
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(18)]  # a few steps of 3 samples (one event each, blank lines between)
        assert loop.snapshot["blocks_used"] > 0 and any(line.startswith("data: ") for line in got)
    wait_idle(loop)
    assert_no_leak(loop)
    assert loop.generated - before < 300  # stopped long before 3 x 900 tokens
    assert _aborted_total(url) == aborted + 3


def _aborted_total(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).text.splitlines():
        if line.startswith('kvcourse_requests_finished_total{reason="aborted"}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.points(1)
def test_a_client_that_gives_up_on_a_whole_completion_gives_every_block_back(server):
    url, _, loop, _ = server
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 900, "temperature": 0},
                   timeout=httpx.Timeout(TIMEOUT_S, read=0.5))
    wait_idle(loop)
    assert_no_leak(loop)


@pytest.mark.points(1)
def test_a_stop_string_ends_one_sample_and_the_others_run_on(server):
    url, _, loop, tok = server
    free = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0},
                      timeout=TIMEOUT_S).json()["choices"][0]["text"]
    stop = free[free.index(" ", 3):][:4]  # four characters from the middle of the greedy text
    body = {"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0, "stop": [stop], "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
        chunks = sse_chunks(r.iter_lines())
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert text == free[:free.index(stop)] and chunks[-2]["choices"][0]["finish_reason"] == "stop"
    ids = sum((c["choices"][0]["token_ids"] for c in chunks[:-1]), [])
    assert stop in tok.decode(ids) and stop not in tok.decode(ids[:-1])  # counted up to the deciding token
    wait_idle(loop)
    assert_no_leak(loop)


def test_sigterm_stops_the_server_cleanly_while_a_stream_runs(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "l11_serve", "--port", str(port)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + TIMEOUT_S
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.1)
        body = {"prompt": "Blessed are the", "max_tokens": 1800, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)  # the stream ends (finished or aborted): it does not hang
        assert proc.wait(TIMEOUT_S) == 0
        assert "data: [DONE]" in rest[-2:] and '"finish_reason": "abort"' in "".join(rest)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.points(1)
def test_a_stop_string_stops_the_decoding_not_only_the_text(server):
    check_a_stop_string_stops_the_decoding(server)


def check_a_stop_string_stops_the_decoding(server) -> None:
    """After the stop string the sample is aborted by its index: the engine decodes at most a step
    more, not the 400 tokens asked for."""
    url, _, loop, tok = server
    free = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0},
                      timeout=TIMEOUT_S).json()["choices"][0]["text"]
    stop = free[free.index(" ", 3):][:4]
    wait_idle(loop)
    before = loop.generated
    body = {"prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0, "stop": [stop], "n": 2}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S).json()
    assert [c["finish_reason"] for c in answer["choices"]] == ["stop", "stop"]
    wait_idle(loop)
    sent = sum(len(c["token_ids"]) for c in answer["choices"])
    assert loop.generated - before <= sent + 2 * 2, f"{loop.generated - before} tokens decoded for {sent} sent"
    assert_no_leak(loop)


@pytest.mark.points(1)
def test_a_client_that_leaves_while_its_request_waits_is_never_decoded(embedded_model_dir):
    check_a_waiting_request_left_is_never_decoded(embedded_model_dir)


@pytest.mark.points(5)
def test_every_abort_path_of_abort_group(server, embedded_model_dir):
    """`_abort_group`'s whole contract in one test: a mid-stream hang-up of n = 3 samples, a stop
    string ending each sample by its index, and a client leaving while its request waits."""
    check_a_hang_up_mid_stream(server)
    check_a_stop_string_stops_the_decoding(server)
    check_a_waiting_request_left_is_never_decoded(embedded_model_dir)


def check_a_waiting_request_left_is_never_decoded(embedded_model_dir) -> None:
    """A pool of 4 blocks of 16: the first request (49 + 15 tokens) holds all of it from its
    prefill on, so the second waits. The second's client hangs up while it waits: its request must
    be aborted there, never prefilled or decoded, and the first must run on to its end. (Each step
    is slowed to 20 ms so that the wait is long enough to see on any machine.)"""
    app, loop, tok = build_server(embedded_model_dir, num_blocks=4, block_size=16, prefix_sharing=False)
    long_prompt, new = list(range(100, 149)), 15
    slow_steps(loop, 0.02)
    with Server(app) as url:
        answers = []
        first = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{url}/v1/completions", json={"prompt": long_prompt, "max_tokens": new, "temperature": 0},
            timeout=TIMEOUT_S).json()))
        first.start()
        deadline = time.monotonic() + TIMEOUT_S
        while not loop.snapshot.get("running") and first.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)  # (a first request that already ended, e.g. failed, ends the wait too)
        body = {"prompt": PROMPTS[0], "max_tokens": 30, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
            assert r.status_code == 200
            while not loop.snapshot.get("waiting") and first.is_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert loop.snapshot["waiting"], "the second request never waited"
        first.join(TIMEOUT_S)
        wait_idle(loop)
        (only,) = answers[0]["choices"]
        assert only["finish_reason"] == "length" and len(only["token_ids"]) == new
        assert loop.generated == new, f"{loop.generated - new} tokens decoded for the client that left"
        metrics = httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).text
        assert 'kvcourse_requests_finished_total{reason="aborted"} 1.0' in metrics
        assert_no_leak(loop)


# ---------------------------------------------------------------- chat completions


def test_chat_completions_through_the_openai_client_equal_hf_on_the_templated_prompt(server, embedded_model_dir):
    """`client.chat.completions.create`, whole and streamed: the assistant's text is HF's greedy
    continuation of the chat-templated prompt; streaming sends the role first, then content."""
    url, client, loop, tok = server
    from l11_serve.protocol import chat_prompt_ids

    messages = [{"role": "system", "content": "Answer as the scribe."}, {"role": "user", "content": "Blessed are the"}]
    ids = chat_prompt_ids(messages, tok)
    assert ids == tok.encode("system: Answer as the scribe.\nuser: Blessed are the\nassistant:", add_special_tokens=False)
    want = hf_ids(embedded_model_dir, ids, 12)
    whole = client.chat.completions.create(model="tiny-qwen3-kjv", messages=messages, max_tokens=12, temperature=0)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == tok.decode(want, skip_special_tokens=True)
    assert choice.finish_reason in ("length", "stop") and whole.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model="tiny-qwen3-kjv", messages=messages, max_tokens=12,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    wait_idle(loop)
    assert_no_leak(loop)


def test_a_folders_own_chat_template_is_used(embedded_model_dir):
    from transformers import AutoTokenizer

    from l11_serve.protocol import chat_prompt_ids, parse_chat

    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir))
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    messages = [{"role": "user", "content": "Who begat Enos?"}]
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert chat_prompt_ids(messages, tok) == want
    assert parse_chat({"messages": messages, "max_completion_tokens": 3}, tok, "m").prompts == [want]


@pytest.mark.parametrize("body,words", [
    ({"messages": []}, "non-empty"), ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": 3}]}, "content"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "bogus": 1}, "unknown field 'bogus'"),
])
def test_a_bad_chat_request_is_a_400_naming_what_is_wrong(server, body, words):
    url = server[0]
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
