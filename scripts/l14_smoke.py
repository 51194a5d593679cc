#!/usr/bin/env python3
"""L14 smoke test. Alone: conversations come back for a second turn after other traffic has pushed
their blocks out of a small pool; with a tier behind the pool (CPU memory, then files) their first
turn's blocks are loaded instead of recomputed. Under `torchrun --nproc-per-node 2`: rank 0 prefills
L8's shared-system-prompt workload and sends each request's blocks to rank 1, which decodes them
in its own pool. Either way every request's ids must equal HF's, and every block must be free (or
cached free) at the end."""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # l8_smoke: the two-process form runs its workload

from harness.cli import exit_now, starting  # noqa: E402

with starting():  # a Ctrl-C during these imports (a second or more) ends in one line, exit 2
    import l8_smoke  # noqa: E402
    from harness.smoke import LessonRun, RequestResult, encode, run_smoke  # noqa: E402
    from l1_contiguous import InputError  # noqa: E402
    from l2_paged import blocks_needed  # noqa: E402
    from l3_block_kernel import check_backend_device  # noqa: E402
    from l5_eviction.mixed import ENGINE_BACKENDS  # noqa: E402
    from l5_eviction import DEFAULT_PREFILL_CHUNK, WorkItem, engine_backend, load_engine_model  # noqa: E402
    from l14_kv_transfer import MODES, kv_identity, make_offload_engine, make_store  # noqa: E402
    from l14_kv_transfer import decode_rank, pd, transport  # noqa: E402


LESSON = "L14"
ASSETS = Path(__file__).resolve().parent.parent / "assets"
CONVERSATIONS = [(0, 100), (700, 90), (1400, 80), (2100, 100)]  # (character offset, first-turn tokens)
FOLLOW_UP = (2800, 16)  # the second turn's new text after each first turn's prompt and answer
TRAFFIC = [(0, 90), (250, 90), (500, 90), (750, 90)]  # other requests between the turns (calibration text)


def add_options(parser):
    parser.add_argument("--tier", choices=["cpu+file", "cpu", "file", "off"], default="cpu+file",
                        help="what stands behind the pool (default cpu+file: --cpu-blocks in memory, then "
                             "--file-blocks as files); off: nothing, L8's engine")
    parser.add_argument("--cpu-blocks", type=int, default=12, help="capacity of the CPU tier in blocks (default 12)")
    parser.add_argument("--file-blocks", type=int, default=64, help="capacity of the file tier in blocks (default 64)")
    parser.add_argument("--tier-dir", default=None,
                        help="folder of the file tier (default: a temporary folder, removed at exit)")
    parser.add_argument("--offload-mode", choices=MODES, default="write-through",
                        help="write-through (default): save a block when it is full; write-back: when the "
                             "pool evicts it")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="pool size, at least 1 (default, when not given: alone, two second turns at once, "
                             "too small to keep the first turns; under torchrun, every request at once)")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                        help=f"at most this many prompt tokens per step (default {DEFAULT_PREFILL_CHUNK})")
    parser.add_argument("--backend", choices=ENGINE_BACKENDS, default=None,
                        help="attention: L4's paged path for every row (default: kernel on CUDA, cpu for "
                             "float32 on a CPU, else reference; emulated: the CUDA kernel's own code on the CPU, slowly)")
    parser.add_argument("--transfer-timeout", type=float, default=30.0,
                        help="two processes: seconds the decode rank waits for a transfer's K/V before it ends "
                             "that request with an error (default 30); a rank that goes silent without closing "
                             "its connection is given up after 4 times that, or 120 s if longer")
    parser.add_argument("--dist-backend", choices=["gloo", "nccl"], default="gloo",
                        help="two processes: how K/V payloads travel (default gloo, through host memory; nccl: "
                             "GPU to GPU, one GPU per rank). Control messages always go over gloo")
    parser.add_argument("--stall-transfer", type=int, default=None, metavar="INDEX",
                        help="two processes, a fault to watch: the prefill rank holds request INDEX's blocks "
                             "back for --transfer-timeout + 1 s (that request ends with an error, the others pass it and "
                             "finish)")


# The least each count may be: a tier may hold no blocks (it is off), the pool not (0 is no pool,
# not "the default": leave --num-blocks out for that).
MINIMUM = {"block_size": 1, "prefill_chunk": 1, "num_blocks": 1, "cpu_blocks": 0, "file_blocks": 0}


