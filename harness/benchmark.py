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
import os
import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from .cli import OneLineParser, positive_ints


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


def bench_parser(description: str, repeat: int | None = 3, cpu_only: bool = False) -> argparse.ArgumentParser:
    """The options every lesson benchmark shares; each script adds its workload's own. A bench
    that times nothing repeatedly passes repeat=None (no --repeat); one whose tables are CPU
    figures by design passes cpu_only=True: --device takes cpu only and there is no --dtype, so
    neither is accepted and then ignored."""
    from harness.smoke import DEFAULT_MODEL, DTYPES

    p = OneLineParser(description=description)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="HF-format model folder (default: embedded)")
    if cpu_only:
        p.add_argument("--device", choices=["cpu"], default="cpu", help="cpu only: this benchmark's tables are CPU figures")
    else:
        p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
        p.add_argument("--dtype", choices=list(DTYPES), default=None,
                       help="default: float32 on cpu, bfloat16 on cuda")
    if repeat is not None:
        p.add_argument("--repeat", type=int, default=repeat,
                       help=f"timed runs per measurement, best kept (default {repeat}, at most {MAX_REPEAT})")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results to PATH")
    return p


# ---------------------------------------------------------------- serving: requests arriving on a wall clock
# Both systems below are driven the same way: request i is handed over `offsets_s[i]` seconds after
# the clock starts (all 0: a burst), and the clock stops at the last generated token. Building the
# engine or the manager before, and stopping it after, are timed apart (setup_s, teardown_s).


@dataclass
class ServeRun:
    ids: list[list[int]]  # new tokens of each request, in the workload's order
    serve_s: float  # clock start (first request handed over) -> last token of the last request
    ttft_s: list[float]  # per request: its hand-over -> its first token
    setup_s: float  # building the engine / manager (and its KV pool), not in serve_s
    teardown_s: float  # stopping it, not in serve_s
    engine: object = None  # the course engine after the run (its counters); None for HF
    steps: list | None = None  # the course engine's [StepShape, seconds] per step, where recorded

    @property
    def ttft_mean_s(self) -> float:
        return statistics.fmean(self.ttft_s)


def _arrival_order(offsets_s: list[float]) -> list[int]:
    return sorted(range(len(offsets_s)), key=lambda i: (offsets_s[i], i))


def serve_engine(make_engine: Callable[[], object], items: list, offsets_s: list[float]) -> ServeRun:
    """Run a course engine (L5 or L8) as a server: arrivals join at the next step boundary.

    `items` are WorkItems (their arrival_step is replaced by the step at which they are handed over).
    """
    from dataclasses import replace

    start = time.perf_counter()
    engine = make_engine()
    setup_s = time.perf_counter() - start
    order, index_of, handed, first, last = _arrival_order(offsets_s), {}, {}, {}, 0.0
    with torch.inference_mode():
        t0 = time.perf_counter()
        while order or engine.has_unfinished():
            now = time.perf_counter() - t0
            while order and offsets_s[order[0]] <= now:
                i = order.pop(0)
                req = engine.add_request(replace(items[i], arrival_step=engine.now))
                index_of[req.request_id], handed[i] = i, t0 + offsets_s[i]
            if not engine.has_unfinished():
                time.sleep(max(0.0, offsets_s[order[0]] - now))
                continue
            engine.step()
            _sync(getattr(engine.model, "device", None))
            last = time.perf_counter()
            for rid, i in index_of.items():
                if i not in first and engine.requests[rid].output_ids:
                    first[i] = last
    ids = [None] * len(items)
    for rid, i in index_of.items():
        ids[i] = list(engine.requests[rid].output_ids)
    return ServeRun(ids, last - t0, [first[i] - handed[i] for i in range(len(items))], setup_s, 0.0, engine)


