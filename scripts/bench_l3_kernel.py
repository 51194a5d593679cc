#!/usr/bin/env python3
"""L3 benchmark: decode attention alone, the block-table kernel against two SDPA baselines (GPU only).

Qwen3-0.6B shapes: 16 query heads, 8 KV heads, head_dim 128; one query token per sequence, every
sequence `context` tokens long, its blocks shuffled through the pool. Per case:
  single_us, split_us  the kernel's launch itself (the binding called directly, none of the
                  wrapper's checks), single pass and split-K (partitions of 512 positions)
  gather_sdpa_us  L2's read: k_flat[kv_indices] padded to the longest context, a key-padding mask,
                  then SDPA with enable_gqa; the gather copies the whole history every call
  contig_sdpa_us  SDPA on K/V already laid out as [B, H_kv, L, D]: no gather, the bar to meet
  kv_MB           bytes of K and V the kernel reads: each thread block group reads its KV head's
                  rows once, so 2 * sum(context_lens) * H_kv * D * elem size * reads, where reads =
                  group / heads_per_block (1 for groups of 1, 2, 4, 8; 3 for a group of 6)
  pct_peak        kv_MB over each time, as a fraction of the device's peak bandwidth
--kv-format fp8 / int8 (L12): the pool holds one-byte codes with a float32 scale per KV head; the
kernel reads the codes (kv_MB counts one byte an element), both SDPA baselines read the same values
dequantized into the model's dtype, as an engine without a quantized kernel would hold them.
--window W (L13): every sequence attends to its last W positions only (window_starts = context - W,
the table's columns before the window hold -1, as L13's sliding groups leave them); the baselines
gather or hold those W positions, kv_MB counts them, and full_us times the kernel on the whole
context for comparison.
Every run first reads a buffer twice the size of L2, so the KV comes from memory, not L2.
Target (issue 5): batch 32, context 2048, bf16 on a GPU: >= 70% of peak HBM bandwidth and no
slower than SDPA on contiguous KV. On a machine without CUDA the script says so and exits 0.

    python scripts/bench_l3_kernel.py                               # bf16, batch 1/8/32 x context 512..32k
    python scripts/bench_l3_kernel.py --batches 32 --contexts 2048 --json l3_bench.json
    python scripts/bench_l3_kernel.py --kv-format fp8                # L12's cache, same grid
    python scripts/bench_l3_kernel.py --window 1024 --contexts 2048,8192,32768   # L13's sliding layers
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.cli import OneLineParser, guard_startup, run_main  # noqa: E402

guard_startup()  # Ctrl-C while torch loads: one line, exit 2 (run_main takes over for the work)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from harness.benchmark import check_bench_args, write_text_atomic, print_table  # noqa: E402
from harness.smoke import DTYPES, resolve_device  # noqa: E402
from l1_contiguous import InputError  # noqa: E402
from l3_block_kernel.paged_attention import SPLIT_K_PARTITION, heads_per_block, load_extension  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B
TARGET_BATCH, TARGET_CONTEXT, TARGET_FRACTION = 32, 2048, 0.70
# (substring of torch.cuda.get_device_name(), lowercased; peak HBM GB/s from the data sheet).
# First match wins, so the longer names come first ("a100" before "a10", "l40" before "l4").
PEAK_GBPS = [
    ("h200", 4800), ("h100 nvl", 3900), ("h100 pcie", 2000), ("h100", 3350),  # H100 SXM: "H100 80GB HBM3"
    ("a100-sxm4-80gb", 2039), ("a100 80gb pcie", 1935), ("a100", 1555),
    ("l40", 864), ("l4", 300), ("a10", 600), ("rtx 4090", 1008), ("rtx 3090", 936),
]


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--batches", default=None, help="comma list; default 1,8,32")
    p.add_argument("--contexts", default=None, help="comma list; default 512,2048,8192,32768")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (kernel: 8..128, power of 2)")
    p.add_argument("--repeat", type=int, default=None, help="timed runs per measurement; default 20")
    p.add_argument("--peak-gbps", type=float, default=None, help="the device's peak memory bandwidth, GB/s")
    p.add_argument("--kv-format", choices=["model", "fp8", "int8"], default="model",
                   help="what the pool holds: the model's dtype (default) or L12's one-byte codes")
    p.add_argument("--window", type=int, default=None,
                   help="L13: attend to the last WINDOW positions only (window_starts); default: the whole context")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the rows to PATH")
    args = check_bench_args(p.parse_args(argv), p)
    if args.peak_gbps is not None and not args.peak_gbps > 0:
        p.error(f"--peak-gbps must be a positive bandwidth in GB/s, got {args.peak_gbps}")
    args.device, args.dtype = resolve_device(args.device, args.dtype)
    on_cuda = args.device == "cuda"
    args.batches = _int_list(args.batches or "1,8,32", "--batches")
    args.contexts = _int_list(args.contexts or "512,2048,8192,32768", "--contexts")
    args.repeat = args.repeat or (20 if on_cuda else 3)
    if args.window is not None and args.window < 1:
        raise InputError(f"--window must be a positive number of positions, got {args.window}")
    if args.block_size < 1 or args.repeat < 1:
        raise InputError(f"--block-size and --repeat must be positive, got {args.block_size} and {args.repeat}")
    return args


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise InputError(f"{option} takes a comma list of positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise InputError(f"{option} takes a comma list of positive integers, got {text!r}")
    return values


def make_case(batch: int, context: int, block_size: int, dtype, device, kv_format: str = "model") -> dict:
    """A pool holding `batch` sequences of `context` tokens in shuffled blocks, and their tables.
    kv_format fp8/int8: the pool holds codes, with k_scales, v_scales float32 [H_kv]."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq).int()
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    case = {
        "q": torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, dtype=dtype),
        "block_tables": tables.to(device),
        "context_lens": torch.full((batch,), context, dtype=torch.int32, device=device),
        "k_scales": None, "v_scales": None,
    }
    for name in ("k", "v"):
        if kv_format == "model":
            case[f"{name}_cache"] = torch.randn(shape, device=device, dtype=dtype)
        elif kv_format == "fp8":  # normal values land on e4m3's grid; a scale per head brings them back
            case[f"{name}_cache"] = (4 * torch.randn(shape, device=device)).to(torch.float8_e4m3fn)
            case[f"{name}_scales"] = torch.rand(NUM_KV_HEADS, device=device) / 4 + 0.125
        else:
            case[f"{name}_cache"] = torch.randint(-127, 128, shape, device=device, dtype=torch.int8)
            case[f"{name}_scales"] = torch.rand(NUM_KV_HEADS, device=device) / 64 + 1 / 128
    return case


