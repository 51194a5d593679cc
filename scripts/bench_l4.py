#!/usr/bin/env python3
"""L4 benchmark: one layer's attention for prefill chunks, mixed steps and a shared prefix, on a CPU.

Per case (every request's blocks shuffled through one pool, float32, `--threads` torch threads):
  l2_gather_us    L2's read: every request's keys gathered by kv_indices (a copy), a [T, S] mask
                  built from positions, one SDPA call (what the engines ran for prefill rows before L4)
  before_us       what the engines ran before L4, two calls: L3's C++ decode kernel for the requests
                  with one row, L2's read for the others (only those requests' keys gathered)
  l4_cpu_us       L4's C++ kernel: each row reads its keys in place through the block table
  l4_ref_us       L4's PyTorch reference (the oracle; a loop over block columns)
  sdpa_us         SDPA with is_causal on K/V already contiguous, one call per request: what HF runs
                  for a prompt, no pool at all (prefill cases only)
  floor_us        the attention's multiply-adds (the query-key pairs the causal rule keeps, times
                  4 * H * D) over this machine's measured float32 matrix-product rate
  gather_MB       bytes L2's read copies per layer (K and V of every key of every request)
  mask_entries    entries of L2's mask
The cascade case runs B decodes behind one shared prefix: l4_cpu_us reads it once per request,
cascade_us once per tile of all the rows (cascade.py), and both equal the reference.

    python scripts/bench_l4.py                  # the embedded model's shape and Qwen3-0.6B's
    python scripts/bench_l4.py --shapes 0.6b --json l4_bench.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from harness.benchmark import timed  # noqa: E402
from l1_contiguous import attend  # noqa: E402
from l3_block_kernel import paged_attention  # noqa: E402
from l4_paged_prefill import cascade_attention, common_prefix_blocks, paged_prefill_attention  # noqa: E402

SHAPES = {  # query heads, KV heads, head_dim
    "embedded": (4, 2, 32),
    "0.6b": (16, 8, 128),
}
BLOCK_SIZE = 16
CASES = {  # name: (context_lens, query_lens, shared prefix blocks)
    "prefill 256, nothing cached": ([256], [256], 0),
    "chunk 256 after 2048 cached": ([2304], [256], 0),
    "16 decodes at 1024 + chunk 256 after 512": ([1025] * 16 + [768], [1] * 16 + [256], 0),
    "32 decodes behind a shared 1024-token prefix": ([1024 + 32] * 32, [1] * 32, 1024 // BLOCK_SIZE),
}


def make_case(heads, kv_heads, dim, context_lens, query_lens, shared_blocks, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // BLOCK_SIZE) for n in context_lens]
    num_blocks = shared_blocks + sum(c - shared_blocks for c in counts)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(counts), max(counts), dtype=torch.int32)
    start = shared_blocks
    for r, c in enumerate(counts):
        tables[r, :c] = torch.tensor(ids[:shared_blocks] + ids[start:start + c - shared_blocks], dtype=torch.int32)
        start += c - shared_blocks
    shape = (num_blocks, BLOCK_SIZE, kv_heads, dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q = torch.randn(sum(query_lens), heads, dim, generator=gen)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu, torch.tensor(context_lens, dtype=torch.int32), tables


def l2_gather_inputs(case):
    """L2's metadata for the same batch: kv_indices (every key slot, request after request) and the mask."""
    q, k, _, cu, lens, tables = case
    bs = k.shape[1]
    slots, q_pos, q_req, k_pos, k_req = [], [], [], [], []
    for r, (n, length) in enumerate(zip((cu[1:] - cu[:-1]).tolist(), lens.tolist())):
        positions = torch.arange(length)
        slots.append(tables[r, positions // bs].long() * bs + positions % bs)
        q_pos.append(torch.arange(length - n, length))
        q_req.append(torch.full((n,), r))
        k_pos.append(positions)
        k_req.append(torch.full((length,), r))
    q_pos, q_req, k_pos, k_req = (torch.cat(t) for t in (q_pos, q_req, k_pos, k_req))
    mask_parts = (q_req, q_pos, k_req, k_pos)
    return torch.cat(slots), mask_parts


def l2_gather(q, k, v, slots, mask_parts):
    q_req, q_pos, k_req, k_pos = mask_parts
    mask = (q_req[:, None] == k_req[None, :]) & (k_pos[None, :] <= q_pos[:, None])  # built every forward
    flat_k, flat_v = k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])
    return attend(q, flat_k[slots], flat_v[slots], mask)


def split_by_kind(case):
    """The before-L4 engine's two calls: (decode call or None, prefill call or None), each a closure."""
    q, k, v, cu, lens, tables = case
    query_lens = (cu[1:] - cu[:-1]).tolist()
    decodes = [r for r, n in enumerate(query_lens) if n == 1]
    chunks = [r for r, n in enumerate(query_lens) if n > 1]
    calls = []
    if decodes:
        rows = torch.tensor([int(cu[r]) for r in decodes])
        dq, dt, dl = q[rows], tables[decodes].contiguous(), lens[decodes].contiguous()
        calls.append(lambda: paged_attention(dq, k, v, dt, dl, backend="cpu", check_values=False))
    if chunks:
        rows = torch.cat([torch.arange(int(cu[r]), int(cu[r + 1])) for r in chunks])
        sub_cu = torch.tensor([0, *torch.tensor([query_lens[r] for r in chunks]).cumsum(0).tolist()], dtype=torch.int32)
        sub = (q[rows], k, v, sub_cu, lens[chunks], tables[chunks])
        slots, mask_parts = l2_gather_inputs(sub)
        calls.append(lambda: l2_gather(sub[0], k, v, slots, mask_parts))
    return lambda: [call() for call in calls]


