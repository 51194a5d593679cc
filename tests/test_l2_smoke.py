"""L2: the smoke script follows the contract and reports the pool's block figures."""

from __future__ import annotations

import pytest

from helpers import run_script_json
from l1_contiguous import load_config
from l2_paged import blocks_needed

pytestmark = [pytest.mark.l2]


@pytest.mark.points(3)
def test_default_run_passes_with_the_block_figures(capsys):
    status, report, _ = run_script_json("l2_smoke", [], capsys)
    assert status == 0 and report["match"] is True
    assert (report["lesson"], report["device"], report["dtype"]) == ("L2", "cpu", "float32")
    rows = report["requests"]
    assert len(rows) == 3 and len({len(r["prompt_ids"]) for r in rows}) == 3  # three different lengths
    for row in rows:
        assert row["ids"] == row["hf_ids"] and row["first_mismatch"] is None and len(row["ids"]) == 20
    assert report["block_size"] == 16
    # Default pool: each request's blocks at its longest (prompt + 20 - 1 positions with K/V).
    total = sum(blocks_needed(len(r["prompt_ids"]) + 19, 16) for r in rows)
    assert report["blocks_total"] == total
    assert report["blocks_free_at_end"] == report["blocks_total"]  # every block came back
    assert 0 < report["blocks_peak_used"] <= total
    assert 0 <= report["wasted_slots_peak"] <= 3 * 15  # at most 15 empty slots per live request
    cfg = load_config(report["model"])
    assert report["kv_pool_bytes"] == total * 16 * cfg.kv_bytes_per_token(4)


@pytest.mark.points(2)
def test_several_prompt_ids_and_a_pool_sized_from_bytes(tiny_model_dir, capsys):
    # The tiny model: 2 layers × 2 KV heads × 16 dims × K,V × 4 bytes = 512 B per token; 2 KiB per block.
    status, report, _ = run_script_json(
        "l2_smoke", ["--model", str(tiny_model_dir), "--prompt-ids", "1,2,3", "--prompt-ids", "7",
                     "--prompt-ids", ",".join(map(str, range(30, 52))), "--max-new-tokens", "6",
                     "--block-size", "4", "--kv-memory", "64KiB"], capsys)
    assert status == 0 and report["match"] is True
    assert [len(r["ids"]) for r in report["requests"]] == [6, 6, 6]
    assert report["blocks_total"] == 32 and report["kv_pool_bytes"] == 65536
    # At their longest the three hold ceil(8/4) + ceil(6/4) + ceil(27/4) = 2 + 2 + 7 blocks.
    assert report["blocks_peak_used"] == 11 and report["blocks_free_at_end"] == 32


def pool_too_small_mid_run(model):  # the prefill fits (1 + 1 blocks), the first decode step does not
    return ["--model", model, "--prompt-ids", "1,2,3,4", "--prompt-ids", "5,6,7,8", "--block-size", "4",
            "--num-blocks", "3"]


BAD_INPUT = {
    "pool too small for the prompts": (["--num-blocks", "1"], "ran out"),
    "pool too small mid-run": (pool_too_small_mid_run, "ran out"),
    "zero block size": (["--block-size", "0"], "--block-size"),
    "block size not a number": (["--block-size", "x"], "invalid int"),
    "zero blocks": (["--num-blocks", "0"], "--num-blocks"),
    "unreadable memory": (["--kv-memory", "lots"], "64MiB"),
    "memory holds no block": (["--kv-memory", "1KiB"], "holds no block"),
    "share of memory on cpu": (["--kv-memory", "0.9"], "CUDA"),
    "both pool options": (["--num-blocks", "4", "--kv-memory", "1MiB"], "not allowed"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_gives_one_line_and_exit_2(case, tiny_model_dir, capsys):
    argv, fragment = BAD_INPUT[case]
    argv = argv(str(tiny_model_dir)) if callable(argv) else ["--model", str(tiny_model_dir), *argv]
    try:
        status, _, err = run_script_json("l2_smoke", argv, capsys)
    except SystemExit as exc:  # argparse rejects before the run starts
        status, err = exc.code, capsys.readouterr().err
    assert status == 2
    assert len(err.strip().splitlines()) == 1 and fragment in err and "Traceback" not in err


@pytest.mark.points(1)
def test_mismatch_exits_1(tiny_model_dir, capsys, monkeypatch):
    from l2_paged import PagedAttention

    def layer_0_only(self, k, v, pool, meta):  # the forgotten layer_idx
        pool.set_kv(0, meta.slot_mapping, k, v)
        return pool.K[0][meta.kv_indices], pool.V[0][meta.kv_indices]

    monkeypatch.setattr(PagedAttention, "kv_step", layer_0_only)
    status, report, _ = run_script_json(
        "l2_smoke", ["--model", str(tiny_model_dir), "--prompt-ids", "5,6,7,8,9,10,11",
                     "--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "8"], capsys)
    assert status == 1 and report["match"] is False
    assert any(r["first_mismatch"] is not None for r in report["requests"])
