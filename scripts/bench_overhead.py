#!/usr/bin/env python3
"""Each cut of a decode step's overhead, before and after, in one run.

The L5 engine's decode step on the embedded model (B requests of 32 random prompt tokens decoding
--new tokens together, as bench_step.py times it) with one change at a time put back as it was
before, and with all of them put back; every variant runs in each round, rounds alternate, the
best of --repeat is kept. The changes:

  norms       every RMSNorm as one call (FusedRMSNorm: C++ here) instead of L1's formula (eight operations)
  plan        a step's attention checked once and run per layer (L4's PagedPrefillPlan) instead of
              the dispatcher's checks on every layer's call
  kv write    the pool's K/V written with index_copy_ instead of `K[slots] = k` (index_put, which
              splits even a few rows across threads)
  snapshot    the step's rollback snapshot deciding how to save each kind of value once per type
              instead of by isinstance checks on every attribute of every object (a torch.Generator's
              runs Python in torch's metaclass)
  layout      the layers' smaller matrices stored transposed, [in, out], for MKL's x @ W.T, instead
              of nn.Linear's [out, in] (putting it back takes the split below with it: nn.Linear
              has one block)
  split       those matrices, and the head's one-row copy, cut into column blocks, up to one per
              thread, each product one bmm whose blocks run in parallel (fast_linear.SplitLinear),
              instead of one block: MKL's product of a few rows on one thread
  qk fused    q/k norm and rotary as one C++ call (engine_ops.py) instead of ~15 torch operations
  head row    one row through the packed head: the split product on its copy of W.T in column
              blocks (where it fits the cache; else padded to four rows and packed) instead of
              oneDNN's product on the plain layout
  all rows    a step of decodes only hands the model no row index for the head (every row is a
              request's last) instead of gathering rows 0..B-1
  add+norm    each residual add done inside the RMSNorm after it, the residual carried from layer
              to layer (FusedDecoderLayer), instead of L1's layer: an add, then the norm
  host calls  the C++ calls' wrappers reading each size once and reshaping only what is not 2-D
              instead of their first versions (host_op_applies and rms_norm, the most called)
  kv in q/k   the K/V write inside the q/k norm + rotary C++ call (fused.writes_in_projection)
              instead of the pool's set_kv after it (two index_copy_ per layer)
  rotary table  the step's cos/sin rows read from a table (fused.RotaryTable) instead of L1's
              seven operations per step

    python scripts/bench_overhead.py                       # batches 1, 4, 32; 2 threads
    python scripts/bench_overhead.py --markdown docs/benchmarks.md
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import sys
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_step's decode timing

from harness.cli import OneLineParser, guard_startup, run_main  # noqa: E402

guard_startup()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import bench_step  # noqa: E402
import l5_eviction.engine  # noqa: E402
import l5_eviction.fused  # noqa: E402
import l5_eviction.mixed  # noqa: E402
from harness.benchmark import bench_command, load_average, machine_line, markdown_table, print_table, replace_section  # noqa: E402
from harness.smoke import DEFAULT_MODEL, resolve_model_dir  # noqa: E402
from l1_contiguous import load_config  # noqa: E402
from l1_contiguous.model import RMSNorm  # noqa: E402
from l2_paged import KvPool  # noqa: E402
from l4_paged_prefill.varlen import PagedPrefillPlan, paged_prefill_attention  # noqa: E402
from l3_block_kernel import BlockTableRunner  # noqa: E402
from l5_eviction import StepRunner, load_engine_model  # noqa: E402
from l5_eviction.fast_linear import PackedLinear, SplitLinear, onednn_product, split_columns  # noqa: E402
from l5_eviction import engine_ops  # noqa: E402
from l5_eviction.fused import FusedQwen3Model, FusedRMSNorm  # noqa: E402
from l5_eviction.rollback import SKIPPED  # noqa: E402


# ---------------------------------------------------------------- each change, put back as it was


@contextlib.contextmanager
def patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def swapped_modules(model, kind: type, old_form):
    """Each submodule of type `kind` replaced by `old_form(module)` inside the block, then put back."""
    swapped = [(parent, name, child) for parent in list(model.modules())
               for name, child in list(parent.named_children()) if isinstance(child, kind)]
    for parent, name, child in swapped:
        setattr(parent, name, old_form(child))
    try:
        yield
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)


class L1Norm(RMSNorm):
    """L1's RMSNorm (its eight operations), taking the residual stream as FusedRMSNorm does."""

    def forward(self, x, residual=None):
        if residual is None:
            return super().forward(x)
        residual = residual + x
        return super().forward(residual), residual


