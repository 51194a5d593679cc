"""L3: the smoke script per the contract, on the reference path (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from helpers import run_script_json

pytestmark = [pytest.mark.l3]


@pytest.mark.points(2)
def test_embedded_model_passes_on_the_reference_path(capsys):
    status, report, _ = run_script_json("l3_smoke", [], capsys)
    assert status == 0 and report["match"] is True
    assert report["backend"] == "reference" and report["lesson"] == "L3"
    assert report["blocks_free_at_end"] == report["blocks_total"]
    assert all(r["ids"] == r["hf_ids"] for r in report["requests"])


@pytest.mark.points(1)
def test_small_blocks_and_several_prompts(tiny_model_dir, capsys):
    status, report, _ = run_script_json(
        "l3_smoke", ["--model", str(tiny_model_dir), "--block-size", "8", "--prompt-ids", "1,2,3",
                     "--prompt-ids", ",".join(str(i) for i in range(40)), "--max-new-tokens", "12"], capsys)
    assert status == 0 and report["block_size"] == 8 and len(report["requests"]) == 2


@pytest.mark.parametrize("argv,fragment", [
    (["--backend", "kernel"], "CUDA"),
    (["--block-size", "0"], "--block-size"),
    (["--num-blocks", "1"], "--num-blocks"),
])
def test_bad_input_exits_2(argv, fragment, capsys):
    if argv[:2] == ["--backend", "kernel"] and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    status, _, err = run_script_json("l3_smoke", argv, capsys)
    assert status == 2 and fragment in err and len(err.strip().splitlines()) == 1


def test_emulated_backend_runs_the_kernel_code_and_matches_hf(capsys):
    """The whole model with decode attention on the kernel's own code (CPU emulation), two prompts."""
    from l3_block_kernel.kernel_build import host_compiler
    if host_compiler() is None:
        pytest.skip("backend 'emulated' needs a C++20 compiler (g++ or clang++, or set CXX)")
    status, report, _ = run_script_json(
        "l3_smoke", ["--backend", "emulated", "--prompt-ids", "1,2,3", "--prompt-ids",
                     ",".join(str(i) for i in range(20, 60)), "--max-new-tokens", "6"], capsys)
    assert status == 0 and report["backend"] == "emulated" and report["match"] is True
    assert all(r["ids"] == r["hf_ids"] for r in report["requests"])
