"""L8's fake model (see probes.py: under the judge, imported in the worker, beside the engine it
drives). Its forward checks every slot a request reads against the prefix it must hold, and raises
AssertionError inside the engine's step when one does not: the test sees the step fail."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from fingerprints import FAKE_EOS, FAKE_VOCAB, fingerprint, next_token
from l1_contiguous.config import Qwen3Config
from l2_paged import reserve

FAKE_CFG = Qwen3Config(vocab_size=FAKE_VOCAB, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                       num_attention_heads=1, num_key_value_heads=1, head_dim=1, rope_theta=1e4,
                       rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True,
                       eos_token_ids=(FAKE_EOS,))


class FakeModel:
    """What the engine reads of a model: its config, device, dtype and attention layers (none here,
    so nothing for the engine's model check to refuse). Forwards are FakeForward's."""

    config, device, dtype = FAKE_CFG, torch.device("cpu"), torch.float32
    model = SimpleNamespace(layers=())


class FakeForward:
    """Replaces runner.forward_logits: checks every read, refuses shared writes, writes fingerprints."""

    def __init__(self, engine):
        self.alloc, self.k = engine.alloc, engine.pool.K[0][:, 0, 0]  # [num_slots] view of layer 0's K

    def __call__(self, reqs, num_new):
        rows = torch.zeros(len(reqs), FAKE_VOCAB)
        for row, (req, n) in enumerate(zip(reqs, num_new)):
            reserve(req, self.alloc, req.cur_len + n)  # as the real runner does (a no-op: the scheduler did it)
            tokens = req.tokens
            for pos in range(req.cur_len):
                got, want = float(self.k[req.slot_indices[pos]]), fingerprint(tokens[:pos + 1])
                assert got == want, f"request {req.request_id} reads position {pos} from another prefix's K"
            for pos in range(req.cur_len, req.cur_len + n):
                block = req.blocks[pos // self.alloc.block_size]
                assert self.alloc.ref_count[block] == 1, f"write into block {block}, shared"
                self.k[req.slot_indices[pos]] = fingerprint(tokens[:pos + 1])
            req.cur_len += n
            rows[row, next_token(tokens[:req.cur_len])] = 1.0
        return rows


def install_fake_forward(engine) -> None:
    """The engine's forwards become FakeForward's (set here: judged, the engine's runner must hold
    the worker's object, not a handle to one)."""
    engine.runner.forward_logits = FakeForward(engine)


def chain_keys_in_new_processes(tokens: list[int], block_size: int, hash_seeds: list[str]) -> list[list[str]]:
    """The hex keys `chain_keys` gives in a new Python process for each PYTHONHASHSEED, loading the
    lesson's block_hash.py alone (the package would import torch: seconds a process for nothing).
    Run where the lesson's code is (judged: in the worker, on the student's file)."""
    import importlib.util
    import os
    import subprocess
    import sys

    path = importlib.util.find_spec("l8_prefix.block_hash").origin
    code = ("import importlib.util as u, sys; s = u.spec_from_file_location('bh', sys.argv[1]); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); "
            f"print(' '.join(k.hex() for k in m.chain_keys({tokens!r}, {block_size})))")
    outs = []
    for seed in hash_seeds:
        done = subprocess.run([sys.executable, "-c", code, path], env={**os.environ, "PYTHONHASHSEED": seed},
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"chain_keys failed in a new process: {done.stderr[-1500:]}")
        outs.append(done.stdout.split())
    return outs


def poison_blocks(engine, blocks: list[int], seed: int = 0) -> None:
    """Noise, 100 times K/V's scale, into every layer's K and V at `blocks`' slots: a request that
    really reads those blocks for its prefix computes from it; one that recomputes the prefix and
    only says it hit never sees it."""
    bs, gen = engine.alloc.block_size, torch.Generator().manual_seed(seed)
    slots = torch.tensor([b * bs + i for b in blocks for i in range(bs)])
    for tensor in engine.pool.K + engine.pool.V:
        tensor[slots] = 100 * torch.randn(tensor[slots].shape, generator=gen).to(tensor.dtype)
