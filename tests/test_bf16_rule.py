"""The bfloat16 comparison rule (harness/compare.py) passes correct engines at real near-ties and
still fails planted bugs, on a CPU in bfloat16, through the smoke scripts themselves.

Each planted bug is one a student could write; each must end in FAIL (exit 1), not in a pass
excused as rounding. The last two show the point of teacher forcing: a bug that starts after a
request's first (genuine) near-tie still fails."""

from __future__ import annotations

import pytest
import torch

from harness import compare
from helpers import run_script_json

pytestmark = [pytest.mark.course]

BF16 = ["--dtype", "bfloat16", "--device", "cpu"]


def verdicts(report: dict) -> list[str]:
    return [r["verdict"] for r in report["requests"]]


# ---------------------------------------------------------------- the rule's arithmetic


def test_spacing_is_the_formats_resolution():
    """bfloat16 keeps 8 significant bits: from 8 to 16 its values are 1/16 apart; float16's 1/128."""
    assert compare.spacing(torch.bfloat16, 10.0) == 0.0625
    assert compare.spacing(torch.bfloat16, 16.0) == 0.125
    assert compare.spacing(torch.float16, 10.0) == 2 ** -7
    for value in (0.3, 3.0, 30.0, 300.0):
        x = torch.tensor(value, dtype=torch.bfloat16)
        assert float(torch.nextafter(x, torch.tensor(1e9, dtype=torch.bfloat16)) - x) == \
            compare.spacing(torch.bfloat16, float(x))


def test_float32_owes_equal_ids():
    logits = torch.zeros(3, 8)
    assert compare.verdict(torch.float32, [1, 2, 3], [1, 2, 3], logits, None, 4).kind == "equal"
    assert compare.verdict(torch.float32, [1, 2, 4], [1, 2, 3], logits, None, 4).kind == "fail"


def _rows(winner: list[int], gap: float, vocab: int = 8, top: float = 10.0) -> torch.Tensor:
    rows = torch.zeros(len(winner), vocab)
    for i, w in enumerate(winner):
        rows[i, w], rows[i, (w + 1) % vocab] = top, top - gap
    return rows


def test_a_divergence_passes_only_at_a_near_tie_with_the_forced_path_close():
    hf_ids, ours = [1, 2, 3], [1, 2, 4]
    tol = compare.logit_tolerance(torch.bfloat16, torch.tensor([10.0]), 4)
    tie = compare.tie_bound(torch.bfloat16, torch.tensor([10.0]), 4)
    hf = _rows(hf_ids, tol / 2)  # at position 2, HF's 3 leads 4 by half the logit tolerance
    forced = [[hf[0]], [hf[1]], [hf[2] + torch.eye(8)[4] * tol * 0.75]]  # ours: 4 slightly ahead
    assert compare.verdict(torch.bfloat16, ours, hf_ids, hf, forced, 4).kind == "near-tie"
    far = _rows(hf_ids, 4 * tie)
    assert compare.verdict(torch.bfloat16, ours, hf_ids, far, [[r] for r in far], 4).kind == "fail"
    # the same near-tie, but a later forced row far from HF's: a bug after the tie
    bad = [[hf[0]], [hf[1] + 5.0 * torch.eye(8)[0]], [forced[2][0]]]
    v = compare.verdict(torch.bfloat16, ours, hf_ids, hf, bad, 4)
    assert v.kind == "fail" and "teacher-forced, new token 1" in v.reason


def test_ours_must_rank_hfs_id_among_its_top_few():
    hf_ids, ours = [5], [6]
    hf = _rows(hf_ids, 0.0)  # HF: 5 and 6 tie at 10
    close = hf[0].clone()
    close[6] += 0.0625  # ours: 6 one spacing ahead, 5 second
    assert compare.verdict(torch.bfloat16, ours, hf_ids, hf, [[close]], 4).kind == "near-tie"
    far = close.clone()
    far[5] = -50.0  # HF's id nowhere near our top
    v = compare.verdict(torch.bfloat16, ours, hf_ids, hf, [[far]], 4)
    assert v.kind == "fail" and "not among our top" in v.reason


# ---------------------------------------------------------------- real near-ties pass


def test_the_l8_workload_passes_in_bf16_with_near_ties(capsys):
    status, report, _ = run_script_json("l8_smoke", BF16, capsys)
    assert status == 0, report and [r["verdict_reason"] for r in report["requests"]]
    kinds = verdicts(report)
    assert "near-tie" in kinds and "fail" not in kinds, kinds  # the tie is real, and cleared
    for row in report["requests"]:
        if row["verdict"] == "near-tie":
            assert row["teacher_forced_max_spacings"] <= compare.logit_spacings(4)


# ---------------------------------------------------------------- planted bugs fail


def test_rope_one_position_off_for_one_token_fails(capsys, monkeypatch):
    from l1_contiguous.model import RotaryEmbedding

    original = RotaryEmbedding.cos_sin

    def off_by_one_at_12(self, positions, dtype):
        return original(self, torch.where(positions == 12, positions + 1, positions), dtype)

    monkeypatch.setattr(RotaryEmbedding, "cos_sin", off_by_one_at_12)
    status, report, _ = run_script_json("l2_smoke", BF16, capsys)
    assert status == 1 and "fail" in verdicts(report), verdicts(report)


