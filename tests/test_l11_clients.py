"""L11 against the tools people evaluate and load-test servers with, installed from PyPI and run
unmodified over 127.0.0.1: lm-evaluation-harness (a generation task and a loglikelihood task,
each compared with HF), guidellm (a synchronous and a constant-rate run), aiperf, and the
`openai` client's async streams, raw responses and retries.

lm-eval, guidellm and aiperf come with the `clients` extra, which `make clients` installs in an
environment of their own (.venv-clients; CI runs it); without it their tests skip. `openai` is a dev dependency: its test always runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import hf_reference as hf
from openai import AsyncOpenAI, OpenAI

from l11_serve import Server, build_server
from serve_helpers import assert_no_leak, wait_idle

pytestmark = [pytest.mark.l11, pytest.mark.usefixtures("one_torch_thread")]

# `make clients` puts the tools in an environment of their own; one installed beside this python works too.
BINS = (Path(__file__).resolve().parent.parent / ".venv-clients" / "bin", Path(sys.executable).parent)
# Genesis 1:1-5, King James Version (public domain): context, then the words that end the verse.
VERSES = [
    ("In the beginning God created the heaven and the", "earth."),
    ("And God said, Let there be light: and there was", "light."),
    ("And God saw the light, that it was good: and God divided the light from the", "darkness."),
    ("And God called the light Day, and the darkness he called", "Night."),
]
CLIENT_TIMEOUT_S = 300


def tool(name: str) -> str:
    path = next((folder / name for folder in BINS if (folder / name).exists()), None)
    if path is None:
        pytest.skip(f"{name} is not installed: `make clients` adds it (in .venv-clients)")
    return str(path)


@pytest.fixture(scope="module")
def served(embedded_model_dir):
    app, loop, tokenizer = build_server(embedded_model_dir, num_blocks=128, block_size=16)
    with Server(app) as url:
        yield url, loop, tokenizer


def run_tool(args: list[str], cwd: Path, offline: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HOME=str(cwd), NO_COLOR="1", TERM="dumb")
    if offline:  # nothing on a hub is reachable: the tools read the model folder's tokenizer
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    run = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    return run


def write_tasks(folder: Path) -> None:
    """Two lm-eval tasks over VERSES: greedy generation until a newline, and the loglikelihood of
    each verse's last words."""
    data = folder / "verses.jsonl"
    data.write_text("".join(json.dumps({"context": c, "continuation": w}) + "\n" for c, w in VERSES))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
              "doc_to_text: \"{{context}}\"\ndoc_to_target: \" {{continuation}}\"\n")
    (folder / "kjv_generate.yaml").write_text(
        "task: kjv_generate\n" + common + "output_type: generate_until\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n")
    (folder / "kjv_loglikelihood.yaml").write_text(
        "task: kjv_loglikelihood\n" + common + "output_type: loglikelihood\n"
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n")


def samples(out: Path, task: str) -> list[dict]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])


def test_lm_eval_generates_hfs_text_and_scores_hfs_loglikelihoods(served, embedded_model_dir, tmp_path):
    """`lm_eval --model local-completions` as its documentation shows it. Generation: each answer is
    HF's greedy continuation cut at the first newline. Loglikelihood (`echo`, `logprobs: 1`,
    `max_tokens: 1`): each value is the sum of HF's float32 log_softmax over the continuation's
    tokens, split from the context as lm-eval splits them (trailing spaces go with the
    continuation; continuation = tokens of the whole past those of the context), and "is greedy"
    says whether each was HF's argmax."""
    url, loop, tokenizer = served
    write_tasks(tmp_path)
    run_tool([tool("lm_eval"), "--model", "local-completions", "--model_args",
              f"model={embedded_model_dir.name},base_url={url}/v1/completions,tokenizer={embedded_model_dir},"
              "tokenized_requests=True,num_concurrent=2,max_retries=1",
              "--tasks", "kjv_generate,kjv_loglikelihood", "--include_path", str(tmp_path),
              "--log_samples", "--output_path", str(tmp_path / "out")], tmp_path)
    model = hf.load_hf_model(str(embedded_model_dir))
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    for sample, (context, _) in zip(samples(tmp_path / "out", "kjv_generate"), VERSES):
        ids = encode(context)
        want = tokenizer.decode(hf.hf_greedy(model, ids, 8), skip_special_tokens=True).split("\n")[0]
        assert sample["resps"][0][0] == want, (context, sample["resps"], want)
    worst = 0.0
    for sample, (context, words) in zip(samples(tmp_path / "out", "kjv_loglikelihood"), VERSES):
        context_ids, whole = encode(context), encode(context + " " + words)
        continuation = whole[len(context_ids):]
        logprobs = torch.log_softmax(hf.hf_logits(model, whole).float(), dim=-1)  # [len(whole), V]
        rows = logprobs[len(context_ids) - 1:len(whole) - 1]  # the rows that predict the continuation
        want = float(rows.gather(1, torch.tensor(continuation)[:, None]).sum())
        greedy = bool((rows.argmax(-1) == torch.tensor(continuation)).all())
        got, got_greedy = sample["resps"][0][0]
        worst = max(worst, abs(float(got) - want))
        assert abs(float(got) - want) < 1e-3 * len(continuation) and (got_greedy == "True") == greedy, (context, got, want)
    print(f"lm-eval loglikelihoods: max |ours - HF| = {worst:.2e} nats")
    wait_idle(loop)
    assert_no_leak(loop)


