"""Small timing helpers shared by the lesson benchmarks (`scripts/bench_l*.py`).

A generation run is split into its two phases by timing it twice:

    prefill  = time of a run that makes 1 new token   (one forward over the prompt)
    decode   = (time of a run that makes N new tokens - prefill) / (N - 1)   per step

Both runs force exactly the asked number of tokens (no early stop on EOS), so the arithmetic holds.
Timers keep the best of `repeat` runs after `warmup` untimed ones: on a shared machine the best
run is the one least disturbed by other work (`timed` also gives the median).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Timing:
    best: float  # seconds
    median: float  # seconds


def _sync(device: torch.device | str | None = None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], repeat: int = 3, warmup: int = 1,
          device: torch.device | str | None = None) -> Timing:
    """Run `fn` `warmup` times untimed, then `repeat` times timed; best and median seconds."""
    for _ in range(warmup):
        fn()
    seconds = []
    for _ in range(max(1, repeat)):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        seconds.append(time.perf_counter() - start)
    return Timing(min(seconds), statistics.median(seconds))


@dataclass(frozen=True)
class PhaseTimes:
    prefill_s: float  # seconds for the prompt forward(s) that produce the first token
    decode_s_per_step: float  # seconds per later step (one new token per request)
    total_s: float  # seconds for the whole N-token run


def split_prefill_decode(run: Callable[[int], object], max_new_tokens: int, repeat: int = 3,
                         warmup: int = 1, device: torch.device | str | None = None) -> PhaseTimes:
    """Time `run(1)` and `run(max_new_tokens)`; split into prefill and per-step decode time.

    `run(n)` must generate exactly n new tokens for the same prompt(s) each call.
    """
    return compare_phases({"": run}, max_new_tokens, repeat, warmup, device)[""]


def compare_phases(runs: dict[str, Callable[[int], object]], max_new_tokens: int, repeat: int = 3,
                   warmup: int = 1, device: torch.device | str | None = None) -> dict[str, PhaseTimes]:
    """`split_prefill_decode` for several runners, interleaved round by round.

    On a shared machine the load changes over seconds; taking turns gives every runner the same
    chances, where timing one runner after the other would hand one of them the quiet minute.
    """
    if max_new_tokens < 2:
        raise ValueError("max_new_tokens must be at least 2 to measure a decode step")
    for run in runs.values():
        for _ in range(warmup):
            run(1), run(max_new_tokens)
    best = {name: [float("inf"), float("inf")] for name in runs}
    for _ in range(max(1, repeat)):
        for name, run in runs.items():
            for slot, n in enumerate((1, max_new_tokens)):
                best[name][slot] = min(best[name][slot], timed(lambda: run(n), 1, 0, device).best)
    # On a noisy machine the N-token run can come out no slower than the 1-token run: then the
    # decode step is not measurable (nan), rather than an absurd figure.
    return {name: PhaseTimes(t1, (tn - t1) / (max_new_tokens - 1) if tn > t1 else float("nan"), tn)
            for name, (t1, tn) in best.items()}


# ---------------------------------------------------------------- HF generate


def _pad_id(model) -> int:
    eos = model.generation_config.eos_token_id
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return 0 if eos is None else int(eos)


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, batched: bool = False) -> list[list[int]]:
    """Greedy HF `generate`, exactly `max_new_tokens` per prompt (EOS does not stop it).

    batched=False: one `generate` per prompt. batched=True: one `generate` for all prompts,
    left-padded (`attention_mask` built from the lengths, no tokenizer needed) so that every
    prompt's last token sits in the last column, where generation continues.
    Returns the new tokens of each prompt.
    """
    from transformers import GenerationConfig

    pad = _pad_id(model)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    # eos_token_id=None as a keyword: set inside `config` it would be refilled from the model's
    # generation_config, and EOS would end a run early.
    no_stop = {"eos_token_id": None}
    device = model.device
    if not batched:
        outs = []
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 generation_config=config, **no_stop)
            outs.append(out[0, len(p):].tolist())
        return outs
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, device=device)
        mask[row, width - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, **no_stop)
    return out[:, width:].tolist()


# ---------------------------------------------------------------- reporting


def tokens_per_s(tokens: float, seconds: float) -> float:
    """tokens / seconds; nan when the time was not measurable."""
    return tokens / seconds if seconds > 0 else float("nan")


def print_table(rows: list[dict], columns: list[str] | None = None, floatfmt: str = ".1f") -> None:
    """Print rows of dicts as an aligned plain-text table (columns: the first row's keys by default)."""
    if not rows:
        return
    columns = columns or list(rows[0])

    def cell(value) -> str:
        if isinstance(value, float):
            return format(value, floatfmt)
        return "n/a" if value is None else str(value)

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    # text columns left-aligned, numbers right-aligned
    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows) for c in columns]

    def line(values) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    print(line(columns))
    print(line(["-" * w for w in widths]))
    for row in cells:
        print(line(row))


def bench_parser(description: str, repeat: int = 3) -> argparse.ArgumentParser:
    """The options every lesson benchmark shares; each script adds its workload's own."""
    from harness.smoke import DEFAULT_MODEL, DTYPES

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="HF-format model folder (default: embedded)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--repeat", type=int, default=repeat, help=f"timed runs per measurement, best kept (default {repeat})")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results to PATH")
    return p