def test_kv_heads_mapped_to_the_wrong_query_group_fails(capsys, monkeypatch):
    import l1_contiguous.model as model

    original = model.attend

    def tiled_heads(q, k, v, mask):  # query head h reads KV head h % H_kv instead of h // group
        group = q.shape[1] // k.shape[1]
        return original(q, k.repeat(1, group, 1), v.repeat(1, group, 1), mask)

    monkeypatch.setattr(model, "attend", tiled_heads)
    status, report, _ = run_script_json("l1_smoke", BF16, capsys)
    assert status == 1 and "fail" in verdicts(report), verdicts(report)


def test_a_block_table_entry_of_another_request_after_a_preemption_fails(capsys, monkeypatch):
    import l4_paged_prefill.meta as meta
    from l5_eviction.preempt import Preemptor

    preempted: set[int] = set()
    original_preempt, original_tables = Preemptor.preempt, meta.build_block_tables

    def remember(self, req):
        preempted.add(req.request_id)
        return original_preempt(self, req)

    def stale_entry(reqs, context_lens, device):
        tables, lens = original_tables(reqs, context_lens, device)
        for i, req in enumerate(reqs):  # a resumed request's first entry: another request's block
            if req.request_id in preempted and len(reqs) > 1:
                other = (i + 1) % len(reqs)
                tables[i, 0] = tables[other, 0]
        return tables, lens

    monkeypatch.setattr(Preemptor, "preempt", remember)
    monkeypatch.setattr(meta, "build_block_tables", stale_entry)
    status, report, _ = run_script_json("l5_smoke", BF16, capsys)
    assert preempted, "the L5 smoke's workload preempts nobody: the bug was never planted"
    assert status == 1 and "fail" in verdicts(report), verdicts(report)


def test_a_stale_cached_block_reused_in_l8_fails(capsys, monkeypatch):
    """Keys not chained over the parent: the second prompt's first block (tokens S) 'finds' the
    first prompt's second block (the same tokens S, after another block, at other positions) and
    reuses K/V computed for another context."""
    import l8_prefix.block_hash as block_hash
    import l8_prefix.kv_manager as engine

    original = block_hash.block_key

    def unchained(parent, tokens):
        return original(None, tokens)

    monkeypatch.setattr(block_hash, "block_key", unchained)
    monkeypatch.setattr(engine, "block_key", unchained)
    shared = list(range(300, 316))
    first = list(range(100, 116)) + shared + [7, 8, 9]
    second = shared + [7, 8, 9]
    argv = BF16 + ["--prompt-ids", ",".join(map(str, first)), "--prompt-ids", ",".join(map(str, second))]
    status, report, _ = run_script_json("l8_smoke", argv, capsys)
    assert report["prefix_hit_tokens"] >= 16, "the second prompt hit nothing: the bug was never planted"
    assert status == 1 and verdicts(report)[1] == "fail", verdicts(report)


def test_a_rewind_that_clears_one_token_too_many_fails(capsys, monkeypatch):
    """L10's rewind, off by one where it clears the rejected proposals' K/V: it starts one slot
    early and wipes the last accepted token's K/V, which later tokens still read."""
    import l10_speculative.engine as engine

    original = engine.SpecEngine._settle
    rewound: list[int] = []

    def one_slot_early(self, req, new_ids):
        token = original(self, req, new_ids)
        slot = torch.tensor([req.slot_indices[req.cur_len - 1]])
        for layer in range(len(self.pool.K)):
            zeros = torch.zeros_like(self.pool.K[layer][slot])
            self.pool.set_kv(layer, slot, zeros, zeros)
        rewound.append(req.request_id)
        return token

    monkeypatch.setattr(engine.SpecEngine, "_settle", one_slot_early)
    status, report, _ = run_script_json("l10_smoke", BF16 + ["--drafter", "prompt-lookup"], capsys)
    assert rewound, "no proposal was verified: the bug was never planted"
    assert status == 1 and "fail" in verdicts(report), verdicts(report)


# ---------------------------------------------------------------- a tie never hides a bug after it


def _near_tie_request(capsys) -> tuple[list[int], int]:
    """A prompt of the L8 workload that diverges from HF at a near-tie in bf16, and where."""
    status, report, _ = run_script_json("l8_smoke", BF16, capsys)
    row = next(r for r in report["requests"] if r["verdict"] == "near-tie")
    return row["prompt_ids"], row["first_mismatch"]


def test_a_bug_after_the_first_near_tie_still_fails(capsys, monkeypatch):
    """K corrupted only at positions after the tie: the ids already differ there, so only the
    teacher-forced comparison can see it; comparing the first mismatch's gap alone would pass."""
    prompt, tie_at = _near_tie_request(capsys)
    from l4_paged_prefill.attention import PagedPrefillAttention

    # K/V written from here on are wrong. The run goes 12 tokens past the tie, so that positions
    # after it are computed whatever step the tie falls on (on some CPUs it is the 19th of 20).
    start = len(prompt) + tie_at + 2
    original = PagedPrefillAttention.kv_step

    def corrupt_after_the_tie(self, k, v, pool, meta):
        late = (meta.positions >= start)[:, None, None]
        return original(self, torch.where(late, -k, k), v, pool, meta)

    monkeypatch.setattr(PagedPrefillAttention, "kv_step", corrupt_after_the_tie)
    argv = BF16 + ["--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(tie_at + 12)]
    status, report, _ = run_script_json("l8_smoke", argv, capsys)
    row = report["requests"][0]
    assert row["first_mismatch"] is not None and row["first_mismatch"] <= tie_at, row
    assert status == 1 and row["verdict"] == "fail" and "teacher-forced" in row["verdict_reason"], row
