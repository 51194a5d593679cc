"""L4: the smoke script per the contract: the embedded model with prompts in chunks beside decodes."""

from __future__ import annotations

import pytest
import torch

from helpers import run_script_json
from l3_block_kernel.kernel_build import host_compiler

pytestmark = [pytest.mark.l4]


@pytest.mark.points(2)
def test_embedded_model_passes_on_the_reference_path(capsys):
    status, report, _ = run_script_json("l4_smoke", ["--backend", "reference"], capsys)
    assert status == 0 and report["match"] is True and report["lesson"] == "L4"
    assert report["backend"] == "reference" and report["prefill_chunk"] == 7
    assert report["blocks_free_at_end"] == report["blocks_total"]
    assert all(r["ids"] == r["hf_ids"] for r in report["requests"])


@pytest.mark.skipif(host_compiler() is None, reason="the cpu and emulated backends need g++ or clang++")
@pytest.mark.parametrize("argv", [[], ["--backend", "emulated", "--block-size", "8", "--prefill-chunk", "5"],
                                  ["--prefill-chunk", "0", "--block-size", "32"]])
def test_default_and_other_shapes_pass(argv, capsys):
    status, report, _ = run_script_json("l4_smoke", argv, capsys)
    assert status == 0 and report["match"] is True


@pytest.mark.skipif(host_compiler() is None, reason="the cpu backend needs g++ or clang++")
@pytest.mark.parametrize("overrides", [
    dict(num_attention_heads=8, num_key_value_heads=1, head_dim=64),   # GQA 8:1, head_dim 64
    dict(num_attention_heads=6, num_key_value_heads=3, head_dim=24),   # GQA 2:1, a head_dim no kernel tile divides
    dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=9,
         layer_types=["sliding_attention", "full_attention"] * 2),   # a hybrid model: windows of 9
])
@pytest.mark.parametrize("backend,block_size,chunk", [("cpu", 4, 3), ("reference", 16, 11)])
def test_other_shapes_through_model(make_model, overrides, backend, block_size, chunk, capsys):
    model_dir = make_model(seed=3, **overrides)
    argv = ["--model", str(model_dir), "--backend", backend, "--block-size", str(block_size), "--prefill-chunk",
            str(chunk), "--prompt-ids", ",".join(map(str, range(3, 40))), "--prompt-ids", "7,8", "--max-new-tokens", "12"]
    status, report, _ = run_script_json("l4_smoke", argv, capsys)
    assert status == 0 and report["match"] is True


@pytest.mark.parametrize("argv,fragment", [
    (["--backend", "kernel"], "CUDA"),
    (["--prefill-chunk", "-1"], "--prefill-chunk"),
    (["--block-size", "0"], "--block-size"),
])
def test_bad_input_exits_2(argv, fragment, capsys):
    if argv[:2] == ["--backend", "kernel"] and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    status, _, err = run_script_json("l4_smoke", argv, capsys)
    assert status == 2 and fragment in err and len(err.strip().splitlines()) == 1
