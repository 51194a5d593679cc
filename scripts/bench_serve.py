#!/usr/bin/env python3
"""L11 serving benchmark: the same workload, through the same `openai` client, to our server
(`python -m l11_serve`) and to HF's (`transformers serve --continuous-batching`), on the same model,
device, dtype, block size and pool; HF's max batch tokens swept.

Workloads (greedy, so the texts must be equal): `shared` (a 25-token system prompt + short tails,
32 new tokens each) and `mixed` (prompts of 5 to ~180 tokens, 8 to 96 new tokens). Arrivals are
Poisson at each --rates value (requests per second), the same seeded times for every server. Each
server runs alone (started, measured on every row, stopped); with --rounds 2 the order is reversed
in the second round and each row keeps its best round (the one least disturbed by other work).

Both servers get the same --threads intra-op threads (OMP_NUM_THREADS; default 1): on a small
machine the client and each server's HTTP side need cores too, and an engine whose threads are
descheduled mid-product waits for them.

Reported per row: output tokens/s (all tokens / first send to last token), TTFT and inter-token
latency p50/p99 (ms), goodput (requests/s that met the SLO: TTFT <= --slo-ttft-ms and mean ITL <=
--slo-itl-ms), and whether every request's text equals ours.

HF's side needs `pip install 'transformers[serving]'` (fastapi, rich, accelerate); it is skipped
with a note when that is missing.

A real load generator drives the same workload too: with guidellm installed (`make clients`) each
row is repeated by `guidellm run` (the same prompts and max_tokens from a JSON-lines file, Poisson
arrivals at the same rate, /v1/completions), reported from guidellm's own measurements in the rows
marked "· guidellm" (its goodput and text columns stay empty: it neither applies our SLO nor
returns the texts). `--no-guidellm` leaves it out. guidellm asks for exactly max_tokens tokens
(vLLM's `ignore_eos: true`), which HF's server refuses, so those rows carry more tokens than ours.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.cli import OneLineParser, guard_startup, run_main  # noqa: E402

guard_startup()  # Ctrl-C while torch loads: one line, exit 2 (run_main takes over for the work)

import httpx  # noqa: E402

from harness.benchmark import check_bench_args, load_average, machine_line, markdown_table, print_table, replace_section  # noqa: E402
from harness.smoke import DEFAULT_MODEL  # noqa: E402
from l11_serve.server import free_port  # noqa: E402

SYSTEM = "And the LORD spake unto Moses, saying, Speak unto the children of Israel, and say unto them,"
TAILS = ["Blessed are the", "Thus saith the LORD", "Hear, O Israel", "In the beginning", "And it came to pass",
         "O give thanks unto the LORD", "The LORD is my shepherd", "Behold, the days come"]
PASSAGE = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; "
           "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. "
           "And God said, Let there be light: and there was light. And God saw the light, that it was good: and "
           "God divided the light from the darkness. And God called the light Day, and the darkness he called "
           "Night. And the evening and the morning were the first day. And God said, Let there be a firmament "
           "in the midst of the waters, and let it divide the waters from the waters.")

GUIDELLM_NOTE = ("Rows marked · guidellm: the same requests sent by guidellm, which asks for exactly max_tokens "
                 "tokens (`ignore_eos: true`, `stop: null`): they carry more output tokens than the rows above, whose "
                 "requests stop at EOS, so their tok/s is not comparable with those; HF's server refuses `ignore_eos` "
                 "(`Unexpected fields in the request`), so each guidellm request to it is an error.")


def workload(name: str, count: int, seed: int) -> list[tuple[str, int]]:
    """(prompt text, max_tokens) per request."""
    rng = random.Random(seed)
    if name == "shared":
        return [(f"{SYSTEM} {rng.choice(TAILS)}", 32) for _ in range(count)]
    words = PASSAGE.split()
    out = []
    for _ in range(count):
        start, length = rng.randrange(0, len(words) - 40), rng.choice([4, 12, 40, 120])
        out.append((" ".join(words[start:start + length]), rng.choice([8, 32, 96])))
    return out


def arrivals(count: int, rate: float, seed: int) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---------------------------------------------------------------- servers, one at a time

def start(target: dict, args, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": str(args.threads)}
    if target["kind"] == "ours":
        cmd = [sys.executable, "-m", "l11_serve", "--model", args.model, "--port", str(port),
               "--num-blocks", str(args.num_blocks), "--block-size", str(args.block_size),
               "--max-waiting", "100000"]
    else:
        cmd = [hf_cli(), "serve", "--continuous-batching",
               "--cb-block-size", str(args.block_size), "--cb-num-blocks", str(args.num_blocks),
               "--cb-max-batch-tokens", str(target["batch_tokens"]), "--device", "cpu", "--dtype", "float32",
               "--host", "127.0.0.1", "--port", str(port), str(Path(args.model).resolve())]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{target['name']} exited with {proc.returncode} while starting: {' '.join(cmd)}")
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{target['name']} did not answer /health within 180 s")


def hf_cli() -> str | None:
    """HF's `transformers` command: next to this Python (a venv not activated) or on PATH."""
    here = Path(sys.executable).parent / "transformers"
    return str(here) if here.is_file() else shutil.which("transformers")