def l1_norm(norm: FusedRMSNorm) -> L1Norm:
    """L1's RMSNorm module with the same weight and eps."""
    old = L1Norm(norm.weight.shape[0], norm.eps)
    old.weight = norm.weight
    return old


def plain_linear(linear: SplitLinear) -> nn.Linear:
    """nn.Linear, weight [out, in], computing the same product."""
    weight = linear.weight.contiguous()
    old = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    old.weight = nn.Parameter(weight, requires_grad=False)
    return old


@contextlib.contextmanager
def unsplit(model):
    """Every SplitLinear, and every packed matrix's one-row copy, in one block: W.T, no split."""
    with swapped_modules(model, SplitLinear, lambda linear: SplitLinear(plain_linear(linear), parts=1)):
        packed = [m for m in model.modules() if isinstance(m, PackedLinear) and m.row_blocks is not None]
        blocks = [m.row_blocks for m in packed]
        for m in packed:
            m.row_blocks = split_columns(m.weight, 1)
        try:
            yield
        finally:
            for m, old in zip(packed, blocks):
                m.row_blocks = old


def onednn_head_row(self, x):
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if x2.shape[0] == 1:
        y = onednn_product(x2, self.weight.detach())
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return PACKED_FORWARD(self, x)


PACKED_FORWARD = PackedLinear.forward


def unplanned_run(self, q, k_cache, v_cache, window=None):
    return paged_prefill_attention(q, k_cache, v_cache, self.cu_seqlens_q, self.context_lens, self.block_tables,
                                   window=window, backend=self.backend, max_query_len=self.max_query_len,
                                   check_values=False)


def index_put_set_kv(self, layer, slot_mapping, k, v):
    self.K[layer][slot_mapping] = k
    self.V[layer][slot_mapping] = v


def isinstance_snapshot(objects: list) -> list:
    def saved(value):
        if isinstance(value, (list, dict, set, deque)):
            return copy.copy(value)
        if isinstance(value, torch.Generator):
            raise AssertionError("the benchmark's engine holds no generator")
        return value
    return [(obj, {k: saved(v) for k, v in vars(obj).items() if k != SKIPPED}) for obj in objects]


def l1_layer_loop(self, input_ids, cos, sin, kv, meta):
    """FusedQwen3Model.forward with L1's layer: x = x + attn(norm1(x)); x = x + mlp(norm2(x))."""
    x = self.embed_tokens(input_ids)
    for layer in self.layers:
        x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, kv, meta)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return self.norm(x)


def first_host_op_applies(x):
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(-1) == 1 and engine_ops.engine_ops_build()


def first_rms_norm(x, weight, eps):
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(x.shape)
    engine_ops.load_engine_ops().l5_rms_norm(rows.data_ptr(), rows.stride(0), rows.shape[0], rows.shape[1],
                                            weight.data_ptr(), eps, out.data_ptr())
    return out


@contextlib.contextmanager
def first_host_calls():
    with contextlib.ExitStack() as stack:
        for module in (engine_ops, l5_eviction.fused):
            stack.enter_context(patched(module, "host_op_applies", first_host_op_applies))
            stack.enter_context(patched(module, "rms_norm", first_rms_norm))
        yield


def before(change: str, model):
    """A context in which `change` is as it was before."""
    return {
        "norms": lambda: swapped_modules(model, FusedRMSNorm, l1_norm),
        "plan": lambda: patched(PagedPrefillPlan, "run", unplanned_run),
        "kv write": lambda: patched(KvPool, "set_kv", index_put_set_kv),
        "snapshot": lambda: patched(l5_eviction.engine, "snapshot", isinstance_snapshot),
        "layout": lambda: swapped_modules(model, SplitLinear, plain_linear),
        "split": lambda: unsplit(model),
        "qk fused": lambda: patched(l5_eviction.fused, "fused_qk_applies", lambda qkv, cos: False),
        "head row": lambda: patched(PackedLinear, "forward", onednn_head_row),
        "all rows": lambda: patched(StepRunner, "logits_rows", BlockTableRunner.logits_rows),
        "add+norm": lambda: patched(FusedQwen3Model, "forward", l1_layer_loop),
        "host calls": first_host_calls,
        "kv in q/k": lambda: patched(l5_eviction.mixed, "writes_in_projection", lambda *args: False),
        "rotary table": lambda: patched(model, "rotary", model.rotary.rotary),
    }[change]()


