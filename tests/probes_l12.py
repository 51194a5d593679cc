"""L12's probes (see probes.py: under the judge, imported in the worker, beside the code they
drive). They record and return plain data and judge nothing: every check is the test's."""

from __future__ import annotations

import subprocess
import sys


def tag_in_another_process(seed: int, hash_seed: str) -> dict:
    """cache_tag(FP8_E4M3, k, v) for _scales(seed)'s k and v, computed by a new python process
    with its own PYTHONHASHSEED (started where the student's code runs): its status and output."""
    code = ("import torch, sys; from l12_quantized_kv import FP8_E4M3, cache_tag; "
            f"g = torch.Generator().manual_seed({int(seed)}); "
            "k = [torch.rand(2, generator=g) + 0.01 for _ in range(3)]; "
            "v = [torch.rand(2, generator=g) + 0.01 for _ in range(3)]; "
            "sys.stdout.write(cache_tag(FP8_E4M3, k, v).hex())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONHASHSEED": hash_seed, "PATH": "/usr/bin:/bin", "PYTHONPATH": "."})
    return {"status": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