def guidellm_cli() -> str | None:
    """`make clients` puts guidellm in .venv-clients; else beside this Python, or on PATH."""
    for folder in (Path(__file__).resolve().parent.parent / ".venv-clients" / "bin", Path(sys.executable).parent):
        if (folder / "guidellm").is_file():
            return str(folder / "guidellm")
    return shutil.which("guidellm")


def drive_guidellm(url: str, model: str, reqs: list[tuple[str, int]], rate: float, args) -> dict:
    """The same requests through `guidellm run` (Poisson at `rate`); its own figures, as a row."""
    with tempfile.TemporaryDirectory() as folder:
        data, out = Path(folder, "workload.jsonl"), Path(folder, "guidellm.json")
        data.write_text("".join(json.dumps({"prompt": p, "output_tokens_count": n}) + "\n" for p, n in reqs))
        cmd = [guidellm_cli(), "run", "--backend",
               f"kind=openai_http,target={url},model={model},request_format=/v1/completions",
               "--profile", f"kind=poisson,rate={rate}", "--constraint", f"kind=max_requests,count={len(reqs)}",
               "--data", f"kind=json_file,path={data}", "--tokenizer", f"kind=hf_auto,model={Path(args.model).resolve()}",
               "--output", f"kind=json,path={out}", "--disable-console"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
        if run.returncode != 0:
            raise RuntimeError(f"guidellm failed ({run.returncode}): {(run.stdout + run.stderr)[-500:]}")
        (bench,) = json.loads(out.read_text())["benchmarks"]
    metrics, done = bench["metrics"], bench["requests"]

    def pct(name: str, q: str) -> float | str:
        return metrics[name]["successful"]["percentiles"][q] if done["successful"] else ""  # none: no figure

    return {"tok/s": metrics["output_token_count"]["successful"]["total_sum"] / bench["duration"]
            if done["successful"] else "",
            "TTFT p50": pct("time_to_first_token_ms", "p50"), "TTFT p99": pct("time_to_first_token_ms", "p99"),
            "ITL p50": pct("inter_token_latency_ms", "p50"), "ITL p99": pct("inter_token_latency_ms", "p99"),
            "goodput req/s": "", "SLO met": f"{len(done['successful'])}/{len(reqs)} ok, {len(done['errored'])} errors",
            "texts": None}


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


# ---------------------------------------------------------------- the client side

async def one(client, model: str, prompt: str, max_tokens: int, delay: float, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + delay - time.monotonic()))
    sent = time.monotonic()
    stamps, text, tokens = [], "", None
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.monotonic())
            text += chunk.choices[0].text
        if getattr(chunk, "usage", None):
            tokens = chunk.usage.completion_tokens
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"sent": sent, "ttft": stamps[0] - sent if stamps else float("inf"), "gaps": gaps,
            "end": stamps[-1] if stamps else time.monotonic(), "text": text, "tokens": tokens or len(stamps)}


