"""The lessons' worked examples and sizing tables, recomputed by the code they describe.

Each check computes a row (or a sentence's figure) with the course's code and requires the lesson
to print exactly that; a change to the code that moves a figure fails here, naming the lesson.
"""

from __future__ import annotations

import re

import pytest
import torch

from harness.lesson_quotes import LESSONS
from l1_contiguous.config import Qwen3Config

pytestmark = [pytest.mark.course, pytest.mark.usefixtures("one_torch_thread")]

SHAPES = {  # the real checkpoints' shapes (config.json of each)
    "Qwen3-0.6B": dict(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       hidden_size=1024, intermediate_size=3072),
    "Qwen3-8B": dict(num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     hidden_size=4096, intermediate_size=12288),
}


def config(name: str) -> Qwen3Config:
    return Qwen3Config.from_dict({"model_type": "qwen3", "vocab_size": 151936, "intermediate_size": 3072,
                                  **SHAPES[name]})


def assert_in_lesson(lesson: str, *expected: str) -> None:
    """`lesson` is a file of lessons/ or, with a slash, a path from the repository root (docs/...)."""
    path = LESSONS.parent / lesson if "/" in lesson else LESSONS / lesson
    text = " ".join(path.read_text().split())  # wrapping and indentation do not matter
    for piece in expected:
        assert " ".join(piece.split()) in text, f"{path.relative_to(LESSONS.parent)} should contain: {piece}"


def n(x: int) -> str:
    return f"{x:,}"


def layer_weights(cfg: Qwen3Config) -> int:
    """The weights every token multiplies in the layers (q, k, v, o, MLP): the lessons' FLOP count
    is 2 per such weight per token; the embedding is a lookup and the head runs on the last row."""
    h, d = cfg.hidden_size, cfg.head_dim
    attention = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d + cfg.num_attention_heads * d * h
    return cfg.num_hidden_layers * (attention + 3 * h * cfg.intermediate_size)


def test_l1_bytes_per_token_table():
    for name in SHAPES:
        cfg = config(name)
        per_token = cfg.kv_bytes_per_token(2)
        L, H, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        assert_in_lesson("L1-contiguous.md", f"| {name} | {L} | {H} | {D} | 2·{L}·{H}·{D}·2 = {n(per_token)} "
                                             f"| {per_token * 4096 // 2**20} MiB |")


def test_l2_pool_sizing_table():
    from l2_paged.pool import bytes_per_block, num_blocks_for_budget

    for name, budget_gb in (("Qwen3-0.6B", 74.8), ("Qwen3-8B", 59.6)):
        cfg = config(name)
        blocks = num_blocks_for_budget(cfg, int(budget_gb * 1e9), 16, torch.bfloat16)
        assert_in_lesson("L2-paged.md", f"| {budget_gb} GB | {n(blocks)} | {n(blocks * 16)} | {blocks * 16 // 4096} |",
                         f"| {n(cfg.kv_bytes_per_token(2))} | {n(bytes_per_block(cfg, 16, torch.bfloat16))} (")
    blocks = num_blocks_for_budget(config("Qwen3-8B"), int(53.6e9), 16, torch.bfloat16)  # engines §1.1
    assert_in_lesson("docs/engines.md", f"{n(blocks)} blocks of 16 ({n(blocks * 16)} token slots)")


def test_l4_step_metadata_and_cascade():
    """L4 §4: a (blocks [3, 8, 1], 6 cached, a chunk of 4), b ([5, 2], 6 cached, a decode), c ([4], a
    first chunk of 2), block size 4; then three decodes behind two shared blocks."""
    from l2_paged import Request
    from l4_paged_prefill import build_paged_meta, common_prefix_blocks, query_positions

    def holding(blocks, cached, prompt_len, output=()):
        slots = [b * 4 + row for b in blocks for row in range(4)]
        return Request(prompt_ids=list(range(prompt_len)), blocks=blocks, slot_indices=slots, cur_len=cached,
                       output_ids=list(output))

    reqs = [holding([3, 8, 1], 6, 10), holding([5, 2], 6, 6, output=[7]), holding([4], 0, 2)]
    _, meta = build_paged_meta(reqs, [4, 1, 2], "cpu")
    positions, _ = query_positions(meta.cu_seqlens_q, meta.context_lens)
    lens, pos, slots = meta.context_lens.tolist(), positions.tolist(), meta.slot_mapping.tolist()
    assert_in_lesson("L4-paged-prefill.md",
                     f"| `context_lens` | {lens[0]} | {lens[1]} | {lens[2]} |",
                     f"| positions (`query_positions`) | {', '.join(map(str, pos[:4]))} | {pos[4]} | {pos[5]}, {pos[6]} |",
                     f"| `slot_mapping` (block · 4 + row) | {', '.join(map(str, slots[:4]))} | {slots[4]} | "
                     f"{slots[5]}, {slots[6]} |")
    keys = sum(lens)
    read = sum(p + 1 for p in pos)
    assert_in_lesson("L4-paged-prefill.md", f"listed {' + '.join(map(str, lens))} = {keys} key slots",
                     f"a {len(pos)} × {keys} = {len(pos) * keys}-entry mask, {len(pos) * keys - read} of")
    tables = [[7, 2, 9, 4], [7, 2, 5], [7, 2, 6, 1]]
    assert common_prefix_blocks(tables, [14, 11, 16], [1, 1, 1], 4) == 2
    assert common_prefix_blocks(tables, [14 - 7, 11, 16], [1, 1, 1], 4) == 1  # the first request at position 6
    assert_in_lesson("L4-paged-prefill.md", "`common_prefix_blocks` gives 2", "the answer is 1")


