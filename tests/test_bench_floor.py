"""The floor of a step (harness.benchmark) and the engine's packed products (provided code, no points):
bytes and FLOPs counted from the config equal those counted on the model itself, a step's shape
equals a brute-force count of its rows and keys, recording steps leaves the engine's output
unchanged, and every packed or split product equals `nn.Linear`'s within the HF tolerance at every
row count and every number of column blocks."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.benchmark import Machine, ModelCost, StepShape, padded_batch_steps, record_forwards, record_steps
from helpers import hf_ids, load_script, random_prompt
from l1_contiguous import load_config
from l5_eviction import WorkItem, load_engine_model, make_engine
from l8_prefix import SampledWorkItem
from l10_speculative import PromptLookupDrafter, make_spec_engine
from l5_eviction import fast_linear
from l5_eviction.fast_linear import PACKED_ROWS, PackedLinear, SplitLinear, thread_parts

pytestmark = [pytest.mark.l5, pytest.mark.usefixtures("one_torch_thread")]


def test_step_shape_counts_rows_keys_and_cached_tokens_like_a_brute_force_walk():
    spans = [(0, 5), (7, 1), (3, 4)]  # (cached, new): a prefill, a decode, a chunk after 3 cached
    rows = [(c, c + i) for c, n in spans for i in range(n)]  # (cached, position) of each new token
    shape = StepShape.of_requests(spans)
    assert shape.rows == len(rows) == 10 and shape.logit_rows == 3
    assert shape.keys == sum(pos + 1 for _, pos in rows)  # a token reads every key up to its own
    assert shape.kv_tokens == 5 + 8 + 7


def test_padded_batch_steps_run_every_row_to_the_longest_prompt_and_output():
    steps = padded_batch_steps([3, 7], new_tokens=4)
    assert len(steps) == 4 and steps[0].rows == 14 and steps[0].logit_rows == 2
    assert [s.rows for s in steps[1:]] == [2, 2, 2] and [s.kv_tokens for s in steps[1:]] == [16, 18, 20]


@pytest.mark.parametrize("tied", [False, True])
def test_model_cost_counts_the_bytes_and_flops_of_the_model_itself(make_model, tied):
    path = make_model(seed=3, tie_word_embeddings=tied)
    model, cfg = load_engine_model(path, packed_linears=False), load_config(path)
    cost = ModelCost.of(cfg, itemsize=4)
    params = {id(p): p for p in model.parameters()}  # a tied head is one tensor
    embedding = model.model.embed_tokens.weight
    per_step = sum(p.numel() for p in params.values()) - (0 if tied else embedding.numel())
    assert cost.weight_bytes == 4 * per_step  # everything but the embedding, whose rows are read per token
    linear = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, nn.Linear))
    assert cost.flops_per_row == 2 * linear and cost.head_flops_per_row == 2 * model.lm_head.weight.numel()
    decode = StepShape.of_requests([(10, 1)])
    machine = Machine(read_bytes_per_s=1e9, matmul_flops_per_s=1e18)  # memory-bound: floor = bytes / bandwidth
    assert cost.floor_s(decode, machine) == pytest.approx(cost.bytes(decode) / 1e9)
    assert cost.bytes(decode) == 4 * (per_step + cfg.hidden_size) + 11 * cfg.kv_bytes_per_token(4)


def test_recorded_steps_cover_every_token_and_leave_the_ids_as_hf(tiny_model_dir):
    model = load_engine_model(tiny_model_dir)
    items = [WorkItem(random_prompt(n, 512, seed=n), 3) for n in (5, 9, 2)]
    engine = make_engine(model, 16, 4)
    log = record_steps(engine)
    engine.run(items)
    assert [r.output_ids for r in engine.requests.values()] == [hf_ids(tiny_model_dir, w.prompt_ids, 3) for w in items]
    assert len(log) == engine.now and all(seconds > 0 for _, seconds in log)
    # every prompt token, and every new token but the last (its K/V is never needed), runs once
    assert sum(shape.rows for shape, _ in log) == 16 + 3 * 2
    assert sum(shape.logit_rows for shape, _ in log) == 3 * 3


def test_only_large_matrices_are_packed(make_model):
    if not fast_linear.packing_works():
        pytest.skip("this torch has no oneDNN packed product: the engine keeps nn.Linear")
    # a head of 2**20 weights (vocabulary 4096 x hidden 256) and layer matrices far smaller
    model = load_engine_model(make_model(seed=5, vocab_size=4096, hidden_size=256))
    packed = {name for name, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert packed == {"lm_head"} and model.lm_head.weight.numel() == fast_linear.MIN_PACKED_WEIGHTS


def row_counts(x: torch.Tensor) -> list[torch.Tensor]:
    """One row, fewer than a packed block (padded), a block and more, non-contiguous rows, 3-D."""
    return [x[:1], x[:PACKED_ROWS - 1], x[:PACKED_ROWS], x, x[::3], x[:6].view(2, 3, -1)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("one_row_copy", [True, False], ids=["one row on a split copy", "one row padded and packed"])
def test_packed_products_match_the_linears_and_keep_the_tied_weight(make_model, monkeypatch, one_row_copy, threads):
    if not fast_linear.packing_works():
        pytest.skip("this torch has no oneDNN packed product: the engine keeps nn.Linear")
    monkeypatch.setattr(fast_linear, "MIN_PACKED_WEIGHTS", 0)  # pack the small test model's matrices too
    monkeypatch.setattr(fast_linear, "ONE_ROW_COPY_MAX_WEIGHTS", 1 << 40 if one_row_copy else 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # the blocks are cut for this many
    monkeypatch.setattr(fast_linear, "MIN_BLOCK_WEIGHTS", 1)  # the test model's matrices are small
    path = make_model(seed=4, tie_word_embeddings=True)
    fast, plain = load_engine_model(path), load_engine_model(path, packed_linears=False)
    pairs = [(f, p) for f, p in zip(fast.modules(), plain.modules()) if isinstance(p, nn.Linear)]
    assert pairs and all(isinstance(f, PackedLinear) for f, _ in pairs)  # every layer's products and the head
    assert all((f.row_blocks is not None) == one_row_copy for f, _ in pairs)
    if one_row_copy:
        assert {f.row_blocks.shape[0] for f, _ in pairs} == {threads}  # the test model's widths divide by 2
    assert fast.lm_head.weight is fast.model.embed_tokens.weight  # still tied, still the model's dtype/device
    with torch.inference_mode():
        for f, p in pairs:
            for rows in row_counts(torch.randn(2 * PACKED_ROWS + 1, p.in_features)):
                torch.testing.assert_close(f(rows), p(rows), rtol=1e-5, atol=1e-5)
    # Which path one row takes: the split copy where there is one, else the packed product (padded)
    calls = []
    monkeypatch.setattr(fast_linear, "onednn_product", lambda x, w: calls.append(x.shape[0]) or F.linear(x, fast.lm_head.weight))
    with torch.inference_mode():
        fast.lm_head(torch.randn(1, fast.lm_head.weight.shape[1]))
    assert calls == ([] if one_row_copy else [PACKED_ROWS])


@pytest.mark.parametrize("parts", [1, 2, 4])
def test_a_split_product_equals_the_linears_at_every_row_count(parts):
    torch.manual_seed(parts)
    dense = nn.Linear(48, 256, bias=False)
    split = SplitLinear(dense, parts)
    assert split.blocks.shape == (parts, 48, 256 // parts) and split.blocks.is_contiguous()
    assert torch.equal(split.weight, dense.weight)  # the blocks hold W.T's columns in order, nothing lost
    with torch.inference_mode():
        for rows in row_counts(torch.randn(2 * PACKED_ROWS + 1, 48)):
            torch.testing.assert_close(split(rows), dense(rows), rtol=1e-5, atol=1e-5)


def test_thread_parts_is_the_most_threads_that_divide_the_width_into_large_enough_blocks(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(fast_linear, "MIN_BLOCK_WEIGHTS", 32 * 1024)  # at 1,024 inputs: blocks of 32 columns or more

    def parts(out_features, in_features=1024):
        return thread_parts(torch.empty(out_features, in_features))
    assert parts(256) == 4
    assert parts(102) == 3  # 4 does not divide it
    assert parts(96) == 3  # 4 blocks of 24 columns would be too small
    assert parts(66) == 2  # 4 does not divide it, 3 blocks of 22 columns would be too small
    assert parts(101) == 1 and parts(31) == 1
    assert parts(256, in_features=256) == 2  # fewer inputs, fewer weights a column: 4 blocks too small
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert parts(256) == 1


def test_an_engine_on_split_products_decodes_hfs_ids(tiny_model_dir, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(torch, "get_num_threads", lambda: 2)  # cut every product into two blocks
        patch.setattr(fast_linear, "MIN_BLOCK_WEIGHTS", 1)  # however small (the test model's are)
        model = load_engine_model(tiny_model_dir)
    splits = [m for m in model.modules() if isinstance(m, SplitLinear)]
    assert splits and all(m.blocks.shape[0] == 2 for m in splits)
    items = [WorkItem(random_prompt(n, 512, seed=n), 4) for n in (6, 11, 3)]
    engine = make_engine(model, 16, 4)
    engine.run(items)  # a prefill of several rows, decodes of three rows, then of one
    assert [r.output_ids for r in engine.requests.values()] == [hf_ids(tiny_model_dir, w.prompt_ids, 4) for w in items]


def test_bench_l5_prints_a_floor_for_every_system(tmp_path, tiny_model_dir):
    bench = load_script("bench_l5")
    out = tmp_path / "b.json"
    argv = ["--model", str(tiny_model_dir), "--skip-0.6b", "--requests", "4", "--repeat", "1", "--hf-batch-tokens", "64",
            "--json", str(out)]
    assert bench.main(argv) == 0
    model = json.loads(out.read_text())["models"][0]
    floor = {row["system"]: row["floor s"] for row in model["rows"] if "floor s" in row}
    assert len(floor) >= 8 and all(f > 0 for f in floor.values())
    # the padded batch computes every row to the longest prompt and output: more work than the engine's
    assert floor["HF batched"] > floor["L5 engine"]
    steps = model["l5_steps"]
    assert sum(s["rows"] for s in steps) == sum(p + n - 1 for p, n in model["lengths"])
    assert {k["kind"] for k in model["step_kinds"]} == {"decode only", "with prefill"}


def test_record_forwards_counts_every_row_a_verify_reads_logits_for(embedded_model_dir):
    model = load_engine_model(embedded_model_dir)
    prompt = random_prompt(12, 512, seed=1) * 3  # repeats: prompt lookup proposes
    engine = make_spec_engine(model, 64, 16, drafter=PromptLookupDrafter(), k=3)
    engine.eos_ids = set()
    log = record_forwards(engine.runner)
    engine.run([SampledWorkItem(prompt, 20), SampledWorkItem(prompt[:9], 12)])
    assert engine.spec.proposed > 0 and len(log) == engine.spec.forwards
    # one logit row per request per forward (each produced tokens here), plus one per proposal verified
    assert sum(shape.logit_rows for shape, _ in log) == engine.spec.token_steps + engine.spec.proposed


def test_bench_l10_gives_a_floor_to_every_system_whose_forwards_it_sees(tmp_path):
    bench = load_script("bench_l10")
    out = tmp_path / "b.json"
    assert bench.main(["--max-new-tokens", "4", "--repeat", "1", "--batch", "2", "--skip-0.6b", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    floor = {(r["workload"], r["system"]): r["floor ms"] for r in rows}
    hidden = {s for (_, s), f in floor.items() if f is None}
    assert hidden == {"HF prompt lookup", "HF assistant (draft)"}  # HF's speculative steps are not visible
    assert all(f > 0 for f in floor.values() if f is not None)
    # one request at a time, plain decoding does exactly HF greedy's forwards: recorded = counted
    assert floor["embedded, batch 1", "L8 plain"] == pytest.approx(floor["embedded, batch 1", "HF greedy"])


def test_bench_step_splits_a_decode_step_into_phases_inside_the_timed_step(tmp_path, tiny_model_dir):
    bench = load_script("bench_step")
    doc = tmp_path / "b.md"
    argv = ["--model", str(tiny_model_dir), "--skip-0.6b", "--batches", "1,3", "--new", "4", "--repeat", "1",
            "--markdown", str(doc)]
    assert bench.main(argv) == 0  # 0: every batch's ids equal HF's
    text = doc.read_text()
    assert "<!-- BEGIN bench_step" in text and "| model | requests | step ms |" in text
    assert "](img/step_phases.png)" in text and (tmp_path / "img" / "step_phases.png").stat().st_size > 1000
    rows = [line for line in text.splitlines() if line.startswith(f"| {tiny_model_dir.name} |")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        values = dict(zip(bench.COLUMNS + ["ids = HF"], cells))
        phases = [float(values[f"{p} ms"]) for p in bench.PHASES if p != "other"]
        assert all(v >= 0 for v in phases) and float(values["attention ms"]) > 0 and float(values["mlp ms"]) > 0
        assert sum(phases) <= float(values["timed step ms"]) + 0.01  # the phases lie inside the step
        assert float(values["floor ms"]) > 0 and float(values["HF step ms"]) > 0


def test_bench_overhead_puts_each_change_back_and_every_variant_keeps_the_ids(tmp_path, tiny_model_dir):
    bench = load_script("bench_overhead")
    doc = tmp_path / "b.md"
    assert bench.main(["--model", str(tiny_model_dir), "--batches", "1,3", "--new", "3", "--repeat", "1",
                       "--markdown", str(doc)]) == 0  # 0: every variant's ids equal the engine's as it is
    rows = [line for line in doc.read_text().splitlines() if line.startswith("| 1 |") or line.startswith("| 3 |")]
    variants = {line.split("|")[2].strip() for line in rows}
    assert variants == {"after (all)", "before (all)", *(f"before: {c}" for c in bench.CHANGES)}
    assert len(rows) == 2 * len(variants)


def test_bench_overheads_before_contexts_really_put_the_old_code_back(tiny_model_dir, monkeypatch):
    bench = load_script("bench_overhead")
    with monkeypatch.context() as patch:
        patch.setattr(torch, "get_num_threads", lambda: 2)  # products split in two blocks
        patch.setattr(fast_linear, "MIN_BLOCK_WEIGHTS", 1)  # however small (the test model's are)
        # the head packed (the tiny model's is smaller than the threshold), its one-row copy split too
        cfg = load_config(tiny_model_dir)
        patch.setattr(fast_linear, "MIN_PACKED_WEIGHTS", cfg.vocab_size * cfg.hidden_size)
        model = load_engine_model(tiny_model_dir)

    def kinds():
        return {type(m).__name__ for m in model.modules()}
    assert {"FusedRMSNorm", "SplitLinear"} <= kinds()
    with bench.before("norms", model):
        assert "FusedRMSNorm" not in kinds() and "L1Norm" in kinds()
    with bench.before("rotary table", model):
        assert type(model.rotary).__name__ == "RotaryEmbedding"
    assert type(model.rotary).__name__ == "RotaryTable"
    with bench.before("layout", model):
        assert "SplitLinear" not in kinds()

    def block_counts():
        return ({m.blocks.shape[0] for m in model.modules() if isinstance(m, SplitLinear)},
                model.lm_head.row_blocks.shape[0])
    assert block_counts() == ({2}, 2)
    with bench.before("split", model):
        assert block_counts() == ({1}, 1)
    assert block_counts() == ({2}, 2)
    assert {"FusedRMSNorm", "SplitLinear"} <= kinds()  # and back again after
    for change, (owner, name) in {"plan": (bench.PagedPrefillPlan, "run"), "kv write": (bench.KvPool, "set_kv"),
                                  "snapshot": (bench.l5_eviction.engine, "snapshot"),
                                  "qk fused": (bench.l5_eviction.fused, "fused_qk_applies"),
                                  "head row": (bench.PackedLinear, "forward"),
                                  "all rows": (bench.StepRunner, "logits_rows"),
                                  "add+norm": (bench.FusedQwen3Model, "forward"),
                                  "host calls": (bench.l5_eviction.fused, "rms_norm"),
                                  "kv in q/k": (bench.l5_eviction.mixed, "writes_in_projection")}.items():
        now = getattr(owner, name)
        with bench.before(change, model):
            assert getattr(owner, name) is not now, change
        assert getattr(owner, name) is now
