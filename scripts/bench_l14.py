#!/usr/bin/env python3
"""L14 benchmark: what a tier behind the pool saves, when loading stops paying, and what moving
decode to its own process does to inter-token latency.

Second turns (the embedded model, float32): 8 conversations of 150-250 random prompt tokens and 16
new; then 8 other requests that push their blocks out of a pool of 48 blocks; then each
conversation's second turn (its first prompt, its answer, 20 new tokens). Tier off, a CPU tier that
keeps everything, a CPU tier of 16 blocks before a file tier, files only: prompt tokens computed,
blocks loaded from each tier, bytes moved, the second turns' TTFT; ids compared with HF's.

Load or recompute (one request, a prefix of P tokens stored in the tier, then 16 more tokens): the
time to its first token when the prefix is computed, loaded from the CPU tier, or loaded from the
file tier (the files are in the page cache: a warm disk), per prefix block; on the embedded model
and on a wider random model (8 layers, hidden 1024). Where loading from files costs more than
computing, the table says so.

Two processes (`torchrun`, gloo, one thread each): L8's shared-system-prompt workload at a larger
scale (24 requests of 300-400 tokens and 48 new, one arriving per step) prefilled on rank 0 and
decoded on rank 1, against one process running L5's mixed steps (prefill chunks beside decodes):
decode tokens per second, inter-token latency (mean and p99 over every generated token: the length
of the step it came out of), bytes and time per block sent; ids compared with HF's.

Everything runs on the CPU in float32: the tables are CPU figures (--device takes cpu only; there
is no --dtype).

    python scripts/bench_l14.py                                  # the tables, printed
    python scripts/bench_l14.py --markdown docs/benchmarks.md    # rewrite its section there
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.cli import guard_startup, run_main  # noqa: E402

guard_startup()

import torch  # noqa: E402

from harness import hf_reference as hf  # noqa: E402
from harness.benchmark import (bench_command, bench_parser, check_bench_args, checked_model, load_average,  # noqa: E402
                               machine_line, markdown_table, print_table, replace_section, write_text_atomic)
from harness.tiny_models import make_random_model  # noqa: E402
from l1_contiguous import load_config  # noqa: E402
from l2_paged import bytes_per_block  # noqa: E402
from l5_eviction import WorkItem, load_engine_model  # noqa: E402
from l14_kv_transfer import (FileTier, TieredStore, decode_rank, make_offload_engine, make_store, messages, pd,  # noqa: E402
                             transport)

BS = 16
WIDE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
            num_key_value_heads=8, head_dim=64, max_position_embeddings=2048)
# K/V large for its compute: 16 KV heads of 64 (1,024 values per token per layer) on a hidden size of 128
KV_HEAVY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=16,
                num_key_value_heads=16, head_dim=64, max_position_embeddings=2048)

TURN_COLUMNS = ["tier", "prompt tokens computed", "tokens loaded", "blocks from CPU", "blocks from files",
                "MB loaded", "MB saved", "2nd-turn TTFT ms", "run s", "ids = HF"]
LOAD_COLUMNS = ["model", "bytes/block", "prefix tokens", "16 tokens alone ms", "compute ms", "from CPU ms",
                "from files ms", "files cost more"]
PD_COLUMNS = ["layout", "decode tok/s", "ITL mean ms", "ITL p99 ms", "decode steps with prefill rows",
              "blocks sent", "MB sent", "send us per block", "ids = HF", "blocks held, not sent",
              "decode rank prompt tokens computed", "prefill rank computing s", "of it while a send was on the wire s",
              "sender thread busy s"]


def parse_args(argv=None):
    """The options, checked at the door. The tables are CPU float32 figures (one thread against two
    ranks of one thread each), so --device is cpu only and there is no --dtype."""
    p = bench_parser(__doc__.split("\n\n")[0], repeat=3, cpu_only=True)
    p.add_argument("--markdown", metavar="PATH", default=None, help="rewrite the `bench_l14` section of PATH")
    # internal: the two-process run starts this script under torchrun; each rank writes its figures there
    p.add_argument("--pd-rank", metavar="JSON", default=None, help=argparse.SUPPRESS)
    args = check_bench_args(p.parse_args(argv), p)
    args.model_dir, _ = checked_model(args)
    return args


def rand(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def timed_run(engine, items: list[WorkItem]) -> dict[int, float]:
    """Run `items` to the end; per request: seconds from the step it arrived in to its first token."""
    for item in items:
        engine.add_request(item)
    arrived, first = {}, {}
    while engine.has_unfinished():
        engine.skip_idle_steps()
        start = time.perf_counter()
        for rid, req in engine.requests.items():
            if rid not in arrived and req.arrival_step <= engine.now:
                arrived[rid] = start
        engine.step()
        end = time.perf_counter()
        for rid, req in engine.requests.items():
            if rid not in first and req.output_ids:
                first[rid] = end
    return {rid: first[rid] - arrived[rid] for rid in arrived}


# ---------------------------------------------------------------- second turns

def turn_rows(model_dir: Path, tmp: Path) -> list[dict]:
    model = load_engine_model(model_dir)
    hf_model = hf.load_hf_model(str(model_dir))
    rng = random.Random(0)
    vocab = model.config.vocab_size
    firsts = [rand(rng.randint(150, 250), vocab, rng) for _ in range(8)]
    traffic = [rand(rng.randint(150, 250), vocab, rng) for _ in range(8)]
    follow = [rand(20, vocab, rng) for _ in range(8)]
    settings = [("off", None), ("CPU, keeps all", lambda: make_store(512)),
                ("CPU 16 + files", lambda: make_store(16, 512, tmp / "cpu-files")),
                ("files only", lambda: TieredStore([FileTier(512, tmp / "files")]))]
    rows = []
    for name, store in settings:
        engine = make_offload_engine(model, 48, BS, store=store() if store else None)
        start = time.perf_counter()
        timed_run(engine, [WorkItem(p, 16, arrival_step=i) for i, p in enumerate(firsts)])
        seconds = [r.tokens + f for r, f in zip(list(engine.requests.values()), follow)]
        now = engine.now
        later = [WorkItem(p, 16, arrival_step=now + i) for i, p in enumerate(traffic)]
        later += [WorkItem(p, 16, arrival_step=now + len(traffic) + 4 * i) for i, p in enumerate(seconds)]
        ttft = timed_run(engine, later)
        run_s = time.perf_counter() - start
        reqs = list(engine.requests.values())
        second_ids = [r.request_id for r in reqs[len(firsts) + len(traffic):]]
        match = sum(r.output_ids == hf.hf_greedy(hf_model, r.prompt_ids, 16) for r in reqs)
        s = engine.summary()
        rows.append({"tier": name, "prompt tokens computed": s["prefill_tokens_computed"],
                     "tokens loaded": s["tokens_loaded"], "blocks from CPU": s.get("cpu_blocks_loaded", 0),
                     "blocks from files": s.get("file_blocks_loaded", 0), "MB loaded": s["bytes_loaded"] / 1e6,
                     "MB saved": s["bytes_saved"] / 1e6,
                     "2nd-turn TTFT ms": 1e3 * statistics.fmean(ttft[i] for i in second_ids),
                     "run s": run_s, "ids = HF": f"{match}/{len(reqs)}"})
    return rows


# ---------------------------------------------------------------- load or recompute

def first_token_seconds(model, prompt: list[int], store_factory, repeat: int) -> float:
    """Best of `repeat`: a fresh engine (the tier already holding the prefix) to the prompt's first token."""
    best = float("inf")
    for _ in range(repeat):
        store = store_factory()
        engine = make_offload_engine(model, -(-len(prompt) // BS) + 2, BS, store=store, prefill_chunk=None)
        if store is not None:
            seed = make_offload_engine(model, -(-len(prompt) // BS) + 2, BS, store=store, prefill_chunk=None)
            seed.run([WorkItem(prompt, 1)])  # writes the prefix's blocks through to the tier
        engine.add_request(WorkItem(prompt, 1))
        start = time.perf_counter()
        engine.step()
        best = min(best, time.perf_counter() - start)
        if store is not None:
            assert engine.summary()["tokens_loaded"] == (len(prompt) - 1) // BS * BS
            for tier in store.tiers:
                tier.clear()
    return best


def load_rows(model_dirs: dict[str, Path], tmp: Path, repeat: int) -> list[dict]:
    """Per prefix: time to the first token (the prefix computed, or loaded, then 16 tokens computed),
    beside the time of the 16 tokens alone: raw times, each the best of `repeat`. (A difference of
    two such minima, per block, is noise at short prefixes; crossover_sentence takes it only at the
    longest.)"""
    rows = []
    for name, model_dir in model_dirs.items():
        model = load_engine_model(model_dir)
        rng = random.Random(1)
        tail = first_token_seconds(model, rand(BS, model.config.vocab_size, rng), lambda: None, repeat)
        for prefix in (64, 256, 1024):
            prompt = rand(prefix + BS, model.config.vocab_size, rng)
            blocks = prefix // BS
            times = {"compute": first_token_seconds(model, prompt, lambda: None, repeat),
                     "cpu": first_token_seconds(model, prompt, lambda: make_store(blocks + 2), repeat),
                     "files": first_token_seconds(model, prompt, lambda: TieredStore([FileTier(blocks + 2, tmp / "f")]),
                                                  repeat)}
            rows.append({"model": name, "bytes/block": bytes_per_block(model.config, BS, model.dtype),
                         "prefix tokens": prefix, "16 tokens alone ms": 1e3 * tail,
                         "compute ms": 1e3 * times["compute"], "from CPU ms": 1e3 * times["cpu"],
                         "from files ms": 1e3 * times["files"],
                         "files cost more": "yes" if times["files"] > times["compute"] else "no"})
    return rows


# ---------------------------------------------------------------- two processes

def pd_workload(vocab: int) -> list[WorkItem]:
    rng = random.Random(2)
    system = rand(128, vocab, rng)
    return [WorkItem(system + rand(rng.randint(172, 272), vocab, rng), 48, arrival_step=i) for i in range(24)]


def token_latencies(steps: list[tuple[float, int]]) -> list[float]:
    """One entry per decoded token: the length of the step it came out of."""
    return [seconds for seconds, tokens in steps for _ in range(tokens)]


def pd_rank(model_dir: Path, out: str) -> int:
    """One rank of the two-process run (under torchrun); each writes its figures to out.rank<N>."""
    rank = int(os.environ["RANK"])
    model = load_engine_model(model_dir)
    items = pd_workload(model.config.vocab_size)
    num_blocks = sum(-(-(len(w.prompt_ids) + w.max_new_tokens) // BS) for w in items)
    engine = make_offload_engine(model, num_blocks, BS)
    if rank == messages.PREFILL_RANK:
        connector = pd.PdSendConnector(engine.pool, BS, {i: w.max_new_tokens for i, w in enumerate(items)})
        engine.connector = connector
        transport.init_group(60)
        figures = pd.run_prefill_rank(engine, items)
    else:
        transport.init_group(60)
        decode = decode_rank.DecodeRank(engine, len(items), 60)
        start = time.perf_counter()
        outcomes = decode.run()
        figures = {"seconds": time.perf_counter() - start, "steps": decode.steps, **decode.figures(),
                   "ids": [o.output_ids for o in outcomes.values()]}
    write_text_atomic(f"{out}.rank{rank}", json.dumps(figures))
    return 0


def pd_rows(model_dir: Path, tmp: Path) -> list[dict]:
    # one process: L5's mixed steps (prefill chunks of 256 beside the decodes), on as many threads as
    # the two ranks have between them: equal cores (set before loading: the products are split per thread)
    torch.set_num_threads(2)
    model = load_engine_model(model_dir)
    hf_model = hf.load_hf_model(str(model_dir))
    items = pd_workload(model.config.vocab_size)
    expected = [hf.hf_greedy(hf_model, w.prompt_ids, w.max_new_tokens) for w in items]
    num_blocks = sum(-(-(len(w.prompt_ids) + w.max_new_tokens) // BS) for w in items)
    engine = make_offload_engine(model, num_blocks, BS)
    for item in items:
        engine.add_request(item)
    steps, start = [], time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        record = engine.step()
        steps.append((time.perf_counter() - t, record.decode_tokens, record.prefill_tokens))
    one_s = time.perf_counter() - start
    torch.set_num_threads(1)
    one_ids = [r.output_ids for r in engine.requests.values()]
    one_lat = token_latencies([(s, d) for s, d, _ in steps])
    rows = [{"layout": "one process of 2 threads, mixed steps", "decode tok/s": len(one_lat) / one_s,
             "ITL mean ms": 1e3 * statistics.fmean(one_lat), "ITL p99 ms": 1e3 * _p99(one_lat),
             "decode steps with prefill rows": f"{sum(1 for _, d, p in steps if d and p)}/{sum(1 for _, d, _ in steps if d)}",
             "blocks sent": "-", "MB sent": "-", "send us per block": "-",
             "ids = HF": f"{sum(a == b for a, b in zip(one_ids, expected))}/{len(items)}"}]
    out = str(tmp / "pd.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
                    __file__, "--model", str(model_dir), "--pd-rank", out], check=True,
                   env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL)
    prefill = json.loads(Path(out + ".rank0").read_text())
    decode = json.loads(Path(out + ".rank1").read_text())
    lat = token_latencies([tuple(s) for s in decode["steps"]])
    rows.append({"layout": "prefill rank 0 + decode rank 1, 1 thread each", "decode tok/s": len(lat) / decode["seconds"],
                 "ITL mean ms": 1e3 * statistics.fmean(lat), "ITL p99 ms": 1e3 * _p99(lat),
                 "decode steps with prefill rows": f"0/{sum(1 for _, d in decode['steps'] if d)}",
                 "blocks sent": prefill["blocks_sent"], "MB sent": prefill["bytes_sent"] / 1e6,
                 "send us per block": 1e6 * prefill["send_seconds"] / max(prefill["blocks_sent"], 1),
                 "ids = HF": f"{sum(a == b for a, b in zip(decode['ids'], expected))}/{len(items)}"})
    rows[-1]["blocks held, not sent"] = prefill["blocks_not_sent_already_held"]
    rows[-1]["decode rank prompt tokens computed"] = decode["decode_prefill_tokens_computed"]
    rows[-1]["prefill rank computing s"] = prefill["step_seconds_computing"]
    rows[-1]["of it while a send was on the wire s"] = prefill["step_seconds_while_sending"]
    rows[-1]["sender thread busy s"] = prefill["send_seconds"]
    return rows


def crossover_sentence(loads: list[dict]) -> str:
    """What the load-or-recompute table says about where files stop paying, in numbers from it."""
    crossed = [r for r in loads if r["files cost more"] == "yes"]
    longest = [r for r in loads if r["prefix tokens"] == max(x["prefix tokens"] for x in loads)]

    def per_block_us(row, column):  # at the longest prefix only, where the difference is well above noise
        return 1e3 * (row[column] - row["16 tokens alone ms"]) / (row["prefix tokens"] // BS)

    files = [per_block_us(r, "from files ms") for r in longest]
    compute = [per_block_us(r, "compute ms") for r in longest]
    rates = [r["bytes/block"] / us for r, us in zip(longest, files) if us > 0]  # bytes/us = MB/s
    rate = f"{min(rates):,.0f}-{max(rates):,.0f} MB/s" if rates else "too fast to measure"
    if crossed:
        where = "; ".join(f"{r['model']} at {r['prefix tokens']} tokens" for r in crossed)
        head = f"Loading from files cost more than computing in {len(crossed)} row(s): {where}."
    else:
        head = (f"No row crosses on this machine. At the longest prefix, less the 16 tokens alone, a block "
                f"costs {min(files):,.0f}-{max(files):,.0f} us to load from files and {min(compute):,.0f}-"
                f"{max(compute):,.0f} us to compute: a CPU computes slowly.")
    return (head + f" Files (from the page cache, through Python, one file per block) were read at {rate} there. Loading from files costs more than computing on a device that computes a block faster "
            "than it reads one: Qwen3-8B in bf16 on an H100 computes 16 tokens in about 320 us (16 GFLOP each at "
            "800 TFLOP/s) and a block is 2.36 MB, which a file tier at the rate above needs several milliseconds to "
            "read: there files lose, and an NVMe drive at 5-7 GB/s (0.3-0.5 ms) is about even.")


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main(argv=None) -> int:
    args = parse_args(argv)
    model_dir = args.model_dir
    if args.pd_rank:
        return pd_rank(model_dir, args.pd_rank)
    torch.set_num_threads(1)  # as each of the two ranks runs: the comparison is one core against one core each
    load_at_start = load_average()
    with tempfile.TemporaryDirectory(prefix="l14-bench-") as tmp:
        tmp = Path(tmp)
        turns = turn_rows(model_dir, tmp)
        print_table(turns, TURN_COLUMNS)
        wide = make_random_model(tmp / "wide", hf_init=False, **WIDE)
        heavy = make_random_model(tmp / "kv-heavy", hf_init=False, **KV_HEAVY)
        loads = load_rows({model_dir.name: model_dir, "random, 8 layers x 1024": wide,
                           "random, KV-heavy (hidden 128, 16 KV heads)": heavy}, tmp, args.repeat)
        print_table(loads, LOAD_COLUMNS)
        split = pd_rows(model_dir, tmp)
        print_table(split, PD_COLUMNS)
    per_block = bytes_per_block(load_config(model_dir), BS, torch.float32)
    if args.json:
        write_text_atomic(args.json, json.dumps({"turns": turns, "loads": loads, "split": split}, indent=2))
    if args.markdown:
        text = (f"## L14: KV outside the pool: a tier behind it, prefill and decode apart\n\n"
                f"{machine_line(1, load_at_start)}\n\n"
                f"`{bench_command('bench_l14.py', sys.argv[1:] if argv is None else argv)}` on {model_dir.name} "
                f"(float32, block size {BS}: {per_block:,} bytes per block).\n\n"
                "**Second turns after other traffic** (8 conversations of 150-250 random prompt tokens and 16 new, "
                "8 other requests, then the second turns: the first prompt, its answer and 20 tokens), pool of 48 "
                "blocks, write-through:\n\n" + markdown_table(turns, TURN_COLUMNS)
                + "\n\n**Load or recompute**: one request whose prefix of P tokens the tier holds (then 16 more "
                "tokens), time to its first token, best of " f"{args.repeat}; the files are in the page cache:\n\n"
                + markdown_table(loads, LOAD_COLUMNS) + "\n\n" + crossover_sentence(loads)
                + "\n\n**Prefill and decode in two processes** (gloo on this machine, one thread per rank; 24 "
                "requests of a 128-token shared system prompt + 172-272 tokens, 48 new, one arriving per step) "
                "against one process running L5's mixed steps with two threads (the same two cores). "
                "\"send us per block\" is the prefill rank's sender thread's time (header, the decode rank's reply, "
                "the copy out of the pool, the send) over the blocks sent; that thread runs beside the prefill "
                "rank's steps, and \"of it while a send was on the wire\" is the computing that overlapped a "
                "send:\n\n"
                + markdown_table(split, PD_COLUMNS))
        replace_section(args.markdown, "bench_l14", text)
    ok = all(r["ids = HF"].split("/")[0] == r["ids = HF"].split("/")[1] for r in turns + split)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
