"""llama.cpp as a peer in the benchmarks: the same weights, the same requests, the same step schedule.

Optional: it needs llama-cpp-python (`make peer` builds it, 4 to 15 minutes on 2 cores) and a
llama.cpp source tree for its converter (`make peer` unpacks the one vendored in llama-cpp-python's
source release into .peer/). Nothing in the tests depends on it.

    convert(model_dir, out, "f32")    the HF folder -> GGUF by llama.cpp's own convert_hf_to_gguf.py
    LlamaCppPeer(gguf, kv="f32")      one context: n_seq_max sequences in one unified KV cache
      .decode_alone(prompt, new)      one request: its ids and the median seconds of a decode step
      .serve(items, prefill_chunk)    a workload, stepped as the L5 engine steps it: every running
                                      request's decode, then prompt chunks up to `prefill_chunk`
                                      tokens, in one llama_decode per step

Greedy over the logits llama.cpp returns (argmax, as the engine and HF's generate do), so with
F32 weights and an F32 KV cache its ids should equal HF's up to float rounding.
"""

from __future__ import annotations

import ctypes
import importlib
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LLAMA_CPP = REPO_ROOT / ".peer" / "llama.cpp"  # where `make peer` puts llama.cpp's source tree
PEER_VERSION = "0.3.36"  # the llama-cpp-python release `make peer` builds (it vendors llama.cpp)

# The converter names the tokenizer's pre-tokenizer from a hash of how it splits a probe text, and
# stops at one it has no name for (every tokenizer trained here). The benchmark feeds token ids, so
# the name only labels the file; the embedded model's tokenizer is byte-level BPE with GPT-2's regex.
_CONVERT = """
import runpy, sys
tree = sys.argv.pop(1)
sys.path[:0] = [tree, tree + "/gguf-py"]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv[0] = tree + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def available() -> str | None:
    """None when llama-cpp-python imports; else why not, in one line."""
    try:
        importlib.import_module("llama_cpp")
    except ImportError as exc:
        return f"llama-cpp-python is not installed ({exc}); `make peer` builds it (4 to 15 minutes on 2 cores)"
    return None


def convert(model_dir: Path, out: Path, outtype: str, llama_cpp_dir: Path = DEFAULT_LLAMA_CPP) -> Path:
    """`model_dir` (an HF folder) as a GGUF file at `out`, weights in `outtype` ("f32" or "f16")."""
    converter = Path(llama_cpp_dir) / "convert_hf_to_gguf.py"
    if not converter.is_file():
        raise FileNotFoundError(f"no llama.cpp converter at {converter}; `make peer` unpacks one, or pass "
                                "--llama-cpp with a llama.cpp source tree")
    done = subprocess.run([sys.executable, "-c", _CONVERT, str(llama_cpp_dir), str(model_dir), "--outtype", outtype,
                           "--outfile", str(out)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed on {model_dir}: {done.stderr.strip().splitlines()[-1:]}")
    return out


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _quiet(level, text, user_data):  # llama.cpp logs every load at length; the benchmark prints its own table
    pass


class LlamaCppPeer:
    """One llama.cpp context over a GGUF model; `kv` is the cache's type, "f32" or "f16"."""

    def __init__(self, gguf: Path, kv: str = "f32", threads: int = 2, n_ctx: int = 4096, n_seq: int = 32,
                 n_batch: int = 512):
        import llama_cpp as lc
        self.lc = lc
        lc.llama_log_set(_quiet, None)
        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, n_batch, n_batch, n_seq
        params.n_threads = params.n_threads_batch = threads
        params.type_k = params.type_v = {"f32": lc.GGML_TYPE_F32, "f16": lc.GGML_TYPE_F16}[kv]
        params.kv_unified, params.no_perf = True, True
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {n_ctx} cells for {n_seq} sequences")
        self.memory = lc.llama_get_memory(self.ctx)
        self.n_batch, self.n_seq = n_batch, n_seq
        self.batch = lc.llama_batch_init(n_batch, 0, 1)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def _run(self, rows: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of rows (token, position, sequence, wants logits) -> the greedy id of each
        row that wants logits, in order."""
        b = self.batch
        b.n_tokens = len(rows)
        for i, (token, pos, seq, wants) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = token, pos, 1, seq, wants
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed (the KV cache is full?)")
        return [int(np.argmax(np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), (self.n_vocab,))))
                for i, row in enumerate(rows) if row[3]]

    def _clear(self) -> None:
        self.lc.llama_memory_clear(self.memory, True)

    def decode_alone(self, prompt: list[int], new: int) -> tuple[list[int], float]:
        """One request alone: its `new` greedy ids (new >= 2) and the median seconds of its decode
        steps (the prompt's step excluded), timed as the engine's and HF's are (bench_step)."""
        self._clear()
        ids = self._run([(t, p, 0, p == len(prompt) - 1) for p, t in enumerate(prompt)])
        steps = []
        while len(ids) < new:
            start = time.perf_counter()
            ids += self._run([(ids[-1], len(prompt) + len(ids) - 1, 0, True)])
            steps.append(time.perf_counter() - start)
        return ids, statistics.median(steps)

    def serve(self, items: list, prefill_chunk: int = 256) -> tuple[list[list[int]], float]:
        """Every item (prompt_ids, max_new_tokens; all arriving at once) to completion, each step the
        running requests' decodes first, then prompt tokens up to `prefill_chunk` in arrival order.
        -> each item's ids and the wall seconds."""
        self._clear()
        outs = [[] for _ in items]
        done_prompt = [0] * len(items)
        waiting, running, free_seqs = deque(range(len(items))), [], list(range(self.n_seq))[::-1]
        seq_of = {}
        start = time.perf_counter()
        while waiting or running:
            rows, owners = [], []
            for r in running:  # decodes: the last id at the next position
                rows.append((outs[r][-1], len(items[r].prompt_ids) + len(outs[r]) - 1, seq_of[r], True))
                owners.append(r)
            budget = min(prefill_chunk, self.n_batch - len(rows))
            for r in list(waiting):
                if budget == 0:
                    break
                if r not in seq_of:
                    if not free_seqs:
                        break
                    seq_of[r] = free_seqs.pop()
                prompt, begin = items[r].prompt_ids, done_prompt[r]
                end = min(len(prompt), begin + budget)
                rows += [(prompt[p], p, seq_of[r], p == len(prompt) - 1) for p in range(begin, end)]
                done_prompt[r], budget = end, budget - (end - begin)
                if end == len(prompt):
                    owners.append(r)
                    waiting.remove(r)
            for r, token in zip(owners, self._run(rows)):
                outs[r].append(token)
                if r not in running:
                    running.append(r)
                if len(outs[r]) >= items[r].max_new_tokens:
                    running.remove(r)
                    self.lc.llama_memory_seq_rm(self.memory, seq_of[r], -1, -1)
                    free_seqs.append(seq_of.pop(r))
        return outs, time.perf_counter() - start