CHANGES = ["norms", "plan", "kv write", "snapshot", "layout", "split", "qk fused", "head row", "all rows", "add+norm",
           "host calls", "kv in q/k", "rotary table"]


@contextlib.contextmanager
def all_before(model):
    with contextlib.ExitStack() as stack:
        for change in CHANGES:
            stack.enter_context(before(change, model))
        yield


# ---------------------------------------------------------------- the run


def parse_args(argv=None):
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="HF-format model folder (default: the embedded model)")
    p.add_argument("--new", type=int, default=32, help="tokens each request decodes (default 32)")
    p.add_argument("--repeat", type=int, default=5, help="rounds, best kept (default 5)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--batches", default="1,4,32", help="requests per step, comma-separated (default 1,4,32)")
    p.add_argument("--markdown", metavar="PATH", default=None, help="rewrite the `bench_overhead` section of PATH")
    args = p.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches {args.batches!r}: give counts like 1,4,32")
    if not args.batches or min(args.batches) < 1 or args.new < 2 or args.repeat < 1 or args.threads < 1:
        p.error("--batches counts, --repeat and --threads must be at least 1, --new at least 2")
    return args


def measure(model, args) -> list[dict]:
    variants = {"after (all)": contextlib.nullcontext, "before (all)": lambda: all_before(model),
                **{f"before: {c}": (lambda c=c: before(c, model)) for c in CHANGES}}
    cfg = model.config
    rows = []
    for batch in args.batches:
        prompts = bench_step.prompts(batch, cfg.vocab_size)
        bench_step.decode_steps(model, prompts[:1], 3)  # warm-up
        seconds = {name: [] for name in variants}
        ids = {}
        for _ in range(args.repeat):
            for name, make in variants.items():
                with make():
                    s, out = bench_step.decode_steps(model, prompts, args.new)
                seconds[name].append(s)
                ids[name] = out
        after = min(seconds["after (all)"])
        for name in variants:
            best = min(seconds[name])
            rows.append({"requests": batch, "variant": name, "step ms": 1e3 * best,
                         "median ms": 1e3 * statistics.median(seconds[name]),
                         "saved by the change ms": None if name == "after (all)" else 1e3 * (best - after),
                         "same ids": ids[name] == ids["after (all)"]})
    return rows


def reading(rows: list[dict]) -> str:
    """Before and after, all changes together, per batch size, in this run's numbers."""
    out = []
    for batch in dict.fromkeys(r["requests"] for r in rows):
        mine = {r["variant"]: r for r in rows if r["requests"] == batch}
        after, before = mine["after (all)"]["step ms"], mine["before (all)"]["step ms"]
        out.append(f"{batch} request(s): {before:.2f} -> {after:.2f} ms per step ({before / after:.2f}x)")
    return "All changes together: " + "; ".join(out) + "."


COLUMNS = ["requests", "variant", "step ms", "median ms", "saved by the change ms", "same ids"]


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_at_start = load_average()
    model_dir = resolve_model_dir(args.model)
    load_config(model_dir)
    model = load_engine_model(model_dir)
    with torch.inference_mode():
        rows = measure(model, args)
    print_table(rows, COLUMNS, floatfmt=".2f")
    if args.markdown:
        command = bench_command("bench_overhead.py", sys.argv[1:] if argv is None else argv)
        replace_section(args.markdown, "bench_overhead", (
            f"## Cutting a decode step's overhead, change by change\n\n{machine_line(args.threads, load_at_start)}"
            f"\n\n`{command}`; {model_dir.name}, B requests of {bench_step.PROMPT_LEN} random prompt tokens decoding "
            f"{args.new} tokens together; \"before: X\" puts change X back as it was, \"before (all)\" every one "
            "of them; best of the alternating rounds (the medians beside them show how noisy this shared machine "
            "is: a single change's saving is often inside that noise, the sum of them is not).\n\n"
            + markdown_table(rows, COLUMNS) + "\n\n" + reading(rows)))
    return 0 if all(r["same ids"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(run_main(main, "nothing was written"))