def test_l3_decode_step_metadata():
    """L3 §4: A, B, C hold 20, 5 and 13 tokens in blocks [0, 3, 4], [1], [2, 5] of 8 and decode one each."""
    from l2_paged import Request
    from l3_block_kernel.meta import build_block_meta

    def holding(blocks, length):
        slots = [b * 8 + row for b in blocks for row in range(8)]
        return Request(prompt_ids=list(range(length + 1)), blocks=blocks, slot_indices=slots, cur_len=length)

    reqs = [holding([0, 3, 4], 20), holding([1], 5), holding([2, 5], 13)]
    _, meta = build_block_meta(reqs, [1, 1, 1], "cpu")
    cells = lambda values: " | ".join(map(str, values))  # noqa: E731
    assert_in_lesson("L3-block-kernel.md",
                     f"| position of the new token | {cells(meta.positions.tolist())} |",
                     f"| `slot_mapping` (block · 8 + row) | {cells(meta.slot_mapping.tolist())} |",
                     f"| `block_tables` row | {cells(f'`{row}`' for row in meta.block_tables.tolist())} |",
                     f"| `context_lens` | {cells(meta.context_lens.tolist())} |")
    assert meta.kv_indices is None and meta.attn_mask is None
    assert_in_lesson("L3-block-kernel.md", f"a {sum(meta.context_lens.tolist())}-entry `kv_indices`")


def _l5_trace(model, mode: str):
    """L5 §4: 6 blocks of 4, LRU, watermark 1; A (6 + 8), B (5 + 8) at step 0, C (3 + 6) at step 2."""
    from l5_eviction import WorkItem, make_engine

    engine = make_engine(model, num_blocks=6, block_size=4, preempt=mode)
    for prompt, new, arrival in ((6, 8, 0), (5, 8, 0), (3, 6, 2)):
        engine.add_request(WorkItem(list(range(10, 10 + prompt)), new, arrival_step=arrival))
    rows = []
    while engine.has_unfinished():
        record = engine.step()
        rows.append((record, {i: (r.cur_len, len(r.output_ids), r.state.value) for i, r in engine.requests.items()}))
    return engine, rows