def check_options(args) -> None:
    for name, least in MINIMUM.items():
        value = getattr(args, name)
        if value is not None and value < least:
            raise InputError(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
    if not args.transfer_timeout > 0:
        raise InputError(f"--transfer-timeout must be a positive number of seconds, got {args.transfer_timeout}")
    if args.tier_dir is not None and "file" in args.tier:
        check_tier_dir(args.tier_dir)


def check_tier_dir(folder: str) -> None:
    """--tier-dir must be a folder this process can write files in. Tried, not asked: a folder
    such as /proc/self says it is one (and, to root, that it is writable), then refuses every file."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise InputError(f"--tier-dir {folder} is a file; the file tier needs a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".l14-probe-"):
            pass
    except OSError as exc:
        raise InputError(f"--tier-dir {folder}: cannot write files there ({exc.strerror or exc}); choose a "
                         f"folder you can write") from None


def passages(setup, spans, name: str = "kjv-heldout.txt") -> list[list[int]]:
    text = (ASSETS / name).read_text()
    return [encode(setup.tokenizer, text[start:])[:length] for start, length in spans]


def make_tier(args):
    if args.tier == "off":
        return None
    folder = args.tier_dir
    if folder is None and "file" in args.tier:
        folder = tempfile.mkdtemp(prefix="l14-tier-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    cpu = args.cpu_blocks if "cpu" in args.tier else 0
    files = args.file_blocks if "file" in args.tier else 0
    return make_store(cpu, files, folder)


# ---------------------------------------------------------------- one process: the tier

def run_offload(args, setup) -> LessonRun:
    if args.prompt or args.prompt_ids or setup.tokenizer is None:
        first_turns, traffic = [p.ids for p in setup.prompts], []
    else:
        first_turns, traffic = passages(setup, CONVERSATIONS), passages(setup, TRAFFIC, "kjv-calibration.txt")
    bs, new = args.block_size, setup.max_new_tokens
    longest = max(len(p) for p in first_turns) * 2 + new + FOLLOW_UP[1]
    num_blocks = 2 * blocks_needed(longest + new, bs) if args.num_blocks is None else args.num_blocks
    model = load_engine_model(setup.model_dir, setup.dtype, setup.device)
    backend = args.backend or engine_backend(setup.device, setup.dtype)
    check_backend_device(backend, setup.device)
    engine = make_offload_engine(model, num_blocks, bs, store=make_tier(args), mode=args.offload_mode,
                                 prefill_chunk=args.prefill_chunk, backend=backend)
    engine.run([WorkItem(p, new, arrival_step=i) for i, p in enumerate(first_turns)])
    first = list(engine.requests.values())
    # The teacher-forced rerun (bf16, harness/forcing.py) sends this run's second turns again.
    if getattr(args, "second_turn_prompts", None) is None:
        args.second_turn_prompts = [r.tokens + follow_up(setup, r.prompt_ids) for r in first]
    later = [WorkItem(p, new, arrival_step=engine.now + i) for i, p in enumerate(traffic)]
    later += [WorkItem(p, new, arrival_step=engine.now + len(traffic) + 1 + i)
              for i, p in enumerate(args.second_turn_prompts)]
    engine.run(later)
    engine.alloc.check()
    kinds = ["turn 1"] * len(first) + ["traffic"] * len(traffic) + ["turn 2"] * len(first)
    results = [RequestResult(r.prompt_ids, r.output_ids, label=f"{kind}, arrives at step {r.arrival_step}")
               for kind, r in zip(kinds, engine.requests.values())]
    s = engine.summary()
    figures = {"backend": backend, "tier": args.tier, "offload_mode": args.offload_mode, "block_size": bs,
               "blocks_total": num_blocks, "bytes_per_block": engine.pool.bytes_per_block(model.config, bs, model.dtype),
               **{k: s[k] for k in ("blocks_peak_used", "blocks_free_at_end", "tokens_loaded", "blocks_loaded",
                                    "bytes_loaded", "blocks_saved", "bytes_saved", "blocks_failed",
                                    "tokens_recomputed_after_failed_loads", "save_errors") if k in s},
               **{k: v for k, v in s.items() if k.startswith(("cpu_", "file_")) or k in ("blocks_dropped",
                                                                                           "block_load_errors")},
               "prefill_tokens_total": s["prefill_tokens_total"], "prefill_tokens_computed": s["prefill_tokens_computed"],
               "device_hit_tokens": s["prefix_hit_tokens"] - s["tokens_loaded"],
               "cached_blocks_evicted": s["cached_blocks_evicted"],
               "all_blocks_free_at_end": s["blocks_free_at_end"] == s["blocks_total"]}
    if not figures["all_blocks_free_at_end"]:
        raise AssertionError(f"blocks leaked: {figures}")  # a bug: exit 3
    return LessonRun(results, figures)


def follow_up(setup, prompt: list[int]) -> list[int]:
    if setup.tokenizer is None:
        return prompt[:8]
    return passages(setup, [FOLLOW_UP])[0]


# ---------------------------------------------------------------- two processes

def pd_workload(args, setup) -> list[WorkItem]:
    args.n, args.arrivals = 1, "staggered"
    items = [WorkItem(w.prompt_ids, w.max_new_tokens, w.arrival_step) for w in l8_smoke.workload(args, setup)]
    if args.stall_transfer is not None and not 0 <= args.stall_transfer < len(items):
        raise InputError(f"--stall-transfer {args.stall_transfer}: the run has requests 0 to {len(items) - 1}")
    return items


def pd_config(args, engine, items: list[WorkItem]) -> dict:
    """What both ranks must agree on (transport.agree_on_config), most telling first."""
    model = engine.model
    prompts = hashlib.blake2b(json.dumps([w.prompt_ids for w in items]).encode(), digest_size=8).hexdigest()
    return {"dtype": str(model.dtype).removeprefix("torch."), "block_size": args.block_size,
            "dist_backend": args.dist_backend, "requests": len(items), "prompts (digest)": prompts,
            "max_new_tokens": sorted({w.max_new_tokens for w in items}),
            "model (digest)": kv_identity(model, args.block_size, model.dtype).hex()[:16]}


def pd_engine(args, setup, items, connector=None):
    if args.num_blocks is not None:
        num_blocks = args.num_blocks
    else:
        num_blocks = sum(blocks_needed(len(w.prompt_ids) + w.max_new_tokens, args.block_size) for w in items)
    model = load_engine_model(setup.model_dir, setup.dtype, setup.device)
    backend = args.backend or engine_backend(setup.device, setup.dtype)
    check_backend_device(backend, setup.device)
    engine = make_offload_engine(model, num_blocks, args.block_size, prefill_chunk=args.prefill_chunk,
                                 backend=backend)
    if connector is not None:
        engine.connector = connector(engine)
    return engine


def run_decode_rank(args, setup) -> LessonRun:
    check_options(args)
    items = pd_workload(args, setup)
    engine = pd_engine(args, setup, items)
    data = transport.init_group(args.transfer_timeout, args.dist_backend)
    transport.agree_on_config(pd_config(args, engine, items))
    rank = decode_rank.DecodeRank(engine, len(items), args.transfer_timeout, data=data)
    outcomes = rank.run()
    engine.alloc.check()
    results = []
    for w, out in zip(items, outcomes.values()):
        label = "decoded here, prefilled on rank 0" if out.error is None else f"error: {out.error}"
        results.append(RequestResult(w.prompt_ids, out.output_ids, label=label))
    s = engine.summary()
    figures = {"role": "decode (rank 1)", "block_size": args.block_size, "blocks_total": s["blocks_total"],
               **rank.figures(), "transfer_seconds_total": round(sum(rank.transfer_seconds), 4),
               "all_blocks_free_at_end": s["blocks_free_at_end"] == s["blocks_total"]}
    if not figures["all_blocks_free_at_end"]:
        raise AssertionError(f"blocks leaked: {figures}")
    return LessonRun(results, figures)


def run_prefill_rank(argv=None) -> int:
    """Rank 0: no comparison of its own (rank 1 compares every request with HF); one line per send."""
    from harness.cli import run_main, say_error
    from harness.smoke import make_parser, resolve

    def main():
        parser = make_parser(LESSON, __doc__)
        add_options(parser)
        args = parser.parse_args(argv)
        setup = resolve(args)
        check_options(args)
        items = pd_workload(args, setup)
        max_new = {i: w.max_new_tokens for i, w in enumerate(items)}
        stall = {args.stall_transfer: args.transfer_timeout + 1} if args.stall_transfer is not None else {}

        def sent(index, blocks, total):
            print(f"rank 0: sent request {index} ({blocks} blocks in its table; {total} bytes sent so far)", flush=True)

        data = transport.init_group(args.transfer_timeout, args.dist_backend)
        engine = pd_engine(args, setup, items, lambda e: pd.PdSendConnector(e.pool, args.block_size, max_new,
                                                                            stall=stall, on_sent=sent, data=data))
        transport.agree_on_config(pd_config(args, engine, items))
        try:
            figures = pd.run_prefill_rank(engine, items)
        except transport.PeerLostError as exc:
            say_error(str(exc))
            return 2
        engine.alloc.check()
        print("rank 0 (prefill): " + ", ".join(f"{k} {v}" for k, v in figures.items()), flush=True)
        return 0

    return run_main(main, "the decode rank ends what it did not receive")


def run(args, setup) -> LessonRun:
    check_options(args)
    if os.environ.get("WORLD_SIZE", "1") != "1":
        return run_decode_rank(args, setup)
    return run_offload(args, setup)


if __name__ == "__main__":
    world = os.environ.get("WORLD_SIZE", "1")
    if world not in ("1", "2"):
        print(f"error: the two-process form runs on exactly 2 ranks (torchrun --nproc-per-node 2), got {world}",
              file=sys.stderr)
        sys.exit(2)
    if world == "1":
        sys.exit(run_smoke(LESSON, __doc__, run, add_options))
    status = run_prefill_rank() if os.environ.get("RANK") == "0" else run_smoke(LESSON, __doc__, run, add_options)
    # Not sys.exit: a thread may still sit in a gloo call (the peer is gone, or a late payload is
    # due), and tearing the process group down under it aborts the process (SIGABRT) after our line.
    exit_now(status)