def dequantized(cache, scales, dtype):
    """The values a code pool stands for, in the model's dtype: [..., H_kv, D] codes * scales [H_kv]."""
    if scales is None:
        return cache
    return (cache.float() * scales[:, None]).to(dtype)


def l2_gather_index(block_tables, context_lens, block_size, window_starts):
    """L2's kv_indices per sequence from its window start, padded to the longest: slots [B, L], valid [B, L]."""
    longest = int((context_lens - window_starts).max())
    positions = window_starts[:, None].long() + torch.arange(longest, device=block_tables.device)  # [B, L]
    valid = positions < context_lens[:, None]
    columns = (positions // block_size).clamp(max=block_tables.shape[1] - 1)
    slots = block_tables.long().gather(1, columns) * block_size + positions % block_size
    return torch.where(valid, slots, 0), valid


def gather_sdpa(q, k_flat, v_flat, slots, valid):
    """q [B, H, D]; k_flat, v_flat [num_slots, H_kv, D]; slots, valid [B, L] -> [B, H, D]."""
    k = k_flat[slots].transpose(1, 2)  # the gather: [B, H_kv, L, D], a copy of every history
    v = v_flat[slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=valid[:, None, None, :], enable_gqa=True)
    return out[:, :, 0]


def contiguous_sdpa(q, k, v):
    """q [B, H, D]; k, v [B, H_kv, L, D] contiguous, every sequence L long -> [B, H, D]."""
    return F.scaled_dot_product_attention(q[:, :, None, :], k, v, enable_gqa=True)[:, :, 0]


def time_us(fn, args, flush) -> float:
    """Median of CUDA-event times around fn alone, L2 flushed before each run."""
    for _ in range(3):
        fn()
    events = []
    for _ in range(args.repeat):
        flush.zero_()  # evict the previous run's KV from L2, so every run reads it from memory
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return 1e3 * sorted(s.elapsed_time(e) for s, e in events)[len(events) // 2]


def run_case(batch: int, context: int, args, flush, peak_gbps: float | None) -> dict:
    case = make_case(batch, context, args.block_size, args.dtype, args.device, args.kv_format)
    q, k_cache, v_cache = case["q"], case["k_cache"], case["v_cache"]
    scales = (case["k_scales"], case["v_scales"])
    forward = load_extension().forward  # the binding itself: no wrapper checks inside the timing
    full_tables = case["block_tables"]
    starts = torch.full_like(case["context_lens"], max(0, context - (args.window or context)))
    window_tables = torch.where(torch.arange(full_tables.shape[1], device=args.device) < starts[:, None] // args.block_size,
                                -1, full_tables)  # [B, max_blocks]: -1 behind the window, as L13 leaves them

    def kernel(partition_size, windowed=True):
        tables, window = (window_tables, starts) if windowed and args.window else (full_tables, None)
        return forward(q, k_cache, v_cache, tables, case["context_lens"], HEAD_DIM ** -0.5, partition_size,
                       *scales, window)

    k_flat, v_flat = (dequantized(c, s, args.dtype).view(-1, NUM_KV_HEADS, HEAD_DIM)
                      for c, s in zip((k_cache, v_cache), scales))
    slots, valid = l2_gather_index(full_tables, case["context_lens"], args.block_size, starts)
    k_contig, v_contig = (f[slots].transpose(1, 2).contiguous() for f in (k_flat, v_flat))
    expected = contiguous_sdpa(q, k_contig, v_contig).float()
    error = max((kernel(p).float() - expected).abs().max().item() for p in (0, SPLIT_K_PARTITION))
    times = {
        "single_us": time_us(lambda: kernel(0), args, flush),
        "split_us": time_us(lambda: kernel(SPLIT_K_PARTITION), args, flush),
        "gather_sdpa_us": time_us(lambda: gather_sdpa(q, k_flat, v_flat, slots, valid), args, flush),
        "contig_sdpa_us": time_us(lambda: contiguous_sdpa(q, k_contig, v_contig), args, flush),
    }
    if args.window:
        times["full_us"] = time_us(lambda: kernel(0, windowed=False), args, flush)
    group = NUM_HEADS // NUM_KV_HEADS
    reads = group // heads_per_block(group)  # blocks that read each KV head's rows
    kv_bytes = 2 * batch * (context - int(starts[0])) * NUM_KV_HEADS * HEAD_DIM * reads
    baseline_bytes = kv_bytes * q.element_size()  # the SDPA baselines read the model's dtype
    kv_bytes *= k_cache.element_size()
    pct = {f"pct_peak_{k[:-3]}": None if peak_gbps is None else
           100 * (kv_bytes if k in ("single_us", "split_us") else baseline_bytes) / us / 1e3 / peak_gbps
           for k, us in times.items() if k != "full_us"}
    return {"batch": batch, "context": context, **times, "kv_MB": kv_bytes / 1e6, **pct, "max_abs_err": error}


def device_peak(args) -> tuple[str, float | None]:
    if args.device == "cpu":
        return "cpu", args.peak_gbps
    name = torch.cuda.get_device_name()
    table = next((gbps for key, gbps in PEAK_GBPS if key in name.lower()), None)
    return name, args.peak_gbps or table


def target_verdict(rows: list[dict], args) -> str:
    goal = (f"target: batch {TARGET_BATCH}, context {TARGET_CONTEXT}, bf16 on a GPU: kernel >= "
            f"{TARGET_FRACTION:.0%} of peak bandwidth and no slower than contiguous SDPA")
    row = next((r for r in rows if (r["batch"], r["context"]) == (TARGET_BATCH, TARGET_CONTEXT)), None)
    if row is None or row["pct_peak_single"] is None:
        why = "the case is not in this grid" if row is None else "the peak is unknown (pass --peak-gbps)"
        return f"{goal}. Not judged: {why}."
    best = min(row["single_us"], row["split_us"])
    pct = max(row["pct_peak_single"], row["pct_peak_split"])
    met = pct >= 100 * TARGET_FRACTION and best <= row["contig_sdpa_us"]
    return (f"{goal}: {pct:.0f}% of peak, {best / row['contig_sdpa_us']:.2f}x the "
            f"contiguous SDPA time -> {'MET' if met else 'NOT MET'}")


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.device == "cpu":
        print("This benchmark times the CUDA kernel; GPU figures need a GPU, and this machine has none "
              "(torch sees no CUDA device). Nothing was measured. On CPU: `python scripts/l3_smoke.py "
              "--backend emulated` runs the kernel's code, and notebooks/L3_block_kernel.ipynb counts the bytes.")
        return 0
    name, peak = device_peak(args)
    print(f"device {name}, {args.dtype}, cache {args.kv_format}, block_size {args.block_size}, peak "
          f"{'unknown' if peak is None else f'{peak:.0f} GB/s'}; H {NUM_HEADS}, H_kv {NUM_KV_HEADS}, D {HEAD_DIM}")
    flush = torch.empty(2 * torch.cuda.get_device_properties(0).L2_cache_size, dtype=torch.uint8, device="cuda")
    try:
        rows = [run_case(b, c, args, flush, peak) for b in args.batches for c in args.contexts]
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_table([{**r, "max_abs_err": f"{r['max_abs_err']:.1e}"} for r in rows])
    print("kv_MB counts each KV head's rows once per thread-block group reading them (group 2 here: once).")
    print(target_verdict(rows, args))
    if args.json:
        meta = {"device": name, "dtype": str(args.dtype), "kv_format": args.kv_format,
                "block_size": args.block_size, "peak_gbps": peak}
        write_text_atomic(args.json, json.dumps({**meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