async def drive(url: str, model: str, reqs: list[tuple[str, int]], offsets: list[float]) -> list[dict]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600,
                           http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=1000))) as client:
        t0 = time.monotonic() + 0.2
        return await asyncio.gather(*(one(client, model, p, n, d, t0) for (p, n), d in zip(reqs, offsets)))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summarize(results: list[dict], args) -> dict:
    span = max(r["end"] for r in results) - min(r["sent"] for r in results)
    gaps = [g for r in results for g in r["gaps"]]
    good = [r for r in results if r["ttft"] * 1e3 <= args.slo_ttft_ms
            and (not r["gaps"] or statistics.fmean(r["gaps"]) * 1e3 <= args.slo_itl_ms)]
    return {"tok/s": sum(r["tokens"] for r in results) / span,
            "TTFT p50": 1e3 * percentile([r["ttft"] for r in results], 0.5),
            "TTFT p99": 1e3 * percentile([r["ttft"] for r in results], 0.99),
            "ITL p50": 1e3 * percentile(gaps, 0.5), "ITL p99": 1e3 * percentile(gaps, 0.99),
            "goodput req/s": len(good) / span, "SLO met": f"{len(good)}/{len(results)}",
            "texts": [r["text"] for r in results]}


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--rates", default="2,8", help="Poisson arrival rates, requests/s (default 2,8)")
    p.add_argument("--requests", type=int, default=32, help="requests per row (default 32)")
    p.add_argument("--workloads", default="shared,mixed")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--hf-batch-tokens", default="256,1024", help="HF's --cb-max-batch-tokens values swept")
    p.add_argument("--no-hf", action="store_true", help="only our server")
    p.add_argument("--no-guidellm", action="store_true", help="leave out the rows driven by guidellm")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-itl-ms", type=float, default=200.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads of each server, set as OMP_NUM_THREADS for both (default 1: the "
                        "client and each server's HTTP side share the machine's cores with it)")
    p.add_argument("--markdown", default=None, help="rewrite the bench_serve section of this file")
    args = check_bench_args(p.parse_args(argv), p)
    rates = [float(r) for r in args.rates.split(",")]
    names = args.workloads.split(",")
    if min(rates) <= 0 or min(args.requests, args.threads) < 1 or not set(names) <= {"shared", "mixed"}:
        print("error: --rates must be > 0, --requests and --threads >= 1, --workloads from shared,mixed",
              file=sys.stderr)
        return 2
    targets = [{"name": "ours (l11_serve)", "kind": "ours"}]
    have_hf = hf_cli() is not None and all(importlib.util.find_spec(m) for m in ("fastapi", "rich", "accelerate"))
    note = ""
    if not args.no_hf and have_hf:
        targets += [{"name": f"HF serve, {t} batch tokens", "kind": "hf", "batch_tokens": int(t)}
                    for t in args.hf_batch_tokens.split(",")]
    elif not args.no_hf:
        note = "HF's server skipped: pip install 'transformers[serving]' to compare."
    with_guidellm = not args.no_guidellm and guidellm_cli() is not None
    if not args.no_guidellm and not with_guidellm:
        note += " guidellm's rows skipped: `make clients` installs it."
    load_start = load_average()
    rows: dict[tuple, dict] = {}
    for rnd in range(args.rounds):
        for target in (targets if rnd % 2 == 0 else targets[::-1]):
            port = free_port()
            proc = start(target, args, port)
            model = Path(args.model).name if target["kind"] == "ours" else str(Path(args.model).resolve())
            try:
                asyncio.run(drive(f"http://127.0.0.1:{port}", model, workload("shared", 2, 99), [0, 0]))  # warm-up
                for name in names:
                    for rate in rates:
                        seed = args.seed * 1000 + names.index(name) * 100 + rates.index(rate)
                        reqs = workload(name, args.requests, seed)
                        results = asyncio.run(drive(f"http://127.0.0.1:{port}", model, reqs,
                                                    arrivals(len(reqs), rate, seed)))
                        measured = [(target["name"], summarize(results, args))]
                        if with_guidellm:
                            measured.append((f"{target['name']} · guidellm",
                                             drive_guidellm(f"http://127.0.0.1:{port}", model, reqs, rate, args)))
                        for server, row in measured:
                            key = (name, rate, server)
                            if key not in rows or (row["tok/s"] or 0) > (rows[key]["tok/s"] or 0):
                                rows[key] = row
                            print(f"round {rnd + 1} {server:40} {name:6} {rate:4g}/s  {row['tok/s'] or 0:7.1f} tok/s",
                                  flush=True)
            finally:
                stop(proc)
    table = []
    for (name, rate, target), row in rows.items():
        ours = rows[(name, rate, targets[0]["name"])]["texts"]
        table.append({"workload": name, "rate/s": rate, "server": target,
                      **{k: v for k, v in row.items() if k != "texts"},
                      "texts equal": "" if row["texts"] is None else "yes" if row["texts"] == ours else
                      f"{sum(a == b for a, b in zip(row['texts'], ours))}/{len(ours)}"})
    order = [t["name"] for t in targets]
    table.sort(key=lambda r: (names.index(r["workload"]), r["rate/s"], order.index(r["server"].split(" · ")[0]),
                              " · " in r["server"]))
    columns = ["workload", "rate/s", "server", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
               "goodput req/s", "SLO met", "texts equal"]
    print_table(table, columns)
    if note:
        print(note)
    if args.markdown:
        cmd = "python scripts/bench_serve.py " + " ".join(a for a in (argv or sys.argv[1:])
                                                          if not a.startswith("--markdown") and a != args.markdown)
        text = (f"## L11: serving over HTTP, ours vs `transformers serve --continuous-batching`\n\n"
                f"`{cmd.strip()}` · {machine_line(args.threads, load_start)}\n\n"
                f"{args.requests} requests per row, Poisson arrivals, greedy; one server running at a time (the other stopped) "
                f"while measured, both on CPU float32 with {args.num_blocks} blocks of {args.block_size} and "
                f"{args.threads} intra-op thread(s) (OMP_NUM_THREADS); "
                f"times in ms; SLO: TTFT <= {args.slo_ttft_ms:g} ms and mean ITL <= {args.slo_itl_ms:g} ms; "
                f"best of {args.rounds} round(s). {GUIDELLM_NOTE if with_guidellm else ''} {note}\n\n"
                + markdown_table(table, columns, ".1f"))
        replace_section(args.markdown, "bench_serve", text)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