def guidellm_run(url: str, model_dir: Path, profile: str, count: int, out: Path) -> dict:
    run_tool([tool("guidellm"), "run", "--backend", f"kind=openai_http,target={url},model={model_dir.name}",
              "--profile", profile, "--constraint", f"kind=max_requests,count={count}",
              "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
              "--tokenizer", f"kind=hf_auto,model={model_dir}", "--output", f"kind=json,path={out}",
              "--disable-console"], out.parent)
    (benchmark,) = json.loads(out.read_text())["benchmarks"]
    return benchmark


def test_guidellm_at_a_constant_rate_completes_every_request(served, embedded_model_dir, tmp_path):
    """guidellm's own request format (chat completions, streamed, with its stream options) at a
    constant rate of 8 per second, several requests in flight: every request succeeds. (One run:
    each guidellm start costs about 15 s here; its synchronous profile sends the same requests one
    at a time, which the constant rate's first requests already do.)"""
    url, loop, _ = served
    profile, count = "kind=constant,rate=8", 12
    benchmark = guidellm_run(url, embedded_model_dir, profile, count, tmp_path / "constant.json")
    done = {kind: len(benchmark["requests"][kind]) for kind in ("successful", "errored", "incomplete")}
    # guidellm's max_requests sometimes closes the run with the last request not yet sent
    # (measured: 5 of 6, synchronous); none may fail or be left unfinished.
    assert done["errored"] == done["incomplete"] == 0 and count - 1 <= done["successful"] <= count, (profile, done)
    wait_idle(loop)
    assert_no_leak(loop)


def test_aiperf_profiles_streamed_completions_without_an_error(served, embedded_model_dir, tmp_path):
    url, loop, _ = served
    # aiperf 0.13 cannot load a tokenizer from a folder in HF's offline mode (it looks the path up
    # in the hub's cache); online mode reads the folder and never reaches the hub.
    run_tool([tool("aiperf"), "profile", "-m", embedded_model_dir.name, "--url", url, "--endpoint-type", "completions",
              "--tokenizer", str(embedded_model_dir), "--request-count", "8", "--concurrency", "4",
              "--synthetic-input-tokens-mean", "32", "--output-tokens-mean", "16", "--streaming",
              "--artifact-dir", str(tmp_path / "aiperf"), "--ui-type", "none"], tmp_path, offline=False)
    report = json.loads((tmp_path / "aiperf" / "profile_export_aiperf.json").read_text())
    assert report["request_count"]["avg"] == 8 and not report.get("error_summary"), report.get("error_summary")
    assert report["output_token_count"]["avg"] > 0
    wait_idle(loop)
    assert_no_leak(loop)


def test_the_readme_shows_the_commands_these_tests_run():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for words in ("lm_eval --model local-completions", "guidellm run --backend kind=openai_http", "make clients"):
        assert words in readme, words


def test_the_openai_client_async_streams_raw_responses_and_retries_after_a_429(embedded_model_dir):
    """16 streamed completions at once from AsyncOpenAI, each the text of the same request made
    alone, although the server's waiting queue takes 4: the burst gets 429s with Retry-After and
    the client's own retries finish every request; `with_raw_response` shows the headers (an
    x-request-id) and parses the same body."""
    app, loop, tokenizer = build_server(embedded_model_dir, num_blocks=128, block_size=16, max_waiting=4)
    prompts = ["Blessed are the", "Thus saith the LORD"]
    with Server(app) as url:
        plain = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=10)
        alone = {p: plain.completions.create(model=embedded_model_dir.name, prompt=p, max_tokens=12,
                                             temperature=0).choices[0].text for p in prompts}
        raw = plain.completions.with_raw_response.create(model=embedded_model_dir.name, prompt=prompts[0],
                                                         max_tokens=12, temperature=0)
        assert raw.status_code == 200 and raw.headers.get("x-request-id")
        assert raw.parse().choices[0].text == alone[prompts[0]]

        async def streamed(client, prompt: str) -> str:
            stream = await client.completions.create(model=embedded_model_dir.name, prompt=prompt, max_tokens=12,
                                                     temperature=0, stream=True)
            return "".join([chunk.choices[0].text async for chunk in stream])

        async def burst(count: int) -> list[str]:
            client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=10)
            return await asyncio.gather(*(streamed(client, prompts[i % 2]) for i in range(count)))

        texts = asyncio.run(burst(16))
        assert texts == [alone[prompts[i % 2]] for i in range(16)]
        rejected = loop.metrics.rejected.labels("overloaded")._value.get()
        assert rejected > 0, "a queue of 4 took 16 requests at once without a 429: nothing was retried"
        wait_idle(loop)
        assert_no_leak(loop)