def _l5_table() -> dict[int, list[str]]:
    """Last step of each row of the lesson's table -> its cells A, B, C, used / free."""
    table = {}
    for line in (LESSONS / "L5-eviction.md").read_text().split("\n"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and re.fullmatch(r"\d+(?:[,–] ?\d+)?", cells[0]):
            table[int(re.split(r"[,–] ?", cells[0])[-1])] = cells[2:]
    return table


def _l5_steps_covered() -> set[int]:
    """Every step the table's rows name ("5, 6" and "9–11" count every step they span)."""
    covered = set()
    for line in (LESSONS / "L5-eviction.md").read_text().split("\n"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and re.fullmatch(r"\d+(?:[,–] ?\d+)?", cells[0]):
            ends = [int(x) for x in re.split(r"[,–] ?", cells[0])]
            covered.update(range(ends[0], ends[-1] + 1))
    return covered


@pytest.mark.parametrize("lesson", sorted(p.name for p in LESSONS.glob("L*.md")))
def test_exercise_checks_name_only_exercises_that_exist(lesson):
    """Each lesson's check table has one row per exercise: no row for an exercise that is not there."""
    text = (LESSONS / lesson).read_text()
    part = re.split(r"^## \d+\. Exercises\s*$", text, flags=re.M)
    if len(part) < 2 or "How to check each one" not in part[1]:
        pytest.skip(f"{lesson} has no exercises with a check table")
    body = re.split(r"^## ", part[1], flags=re.M)[0]
    listed, checks = body.split("How to check each one", 1)
    exercises = set(re.findall(r"^(\d+)\. ", listed, re.M))
    rows = set(re.findall(r"^\| (\d+) \|", checks, re.M))
    assert rows == exercises, (lesson, sorted(rows, key=int), sorted(exercises, key=int))


def test_l5_worked_example(tiny_model_dir):
    from l5_eviction import load_engine_model

    model = load_engine_model(tiny_model_dir)
    engine, rows = _l5_trace(model, "recompute")
    table = _l5_table()
    assert set(table) <= {r.step for r, _ in rows} and len(table) >= 8, "the L5 §4 table was not found"
    assert _l5_steps_covered() == set(range(max(table) + 1)), "the L5 §4 table skips a step"
    for record, reqs in rows:
        if record.step not in table:
            continue
        want = table[record.step]
        assert want[3] == f"{record.blocks_used} / {record.blocks_free}", f"L5 §4, step {record.step}: used / free"
        for i, cell in enumerate(want[:3]):
            if cell != "—":
                cur_len, outputs, _ = reqs[i]
                assert re.match(rf"{cur_len} / {outputs}\b", cell), f"L5 §4, step {record.step}, request {'ABC'[i]}"
    counters = engine.preemptor.counters
    computed = sum(r.prefill_tokens + r.decode_tokens for r, _ in rows)
    assert_in_lesson("L5-eviction.md", f"`tokens_recomputed = 4 + 11 = {counters.tokens_recomputed}`",
                     f"= {computed} tokens = final `cur_len`s")
    assert len(rows) == 12 and counters.preempted_recompute == 2  # "Twelve steps, two preemptions"
    swap, swap_rows = _l5_trace(model, "swap")
    assert len(swap_rows) == 12 and swap.preemptor.counters.tokens_recomputed == 0  # "Twelve steps again"
    per_token_fp32 = 4096  # the lesson states the embedded model's figure; the bytes are counted in blocks
    blocks = swap.preemptor.counters.bytes_swapped_out // (4 * model.config.kv_bytes_per_token(4))
    assert_in_lesson("L5-eviction.md", f"{blocks} blocks copied each way: {blocks} × 4 positions × {n(per_token_fp32)} "
                                       f"bytes = {n(blocks * 4 * per_token_fp32)} bytes")


def test_l8_worked_example():
    """L8 §4: the smoke script's default workload, step by step (hits and computed tokens per arrival)."""
    import runpy

    from harness.smoke import make_parser, resolve

    script = runpy.run_path(str(LESSONS.parent / "scripts" / "l8_smoke.py"), run_name="l8_smoke_worked_example")
    engines = []
    real, module = script["make_prefix_engine"], script["run"].__globals__  # run_path returns a copy
    module["make_prefix_engine"] = lambda *a, **k: engines.append(real(*a, **k)) or engines[-1]
    parser = make_parser("L8", "")
    script["add_options"](parser)
    args = parser.parse_args(["--device", "cpu"])
    script["run"](args, resolve(args))
    timeline = engines[0].metrics_timeline
    start = {"prefix_hit_tokens": 0, "prefill_tokens_computed": 0}
    hits, computed = ([b[key] - a[key] for a, b in zip([start] + timeline, timeline)]  # per step
                      for key in ("prefix_hit_tokens", "prefill_tokens_computed"))
    rows = {}
    for line in (LESSONS / "L8-prefix.md").read_text().split("\n"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].isdigit() and cells[1].startswith("prompt"):
            rows[int(cells[0])] = cells
    assert len(rows) == 5, "the L8 §4 table was not found"
    for step, cells in rows.items():
        assert (cells[3], cells[4]) == (str(hits[step]), str(computed[step])), f"L8 §4, step {step}: hit, computed"
    total = engines[0].metrics()
    work = " + ".join(str(computed[s]) for s in sorted(rows))
    assert_in_lesson("L8-prefix.md", f"Prefill tokens computed: {work} = **{total['prefill_tokens_computed']}**",
                     f"{total['prefix_hit_tokens']} hit tokens, {total['fork_shared_tokens']} received by the forks",
                     f"{total['prefix_hit_tokens']} / {total['prefill_tokens_total']} = "
                     f"{total['prefix_hit_tokens'] / total['prefill_tokens_total']:.3f}")


def test_l3_online_softmax_table():
    """L3 §2.4: scores [1, 3, 2, 4, 0], values [1, 2, 3, 4, 5], blocks of 2, one block at a time."""
    import math

    m, l, acc, rows = -math.inf, 0.0, 0.0, []
    for scores, values in (([1, 3], [1, 2]), ([2, 4], [3, 4]), ([0], [5])):
        m_new = max(m, *scores)
        rescale = math.exp(m - m_new)
        p = [math.exp(s - m_new) for s in scores]
        l, acc = l * rescale + sum(p), acc * rescale + sum(pi * v for pi, v in zip(p, values))
        m = m_new
        rows.append((l, acc))
    direct = sum(math.exp(s) * v for s, v in zip([1, 3, 2, 4, 0], [1, 2, 3, 4, 5])) / sum(
        math.exp(s) for s in [1, 3, 2, 4, 0])
    assert abs(acc / l - direct) < 1e-12
    assert_in_lesson("L3-block-kernel.md", *(f"= {x:.4f} |" for row in rows for x in row),
                     f"`out = {acc:.4f} / {l:.4f} = {acc / l:.4f}`", f"gives the same {direct:.4f}")


def test_l2_worked_example_counters(tiny_model_dir):
    """L2 §4: block size 4, 8 blocks; A, B, C with prompts of 3, 6, 9 and 2, 5, 3 new tokens."""
    from l2_paged import BlockAllocator, KvPool, PagedRunner, Request, load_paged_model

    model = load_paged_model(tiny_model_dir)
    runner = PagedRunner(model, KvPool(model.config, 8, 4, torch.float32), BlockAllocator(8, 4))
    runner.generate([Request(list(range(1, 1 + p)), max_new_tokens=m, request_id=i)
                     for i, (p, m) in enumerate([(3, 2), (6, 5), (9, 3)])])
    stats = runner.stats
    assert_in_lesson("L2-paged.md", f"Counters after each step: blocks used `{stats.blocks_used}`, peak "
                                    f"{runner.alloc.peak_used}; wasted slots `{stats.wasted_slots}`.",
                     f"A gets `{stats.owners[0][0]}`, B `{stats.owners[0][1]}`, C `{stats.owners[0][2]}`",
                     f"releases `{stats.owners[3][1]}`. All 8 blocks are free.")


def test_what_engines_do_now_arithmetic():
    """L1 §10's table and docs/engines.md: bytes per token from the configs (fp8, tensor parallel,
    latent caches), and L3 §10's chunk over a long cached context."""
    cfg = config("Qwen3-8B")
    L, H, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    bf16 = cfg.kv_bytes_per_token(2)
    per_gpu = [2 * L * max(1, H // tp) * D * 2 for tp in (1, 2, 4, 8, 16)]  # a KV head is never split
    assert_in_lesson("docs/engines.md", "| bytes per token per GPU | " + " | ".join(map(n, per_gpu)) + " |")
    latent = L * (512 + 64) * 2
    assert_in_lesson("L1-contiguous.md", f"| {n(bf16)} | section 4 |",
                     f"| {n(cfg.kv_bytes_per_token(1))} | `docs/engines.md` §2.2 |",
                     f"| {n(per_gpu[2])} per GPU | `docs/engines.md` §1.2 |", f"× 2 | {n(latent)} | below |",
                     f"61 × 576 × 2 = {n(61 * 576 * 2)}")
    assert_in_lesson("docs/engines.md", f"Qwen3-8B's {n(bf16)} bytes per token become {n(cfg.kv_bytes_per_token(1))}")
    chunk, cached = 512, 16384
    matmul = 2 * layer_weights(cfg) * chunk
    attention = 4 * L * cfg.num_attention_heads * D * chunk * (chunk + cached)
    assert_in_lesson("L3-block-kernel.md", f"(L + C) × {n(bf16)} B = {n(chunk + cached)} × {n(bf16)} B = "
                                           f"{(chunk + cached) * bf16 / 1e9:.2f} GB",
                     f"2 × {layer_weights(cfg) / 1e9:.2f}e9 × 512 ≈ {matmul / 1e12:.1f} TFLOP",
                     f"≈ {attention / 1e12:.1f} TFLOP (either way)", f"next to {(matmul + attention) / 1e12:.1f} TFLOP")


def test_l5_swap_or_recompute_table():
    """L5 §2.6: a 2,048-token victim, 50 GB/s each way, 40% of 989 TFLOP/s; bytes from the configs,
    FLOPs over the layers' weights plus causal attention."""
    tokens, link, compute = 2048, 50e9, 0.4 * 989e12
    for name, tflop, ms in (("Qwen3-0.6B", "{:.2f}", "{:.1f}"), ("Qwen3-8B", "{:.1f}", "{:.0f}")):
        cfg = config(name)
        kv = cfg.kv_bytes_per_token(2) * tokens
        matmul = 2 * layer_weights(cfg) * tokens
        attention = 4 * cfg.num_hidden_layers * (tokens ** 2 // 2) * cfg.num_attention_heads * cfg.head_dim
        assert_in_lesson("L5-eviction.md",
                         f"| {name} | {n(cfg.kv_bytes_per_token(2))} × {n(tokens)} = {kv / 1e6:.1f} MB "
                         f"| {kv / link * 1e3:.1f} ms | {2 * kv / link * 1e3:.1f} ms "
                         f"| {tflop.format(matmul / 1e12)} + {attention / 1e12:.2f} = "
                         f"{tflop.format((matmul + attention) / 1e12)} TFLOP "
                         f"| {ms.format((matmul + attention) / compute * 1e3)} ms |")


def test_l13_worked_example():
    """L13 §4: the tables of one request, recomputed with the lesson's grow_tables and free_behind_window."""
    from l2_paged import BlockAllocator
    from l13_sliding_window import NULL_BLOCK, HybridRequest, KvCacheGroup, free_behind_window, grow_tables

    def show(table):
        return "[" + " ".join("-" if b == NULL_BLOCK else str(b) for b in table) + "]"

    groups = [KvCacheGroup((1, 3), None), KvCacheGroup((0, 2), 6)]
    alloc, req, rows = BlockAllocator(16, 4), HybridRequest(list(range(10)), 8), []
    for n in (10, 1, 1, 1, 1, 1):
        start = req.cur_len
        grow_tables(req, groups, alloc, start + n)
        during = [show(t) for t in req.tables]
        req.cur_len += n
        freed = free_behind_window(req, groups, alloc)
        oldest = max(0, req.cur_len - 6 + 1)
        rows.append(f"| {start}..{start + n - 1} | {during[0]} | {during[1]} | {oldest}..{req.cur_len} | "
                    f"{show(req.tables[1])} | {freed} | {alloc.num_used} |")
    text = (LESSONS / "L13-sliding-window.md").read_text()
    table = "\n".join(rows)
    assert table in text, f"L13 §4's table should read:\n{table}"


def test_l14_worked_example(embedded_model_dir):
    """L14 §4: two requests prefilled in one pool and moved into another, with the lesson's
    plan_receive, receive and the wire's pack; the table's block ids and counts recomputed."""
    from l5_eviction import WorkItem, load_engine_model
    from l8_prefix import chain_keys
    from l14_kv_transfer import KvConnector, make_offload_engine, pd

    class Holding(KvConnector):  # keeps each finished request's blocks, as a send in flight does
        def __init__(self):
            super().__init__()
            self.held = []

        def request_finished(self, req):
            self.held.append(req)
            return True

    def show(blocks):
        return "[" + " ".join(map(str, blocks)) + "]"

    model = load_engine_model(embedded_model_dir)
    prefill, decode = make_offload_engine(model, 8, 4), make_offload_engine(model, 8, 4)
    prefill.connector = Holding()
    decode.alloc.alloc_blocks(2)  # blocks 0 and 1 in use by other requests
    a = list(range(100, 110))
    prefill.run([WorkItem(a, 1), WorkItem(a[:8] + [200, 201, 202], 1, arrival_step=1)])
    rows, crossed = [], 0
    for name, req in zip("AB", prefill.connector.held):
        keys = chain_keys(req.prompt_ids, 4)
        held, fresh = pd.plan_receive(decode.alloc, keys, len(req.blocks))
        sent = req.blocks[len(held):]
        header = pd.Header(0, req.prompt_ids, req.output_ids[0], len(req.blocks), keys, False, 3)
        pd.receive(decode, header, held, fresh, pd.pack_blocks(prefill.pool, sent))
        holds = f"{show(held)} (k0, k1)" if held else "none"
        rows.append(f"| {name} | {show(req.blocks)} | k0, k1 | {holds} | {show(fresh)} | "
                    f"{', '.join(map(str, sent))} ({len(sent)} block{'s' if len(sent) > 1 else ''}) | {show(held + fresh)} |")
        crossed += len(sent)
    text = (LESSONS / "L14-kv-transfer.md").read_text()
    table = "\n".join(rows)
    assert table in text, f"L14 §4's table should read:\n{table}"
    assert [decode.alloc.ref_count[b] for b in (2, 3)] == [2, 2]
    per_block = pd.pack_blocks(prefill.pool, [0]).numel()
    assert_in_lesson("L14-kv-transfer.md", f"{crossed} blocks of {n(per_block)} bytes crossed instead of 6",
                     f"shares blocks 2 and 3 (reference counts 2 while A still runs)")