def hf_continuous_config(block_size: int, num_blocks: int, max_batch_tokens: int, block_sharing: bool):
    """transformers' ContinuousBatchingConfig set like a course engine: pages of `block_size` tokens
    (a block holds one page per layer, as ours holds every layer's K/V for `block_size` positions),
    `num_blocks` of them, at most `max_batch_tokens` tokens per forward, prefix block sharing on/off."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    return ContinuousBatchingConfig(page_size=block_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                    allow_block_sharing=block_sharing)


def serve_hf_continuous(model, items: list, offsets_s: list[float], cb_config) -> ServeRun:
    """transformers' continuous batching manager, driven like `serve_engine`: built and started
    (set-up), requests handed over on the clock, each with its own max_new_tokens and EOS off,
    per-token timestamps recorded by HF itself, then stopped (teardown)."""
    import logging

    from transformers import GenerationConfig

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # psutil notices on CPU
    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                              max_new_tokens=max(w.max_new_tokens for w in items))
    start = time.perf_counter()
    # Its generation thread is not in the caller's inference mode (that is per thread), so the cache
    # it updates in place must not be an inference tensor: build it outside inference mode.
    with torch.inference_mode(False):
        manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb_config)
        manager.warmup()  # builds the batch processor and its KV cache now, not on the first request
        manager.start()
    setup_s = time.perf_counter() - start
    results, handed = {}, {}
    try:
        t0 = time.perf_counter()
        for i in _arrival_order(offsets_s):
            time.sleep(max(0.0, t0 + offsets_s[i] - time.perf_counter()))
            handed[i] = time.perf_counter()
            manager.add_request(items[i].prompt_ids, request_id=f"r{i}", max_new_tokens=items[i].max_new_tokens,
                                record_timestamps=True, eos_token_id=-1)
        while len(results) < len(items):
            out = manager.get_result(timeout=120)
            if out is None:
                why = manager.background_thread_status.fatal_error
                raise RuntimeError(f"HF continuous batching stopped answering ({why or 'nothing for 120 s'})")
            if out.is_finished():
                results[int(out.request_id[1:])] = out
    finally:
        start = time.perf_counter()
        manager.stop(block=True)
        manager.destroy()
        teardown_s = time.perf_counter() - start
    end = max(r.timestamps[-1] for r in results.values())
    return ServeRun([list(results[i].generated_tokens) for i in range(len(items))], end - t0,
                    [results[i].timestamps[0] - handed[i] for i in range(len(items))], setup_s, teardown_s)


# ---------------------------------------------------------------- docs/benchmarks.md sections


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def bench_command(script: str, argv: list[str]) -> str:
    """The command line to quote, without --markdown/--json and their paths (this machine's)."""
    out, skip = [f"python scripts/{script}"], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--markdown", "--json"):
            skip = True
        elif not arg.startswith(("--markdown=", "--json=")):
            out.append(arg)
    return " ".join(out)


def cpu_name() -> str:
    """The CPU's model name where Linux says it (figures differ from one CPU to another even at
    the same core count), else the architecture."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0]}, {platform.machine()}" if names else platform.processor() or platform.machine()


def machine_line(threads: int, load_at_start: str | None = None) -> str:
    """Hardware, versions, date and load: the first line of every generated section."""
    import transformers

    cpu = cpu_name()
    if torch.cuda.is_available():
        cpu += f", {torch.cuda.get_device_name()}"
    load = f"{load_at_start} at the start, {load_average()} at the end" if load_at_start else load_average()
    return (f"{'finished ' if load_at_start else ''}{_now()} · {os.cpu_count()} cores ({cpu}) · "
            f"torch {torch.__version__} · transformers {transformers.__version__} · {threads} thread(s) · "
            f"load average (1, 5, 15 min) {load}")


def markdown_table(rows: list[dict], columns: list[str], floatfmt: str = ".2f") -> str:
    def cell(value) -> str:
        if isinstance(value, float):
            return format(value, floatfmt)
        return "n/a" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


# Options that count something: each must be at least 1 wherever a bench has it.
COUNT_OPTIONS = ["repeat", "requests", "k", "batch", "max_new_tokens", "threads", "block_size", "num_prompts",
                 "prompt_len", "repeat_06b", "requests_06b", "new_06b", "rounds", "num_blocks", "prefill_chunk",
                 "tail_len", "prefix_len", "layers_06b", "layers"]


# More timed runs than this is a typo, not a measurement (a billion would never end).
MAX_REPEAT = 1000


def check_bench_args(args: argparse.Namespace, parser: argparse.ArgumentParser, max_layers: int = 28) -> argparse.Namespace:
    """The door of every bench, before any work: counts >= 1, repeats at most MAX_REPEAT, threads
    at most this machine's cores, 0.6B layers within the model's 28, output paths writable regular
    files (`checked_output_path`). One line and exit 2 otherwise."""
    positive_ints(args, COUNT_OPTIONS, parser.error)
    for name in ("repeat", "repeat_06b"):
        if (getattr(args, name, None) or 0) > MAX_REPEAT:
            parser.error(f"--{name.replace('_', '-').replace('06b', '0.6b')} must be at most {MAX_REPEAT} timed "
                         f"runs, got {getattr(args, name)}")
    cores = os.cpu_count() or 1
    if (getattr(args, "threads", None) or 0) > cores:  # more threads than cores only slows a run down
        parser.error(f"--threads must be at most {cores} (this machine's cores), got {args.threads}")
    for name in ("layers_06b", "layers"):
        if getattr(args, name, None) is not None and getattr(args, name) > max_layers:
            parser.error(f"--{name.replace('_', '-').replace('06b', '0.6b')} must be at most {max_layers} "
                         f"(Qwen3-0.6B's layers), got {getattr(args, name)}")
    for name in ("json", "markdown"):
        if getattr(args, name, None):
            checked_output_path(getattr(args, name), f"--{name}")
    return args


def checked_model(args: argparse.Namespace):
    """--model at the door: (its folder, its config), or one line and exit 2 when it is no model
    folder (before minutes of work, not after them as a traceback). --block-size, where the bench
    has it, is at most the model's positions: one block longer than any sequence is no pool."""
    from harness.smoke import resolve_model_dir
    from l1_contiguous import InputError, load_config

    try:
        model_dir = resolve_model_dir(args.model)
        cfg = load_config(model_dir)
    except InputError as exc:
        _refuse(str(exc))
    block_size = getattr(args, "block_size", None)
    if block_size is not None and block_size > cfg.max_position_embeddings:
        _refuse(f"--block-size must be at most the model's {cfg.max_position_embeddings} positions, got {block_size}")
    return model_dir, cfg


def checked_device(args: argparse.Namespace) -> tuple[str, torch.dtype]:
    """--device and --dtype at the door: resolved (harness.smoke.resolve_device), or one line and
    exit 2 (--device cuda without a GPU is refused, never run on the CPU instead)."""
    from harness.smoke import resolve_device
    from l1_contiguous import InputError

    try:
        return resolve_device(args.device, getattr(args, "dtype", None))
    except InputError as exc:
        _refuse(str(exc))


def checked_output_path(path: str, option: str) -> None:
    """Refuse, before any work, an output path a bench could not write at the end: SystemExit(2)
    with one line. A new file needs an existing, writable folder; an existing one must be a
    regular file (not a directory, a device such as /dev/full, or a pipe)."""
    import os
    from pathlib import Path

    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.exists() and not target.is_file():
        why = "a directory" if target.is_dir() else "not a regular file"
        example = {"--markdown": "results.md", "zip_path": "autograder.zip"}.get(option, "results.json")
        _refuse(f"{option} {path}: {why}; give a file path, e.g. {example}")
    if not folder.is_dir():
        _refuse(f"{option} {path}: the folder {folder} does not exist; create it or choose another path")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        _refuse(f"{option} {path}: not writable; choose a path you can write")


def _refuse(message: str) -> None:
    import sys

    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def write_text_atomic(path: str, text: str) -> None:
    """Write a temporary file beside `path`, then rename it over `path`: a full disk or a Ctrl-C
    leaves the old file whole, never a cut one. Refuses anything but a regular file (or none)."""
    import os
    import tempfile
    from pathlib import Path

    target = Path(path)
    if target.exists() and not target.is_file():
        raise OSError(f"{path} is not a regular file; refusing to replace it")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent if str(target.parent) else ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        if target.exists():
            os.chmod(tmp, target.stat().st_mode & 0o777)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replace_section(path: str, name: str, text: str) -> None:
    """Put `text` between `<!-- BEGIN name -->` and `<!-- END name -->` in the file at `path`
    (appended, with its markers, if they are not there yet). The file is replaced whole
    (`write_text_atomic`), and only a regular file is read: /dev/full or a pipe is refused."""
    from pathlib import Path

    begin, end = f"<!-- BEGIN {name} (generated by make bench; edit the script, not this) -->", f"<!-- END {name} -->"
    target = Path(path)
    if target.exists() and not target.is_file():
        raise OSError(f"{path} is not a regular file; refusing to read or replace it")
    doc = target.read_text() if target.exists() else ""
    block = f"{begin}\n{text.strip()}\n{end}"
    if begin in doc and end in doc:
        head, rest = doc.split(begin, 1)
        doc = head + block + rest.split(end, 1)[1]
    else:
        doc = doc.rstrip() + "\n\n" + block + "\n"
    write_text_atomic(path, doc)


def write_header(path: str) -> None:
    """The `header` section of the benchmarks file: this machine, its versions and the date."""
    import platform

    import transformers

    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f", {int(f.readline().split()[1]) / 2**20:.0f} GiB"
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    replace_section(path, "header", f"Sections marked as generated were last written by `make bench` on: "
                                    f"{cpu_name()} CPU with {os.cpu_count()} cores{mem}, {gpu}, "
                                    f"Python {platform.python_version()}, torch {torch.__version__}, "
                                    f"transformers {transformers.__version__}, {_now()}.")


def _now() -> str:
    import datetime

    return f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"


def parse_batch_tokens(spec: str, auto: list[int]) -> list[int]:
    """--hf-batch-tokens: "auto" (the given candidates) or integers >= 1 separated by commas."""
    from l1_contiguous import InputError

    if spec == "auto":
        return auto
    try:
        values = [int(v) for v in spec.split(",")]
    except ValueError:
        raise InputError(f"--hf-batch-tokens takes integers separated by commas or auto, got {spec!r}") from None
    if min(values) < 1:
        raise InputError("--hf-batch-tokens values must be at least 1")
    return values


# ---------------------------------------------------------------- the floor of a step
# A step must read every weight once (and the K/V it attends to) and do its matrix products; it can
# take no less than the larger of the two times on this machine:
#
#     floor(step) = max(bytes it must read / read bandwidth, FLOPs it must do / matmul rate)
#
# and a run's floor is the sum over its steps. Both constants are measured in the same run as the
# systems they bound (`measure_machine`), so a loaded machine lowers the floor's constants and the
# systems' speed alike. Activations, softmax and norms are left out: they are small next to these.


@dataclass(frozen=True)
class StepShape:
    """What one forward computes: enough to count its bytes and FLOPs."""

    rows: int  # tokens run through every layer
    logit_rows: int  # rows the output head runs on (one per request; k + 1 for one verifying k proposals)
    keys: int  # attention: the sum over rows of the keys each row reads
    kv_tokens: int  # tokens whose K/V the step reads or writes (each once)

    @classmethod
    def of_requests(cls, spans: list[tuple[int, int]]) -> "StepShape":
        """spans: (cached tokens, new tokens) per request of the step."""
        return cls(rows=sum(n for _, n in spans), logit_rows=len(spans),
                   keys=sum(n * c + n * (n + 1) // 2 for c, n in spans), kv_tokens=sum(c + n for c, n in spans))


def padded_batch_steps(prompt_lens: list[int], new_tokens: int) -> list[StepShape]:
    """The steps of a left-padded batched `generate`: every row is as long as the longest prompt,
    and runs to `new_tokens` (padding and finished rows are computed like the others)."""
    rows, width = len(prompt_lens), max(prompt_lens)
    steps = [StepShape.of_requests([(0, width)] * rows)]
    return steps + [StepShape.of_requests([(width + j - 1, 1)] * rows) for j in range(1, new_tokens)]


@dataclass(frozen=True)
class Machine:
    """This machine's constants, measured now."""

    read_bytes_per_s: float  # summing a tensor larger than the caches
    matmul_flops_per_s: float  # the best of the model's MLP product at a few row counts

    def line(self) -> str:
        return (f"read bandwidth {self.read_bytes_per_s / 1e9:.1f} GB/s, "
                f"matmul {self.matmul_flops_per_s / 1e9:.0f} GFLOP/s")


def measure_machine(cfg, dtype=torch.float32, rows=(64, 256), repeat: int = 5, read_mib: int = 512) -> Machine:
    """Read bandwidth (best of `repeat` sums of `read_mib` MiB) and the matmul rate of the model's
    MLP up-projection ([rows, hidden] x [intermediate, hidden]) at each of `rows`, by `F.linear` and,
    where it runs, by the engine's packed product (l5_eviction/fast_linear.py): the fastest kept,
    so that the floor stays a bound for every system."""
    from l5_eviction.fast_linear import PackedLinear, can_pack

    data = torch.ones(read_mib * 2**20 // dtype.itemsize, dtype=dtype)
    read_s = timed(data.sum, repeat, 1).best
    linear = torch.nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False, dtype=dtype).requires_grad_(False)
    products = [linear] + ([PackedLinear(linear)] if can_pack(linear) else [])
    rate = 0.0
    for n in rows:
        x = torch.randn(n, cfg.hidden_size, dtype=dtype)
        for product in products:
            rate = max(rate, 2 * n * linear.weight.numel() / timed(lambda: product(x), repeat, 1).best)
    return Machine(data.numel() * dtype.itemsize / read_s, rate)


def best_of(*machines: Machine) -> Machine:
    """The fastest constants seen: the floor must stay a bound when load slowed one measurement."""
    return Machine(max(m.read_bytes_per_s for m in machines), max(m.matmul_flops_per_s for m in machines))


@dataclass(frozen=True)
class ModelCost:
    """Bytes and FLOPs of a step of one model, counted from its config."""

    weight_bytes: int  # every layer's weights and the head, read once per step
    row_bytes: int  # one embedding row, read per token
    kv_bytes_per_token: int  # K and V of one token, all layers
    flops_per_row: int  # 2 x the layers' matmul weights (one multiply-add each)
    head_flops_per_row: int
    flops_per_key: int  # attention: q.k and p.v for every head of every layer

    @classmethod
    def of(cls, cfg, itemsize: int) -> "ModelCost":
        h, d = cfg.hidden_size, cfg.head_dim
        attn = h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)  # q, o; k, v
        layer_matmul = attn + 3 * h * cfg.intermediate_size
        layer_params = layer_matmul + 2 * h + 2 * d  # + the two RMSNorms and q_norm/k_norm
        head = cfg.vocab_size * h
        return cls(weight_bytes=itemsize * (cfg.num_hidden_layers * layer_params + head + h), row_bytes=itemsize * h,
                   kv_bytes_per_token=cfg.kv_bytes_per_token(itemsize),
                   flops_per_row=2 * cfg.num_hidden_layers * layer_matmul, head_flops_per_row=2 * head,
                   flops_per_key=4 * cfg.num_hidden_layers * cfg.num_attention_heads * d)

    def bytes(self, s: StepShape) -> int:
        return self.weight_bytes + s.rows * self.row_bytes + s.kv_tokens * self.kv_bytes_per_token

    def flops(self, s: StepShape) -> int:
        return s.rows * self.flops_per_row + s.logit_rows * self.head_flops_per_row + s.keys * self.flops_per_key

    def floor_s(self, s: StepShape, machine: Machine) -> float:
        return max(self.bytes(s) / machine.read_bytes_per_s, self.flops(s) / machine.matmul_flops_per_s)

    def run_floor_s(self, steps: list[StepShape], machine: Machine) -> float:
        return sum(self.floor_s(s, machine) for s in steps)


def record_forwards(runner, log: list | None = None) -> list[list]:
    """Make a runner log [StepShape, None] for each forward it runs (in the returned list): its rows,
    keys, and the rows whose logits it computes (one per request, all k + 1 of a request that
    verifies proposals in L10). Its `forward_logits` and `logits_rows` are wrapped; what they
    compute is unchanged."""
    log = [] if log is None else log
    forward, pick = runner.forward_logits, runner.logits_rows

    def forward_logits(reqs, num_new):
        log.append([StepShape.of_requests([(r.cur_len, n) for r, n in zip(reqs, num_new)]), None])
        return forward(reqs, num_new)

    def logits_rows(reqs, meta):
        rows = pick(reqs, meta)  # None: every row of the forward
        log[-1][0] = replace(log[-1][0], logit_rows=log[-1][0].rows if rows is None else len(rows))
        return rows

    runner.forward_logits, runner.logits_rows = forward_logits, logits_rows
    return log


def record_steps(engine) -> list[list]:
    """Make a course engine log [StepShape, seconds] for each step it runs (in the returned list).

    Its runner's forwards are recorded (`record_forwards`), and `step` is wrapped to time the whole
    step (scheduling and sampling included); the engine's behaviour is unchanged.
    """
    log = record_forwards(engine.runner)
    step = engine.step

    def timed_step():
        start = time.perf_counter()
        record = step()
        _sync(getattr(engine.model, "device", None))
        if log and log[-1][1] is None:
            log[-1][1] = time.perf_counter() - start
        return record

    engine.step = timed_step
    return log