def contiguous_sdpa(q, k_rows, v_rows, cu, lens):
    """Per request: SDPA with is_causal on its keys laid out contiguously (HF's prompt path)."""
    outs = []
    for r, (n, length) in enumerate(zip((cu[1:] - cu[:-1]).tolist(), lens.tolist())):
        qr = q[int(cu[r]):int(cu[r + 1])].transpose(0, 1)[None]
        kr, vr = k_rows[r][None], v_rows[r][None]
        # is_causal aligns the mask to the top left; a chunk after cached keys needs the bottom right.
        mask = None if n == length else (torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None])
        outs.append(F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, is_causal=mask is None,
                                                   enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(outs)


def matmul_rate(repeat: int) -> float:
    """Float32 multiply-adds per second of a [512, 1024] x [1024, 1024] product on this machine."""
    a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
    return 512 * 1024 * 1024 / timed(lambda: a @ b, repeat=repeat).best


def visible_pairs(cu, lens) -> int:
    total = 0
    for n, length in zip((cu[1:] - cu[:-1]).tolist(), lens.tolist()):
        total += sum(length - n + i + 1 for i in range(n))
    return total


def run_case(shape_name, case_name, args, rate):
    heads, kv_heads, dim = SHAPES[shape_name]
    context_lens, query_lens, shared = CASES[case_name]
    case = make_case(heads, kv_heads, dim, context_lens, query_lens, shared)
    q, k, v, cu, lens, tables = case
    slots, mask_parts = l2_gather_inputs(case)
    repeat = args.repeat
    row = {"shape": shape_name, "case": case_name, "rows": q.shape[0], "keys": int(lens.sum())}
    want = paged_prefill_attention(*case, backend="reference")
    got = paged_prefill_attention(*case, backend="cpu")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    row["l2_gather_us"] = timed(lambda: l2_gather(q, k, v, slots, mask_parts), repeat=repeat).best * 1e6
    row["before_us"] = timed(split_by_kind(case), repeat=repeat).best * 1e6
    row["l4_cpu_us"] = timed(lambda: paged_prefill_attention(*case, backend="cpu", check_values=False),
                             repeat=repeat).best * 1e6
    if q.shape[0] * int(lens.max()) <= 300_000:  # the reference's loop is slow on long contexts
        row["l4_ref_us"] = timed(lambda: paged_prefill_attention(*case, backend="reference", check_values=False),
                                 repeat=1).best * 1e6
    if len(context_lens) == 1:
        flat_k, flat_v = k.view(-1, kv_heads, dim)[slots], v.view(-1, kv_heads, dim)[slots]
        k_rows, v_rows = [flat_k.transpose(0, 1)], [flat_v.transpose(0, 1)]
        row["sdpa_us"] = timed(lambda: contiguous_sdpa(q, k_rows, v_rows, cu, lens), repeat=repeat).best * 1e6
    if shared:
        blocks = common_prefix_blocks(tables.tolist(), context_lens, query_lens, BLOCK_SIZE)
        torch.testing.assert_close(cascade_attention(*case, blocks, backend="cpu"), want, rtol=1e-4, atol=1e-4)
        row["cascade_us"] = timed(lambda: cascade_attention(*case, blocks, backend="cpu", check_values=False),
                                  repeat=repeat).best * 1e6
        row["shared_blocks"] = blocks
    row["floor_us"] = 2 * heads * dim * visible_pairs(cu, lens) / rate * 1e6
    row["gather_MB"] = 2 * len(slots) * kv_heads * dim * 4 / 1e6
    row["mask_entries"] = q.shape[0] * len(slots)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="embedded,0.6b", help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or args.threads < 1 or args.repeat < 1:
        print(f"bench_l4: --shapes must name {', '.join(SHAPES)}; --threads and --repeat at least 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    rate = matmul_rate(args.repeat)
    print(f"float32 matrix products: {2 * rate / 1e9:.1f} GFLOP/s on {args.threads} threads")
    rows = []
    columns = ("l2_gather_us", "before_us", "l4_cpu_us", "cascade_us", "l4_ref_us", "sdpa_us", "floor_us", "gather_MB",
               "mask_entries")
    print("| shape | case | " + " | ".join(columns) + " |")
    print("| --- | --- |" + " --- |" * len(columns))
    for shape in shapes:
        for case in CASES:
            row = run_case(shape, case, args, rate)
            rows.append(row)
            cells = [f"{row[c]:,.0f}" if c in row else "" for c in columns]
            print(f"| {shape} | {case} | " + " | ".join(cells) + " |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"matmul_flops_per_s": 2 * rate, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
