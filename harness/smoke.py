"""The smoke-script skeleton shared by every lesson (contract: COURSE.md, "Smoke script contract").

A lesson's `scripts/lN_smoke.py` adds its own options and a run function; this module parses the
common options, checks the input, runs the lesson, runs HF greedy on each request alone, and
prints PASS or FAIL. Exit status: 0 all match, 1 any mismatch, 2 bad input or environment (one
line, no traceback: a full disk, an unwritable folder, memory that cannot be had, Ctrl-C), 3 a bug
(its traceback). A reader that closes the pipe early (`| head`) ends the output quietly.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from l1_contiguous import InputError, load_config
from l1_contiguous.errors import ModelLoadError
from l1_contiguous.config import Qwen3Config

from . import compare
from .cli import interrupt_received, interruption, sane_streams, say_error, watch_interrupts
from .forcing import ForcedPaths, forcing

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO_ROOT / "assets" / "tiny-qwen3-kjv"
# Chosen on the embedded model for 24 greedy tokens of plain, non-looping English whose top-2
# logit gaps stay >= 0.03 (so no comparison can flip on rounding); three different lengths.
DEFAULT_PROMPTS = [
    "Blessed are the",
    "O give thanks unto the LORD; for he is good",
    "Thus saith the LORD",
]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Seconds the hub may stay silent on one request (not the whole download, which can be long).
HUB_READ_TIMEOUT_S = 20.0
# Set by the grader for its worker, which has no transformers: a smoke script prints its ids and
# leaves the comparison with HF to whoever reads them (the judge).
NO_ORACLE = "KVCOURSE_NO_ORACLE"
# OSErrors that are the machine's state, not a bug: exit 2 with what to fix.
ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOMEM}


@dataclass
class Prompt:
    ids: list[int]
    text: str | None = None


@dataclass
class Setup:
    """Everything resolved from the common options, handed to the lesson's run function."""

    model_dir: Path
    cfg: Qwen3Config
    device: str
    dtype: torch.dtype
    tokenizer: object | None
    prompts: list[Prompt]
    max_new_tokens: int
    teacher_forced: str = "auto"  # "always": check the logits along HF's path even where ids agree


@dataclass
class RequestResult:
    prompt_ids: list[int]
    ids: list[int]  # ours, new tokens only
    logits: torch.Tensor | None = None  # ours, [len(prompt) + len(ids) - 1, vocab], for the logit check
    label: str = ""


@dataclass
class LessonRun:
    requests: list[RequestResult]
    figures: dict = field(default_factory=dict)  # lesson-specific numbers for the report and JSON
    hf_cache: Callable | None = None  # makes HF's cache for each request (L12's quantizing oracle)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        hint = ""
        if "expected one argument" in message and any(a.startswith("-") and a[1:2].isdigit() for a in sys.argv):
            hint = "; a value starting with '-' needs '=', e.g. --prompt-ids=-1,2"
        say_error(f"{message}{hint} (see --help)")
        raise SystemExit(2)


def make_parser(lesson: str, description: str) -> argparse.ArgumentParser:
    p = _Parser(prog=f"{lesson.lower()}_smoke.py", description=description)
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="HF-format model folder (or a hub id when online); default: the embedded model")
    p.add_argument("--prompt", action="append", default=[], help="prompt text; repeat for more requests")
    p.add_argument("--prompt-ids", action="append", default=[], help="raw ids '1,2,3'; repeatable")
    p.add_argument("--max-new-tokens", type=int, default=20)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--teacher-forced", choices=["auto", "always"], default="auto",
                   help="bfloat16/float16 only: run the lesson again fed HF's ids and compare the logits "
                        "at every position (auto: when a request's ids diverge from HF's; always: every run). "
                        "The rule: harness/compare.py")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    return p


def resolve_device(device: str | None, dtype: str | None) -> tuple[str, torch.dtype]:
    """--device and --dtype, defaulted: cuda with bfloat16 when torch sees a GPU, else cpu with
    float32. InputError when cuda is asked for and there is none."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda asked for, but torch sees no CUDA device; use --device cpu")
    return device, DTYPES[dtype or ("float32" if device == "cpu" else "bfloat16")]


def resolve_model(args: argparse.Namespace) -> tuple[Path, Qwen3Config, str, torch.dtype]:
    """--model, --device and --dtype: the model folder, its config, the device and the dtype;
    InputError on bad input."""
    model_dir = resolve_model_dir(args.model)
    return (model_dir, load_config(model_dir), *resolve_device(args.device, args.dtype))


def resolve(args: argparse.Namespace) -> Setup:
    """Check the common options and load config, tokenizer and prompts; InputError on bad input."""
    model_dir, cfg, device, dtype = resolve_model(args)
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    tokenizer = load_tokenizer(model_dir)
    prompts = read_prompts(args, tokenizer, cfg)
    for p in prompts:
        check_prompt(p.ids, cfg, args.max_new_tokens)
    return Setup(model_dir, cfg, device, dtype, tokenizer, prompts, args.max_new_tokens,
                 getattr(args, "teacher_forced", "auto"))


def resolve_model_dir(arg: str) -> Path:
    try:
        arg.encode("utf-8")
    except UnicodeEncodeError:  # a byte that is not UTF-8 in the path: tokenizers and HF cannot open it
        raise InputError(f"--model {arg.encode('utf-8', 'surrogateescape')!r}: the path has a byte that is not "
                         f"UTF-8; rename the folder (or link it under a UTF-8 name)") from None
    path = Path(arg).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise InputError(f"--model {arg} is a file; pass the folder that holds config.json and the weights")
    if looks_like_hub_id(arg):
        return _download(arg)
    raise InputError(f"no such folder: {arg} does not exist; pass --model with an HF-format folder "
                     f"(or a hub id, org/name)")


def looks_like_hub_id(arg: str) -> bool:
    """org/name, unless it reads as a local path: one starting with '.', or whose first part is a
    folder here (assets/tiny-qwen3-kjvv is a typo of a local folder, not a model on the hub)."""
    return (re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", arg) is not None
            and not Path(arg.split("/")[0]).exists())


def _download(repo_id: str) -> Path:
    try:
        import huggingface_hub

        # snapshot_download asks for the repository's file list with no timeout: ask first with one.
        huggingface_hub.model_info(repo_id, timeout=HUB_READ_TIMEOUT_S)
        return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt"],
                                                      etag_timeout=HUB_READ_TIMEOUT_S))
    except Exception as exc:  # offline, unknown id, no permission, silent server: all mean "use a local folder"
        raise InputError(f"could not fetch {repo_id} from the hub ({type(exc).__name__}); "
                         f"pass --model with a local folder") from None


def load_tokenizer(model_dir: Path):
    if not any((model_dir / name).exists() or (model_dir / name).is_symlink()
               for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:  # the grader's worker: the same tokenizer without transformers (L11's server's)
        from .text_tokenizer import load_tokenizer as load_without_transformers

        return load_without_transformers(model_dir)

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # a broken tokenizer.json raises whatever its parser raises
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(f"the tokenizer in {model_dir} cannot be loaded ({reason}); fix or remove "
                             f"tokenizer.json, or use --prompt-ids") from None


def read_prompts(args, tokenizer, cfg: Qwen3Config) -> list[Prompt]:
    if args.prompt and tokenizer is None:
        raise InputError(f"--prompt needs a tokenizer, and {args.model} has none; use --prompt-ids 1,2,3")
    prompts = [Prompt(encode(tokenizer, text), text) for text in args.prompt]
    prompts += [Prompt(parse_ids(s)) for s in args.prompt_ids]
    if prompts:
        return prompts
    if tokenizer is not None:
        return [Prompt(encode(tokenizer, t), t) for t in DEFAULT_PROMPTS]
    # A folder without a tokenizer (e.g. a random checkpoint): fixed ids spread over the vocabulary.
    return [Prompt([(7919 * i + 11 * n) % cfg.vocab_size for i in range(n)]) for n in (5, 11, 17)]


def encode(tokenizer, text: str) -> list[int]:
    if not text.strip():
        raise InputError("--prompt is empty; give some text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # bytes that are not UTF-8 reach sys.argv as lone surrogates
        raise InputError(f"--prompt is not valid UTF-8 (at character {exc.start}); pass UTF-8 text, "
                         f"or ids with --prompt-ids") from None
    return tokenizer.encode(text, add_special_tokens=False)


def parse_ids(spec: str) -> list[int]:
    parts = [s for s in spec.replace(" ", "").split(",") if s]
    if not parts:
        raise InputError("--prompt-ids is empty; give ids like 1,2,3")
    try:
        return [int(s) for s in parts]
    except ValueError:
        raise InputError(f"--prompt-ids {spec!r} is not a comma-separated list of integers") from None


def check_prompt(ids: list[int], cfg: Qwen3Config, max_new_tokens: int) -> None:
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise InputError(f"token id {bad[0]} is outside the vocabulary (0..{cfg.vocab_size - 1})")
    if len(ids) + max_new_tokens > cfg.max_position_embeddings:
        raise InputError(
            f"prompt of {len(ids)} tokens + {max_new_tokens} new tokens exceeds the model's "
            f"{cfg.max_position_embeddings} positions; shorten the prompt or lower --max-new-tokens")


TeacherForce = Callable[[argparse.Namespace, Setup, ForcedPaths], ForcedPaths]


def rerun_forced(run: Callable[[argparse.Namespace, Setup], LessonRun]) -> TeacherForce:
    """The default teacher forcing: the lesson's own run again, every runner forced (forcing.py)."""
    def teacher_force(args, setup, paths: ForcedPaths) -> ForcedPaths:
        with forcing(paths):
            run(args, setup)
        return paths
    return teacher_force


def run_smoke(lesson: str, description: str, run: Callable[[argparse.Namespace, Setup], LessonRun],
              add_options: Callable[[argparse.ArgumentParser], None] | None = None,
              argv: list[str] | None = None, teacher_force: TeacherForce | None = None) -> int:
    """Parse, run the lesson, compare each request with HF alone (harness/compare.py's rule),
    report. Returns the exit status. `teacher_force` reruns the lesson along HF's ids when a
    low-precision run diverges (default: `rerun_forced(run)`)."""
    sane_streams()
    watch_interrupts()  # a kill cleans up (a compiler, a temp file) like Ctrl-C
    parser = make_parser(lesson, description)
    if add_options:
        add_options(parser)
    force = teacher_force or rerun_forced(run)
    try:
        args = parser.parse_args(argv)
        setup = resolve(args)
        result = run(args, setup)
        if os.environ.get(NO_ORACLE):
            return _print_ids_only(lesson, setup, result, args.json)
        report = compare_with_hf(setup, result, lambda paths: force(args, setup, paths))
    except BaseException as exc:
        return _failure_status(exc, parser)
    try:
        print_report(lesson, setup, report, result.figures)
        if args.json:
            print(json.dumps({"lesson": lesson, "model": str(setup.model_dir), "device": setup.device,
                              "dtype": str(setup.dtype).removeprefix("torch."), "match": report["match"],
                              **result.figures, "requests": report["requests"]}))
        sys.stdout.flush()  # a closed pipe or a full disk shows here, not at exit
    except BrokenPipeError:
        _stdout_to_devnull()  # the reader has what it wanted; nothing more to say
    except KeyboardInterrupt:
        _stdout_to_devnull()
        say_error(f"{interruption()} while printing the report")
        return 2
    except OSError as exc:
        _stdout_to_devnull()
        say_error(f"cannot write the report to stdout ({exc.strerror or exc}); free some space or "
                  f"write it elsewhere")
        return 2
    return 0 if report["match"] else 1


def _print_ids_only(lesson: str, setup: Setup, result: LessonRun, as_json: bool) -> int:
    """With NO_ORACLE set (the grader's worker, which has no transformers): our ids, compared by
    whoever reads them. Exit 0: the run finished; whether it is right is not this process's call."""
    for i, r in enumerate(result.requests):
        print(f"[{i}] prompt {r.prompt_ids}\n     ours   {r.ids}")
    print(f"ids only: {NO_ORACLE} is set, so HF's ids are compared by whoever reads this run")
    if as_json:
        print(json.dumps({"lesson": lesson, "model": str(setup.model_dir), "device": setup.device,
                          "dtype": str(setup.dtype).removeprefix("torch."), "match": None, **result.figures,
                          "requests": [{"prompt_ids": r.prompt_ids, "ids": r.ids, "label": r.label}
                                       for r in result.requests]}))
    return 0


# Options that size what a lesson allocates: out of memory, the message names those its script has.
SIZE_OPTIONS = ("--num-blocks", "--kv-memory", "--cache-len", "--block-size")


def _failure_status(exc: BaseException, parser: argparse.ArgumentParser | None = None) -> int:
    """One line and exit 2 for bad input or the environment; a traceback and 3 for a bug."""
    if isinstance(exc, SystemExit):  # argparse's errors (already one line) and --help
        return exc.code if isinstance(exc.code, int) else 2
    if isinstance(exc, KeyboardInterrupt) or (isinstance(exc, Exception) and interrupt_received()):
        # after a Ctrl-C, C code may have swallowed it and raised its own error ("not a readable file")
        message = f"{interruption()} before the comparison finished; nothing was written"
    elif isinstance(exc, InputError):
        message = str(exc)
    elif isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or _is_failed_allocation(exc):
        message = f"out of memory; {_smaller(parser)}"
    elif isinstance(exc, OSError) and exc.errno in ENVIRONMENT_ERRNOS:
        where = f" ({exc.filename})" if exc.filename else ""
        message = f"{exc.strerror}{where}; free some space or fix the permissions, then run again"
    elif isinstance(exc, Exception):  # a bug, not bad input: show where, and never exit 1 (= ids differ)
        traceback.print_exception(exc)
        print("internal error (a bug in the code, or in a student copy a function not written yet; not "
              "your input): the traceback above ends where it happened", file=sys.stderr)
        return 3
    else:
        raise exc
    say_error(message)
    return 2


def _smaller(parser: argparse.ArgumentParser | None) -> str:
    """What to lower, in the script's own options (L12 has no --kv-memory, L1 no --num-blocks)."""
    own = [o for o in SIZE_OPTIONS if parser is not None and o in parser._option_string_actions]
    return f"lower {' / '.join(own)} or use a smaller model" if own else "use a smaller model"


def _is_failed_allocation(exc: BaseException) -> bool:
    """torch's CPU allocator raises a plain RuntimeError when malloc fails."""
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or "DefaultCPUAllocator" in str(exc))


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null so Python's own flush at exit does not fail (and print) again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test's capture): nothing to do
        return
    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)


def compare_with_hf(setup: Setup, result: LessonRun,
                    teacher_force: Callable[[ForcedPaths], ForcedPaths] | None = None) -> dict:
    from . import hf_reference as hf  # here, not at the top: the grader's worker has no transformers

    try:
        model = hf.load_hf_model(str(setup.model_dir), setup.device, setup.dtype)
    except Exception as exc:  # our loader read the folder; what HF still refuses is the folder's fault
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(f"transformers cannot load {setup.model_dir} ({reason})") from None
    hf_runs = [hf.hf_greedy_with_logits(model, r.prompt_ids, setup.max_new_tokens, result.hf_cache)
               for r in result.requests]
    forced = None
    diverged = any(r.ids != hf_ids for r, (hf_ids, _) in zip(result.requests, hf_runs))
    wanted = diverged or setup.teacher_forced == "always"
    if wanted and not compare.exact_required(setup.dtype) and teacher_force is not None:
        forced = teacher_force(ForcedPaths({tuple(r.prompt_ids): hf_ids
                                            for r, (hf_ids, _) in zip(result.requests, hf_runs)}))
    rows = [_compare_one(model, setup, r, hf_ids, hf_logits, forced)
            for r, (hf_ids, hf_logits) in zip(result.requests, hf_runs)]
    return {"match": all(r["verdict"] != "fail" for r in rows), "requests": rows}


def _compare_one(model, setup: Setup, r: RequestResult, hf_ids: list[int], hf_logits: torch.Tensor,
                 forced: ForcedPaths | None) -> dict:
    from . import hf_reference as hf

    gaps = hf.top2_gaps(hf_logits)
    forced_rows = forced.logits(r.prompt_ids) if forced is not None else None
    if forced_rows is None and r.ids != hf_ids and not compare.exact_required(setup.dtype):
        forced_rows = []  # no teacher forcing available: the divergence cannot be cleared
    v = compare.verdict(setup.dtype, r.ids, hf_ids, hf_logits, forced_rows, setup.cfg.num_hidden_layers)
    mismatch = v.first_mismatch
    row = {"label": r.label, "prompt_ids": r.prompt_ids, "ids": r.ids, "hf_ids": hf_ids,
           "match": mismatch is None, "first_mismatch": mismatch,
           "verdict": v.kind, "verdict_reason": v.reason,
           "min_top2_gap": float(gaps.min()) if len(gaps) else None,
           "gap_at_mismatch": v.gap if v.gap is not None else
           (float(gaps[mismatch]) if mismatch is not None and mismatch < len(gaps) else None)}
    if v.forced_max_diff is not None:
        row["teacher_forced_max_logit_diff"] = v.forced_max_diff
        row["teacher_forced_max_spacings"] = v.forced_max_spacings
    if r.logits is not None:
        ref = hf.hf_logits(model, r.prompt_ids + r.ids[:-1])
        row["max_logit_diff"] = float((r.logits.float() - ref).abs().max())
    if setup.tokenizer is not None:
        row["prompt_text"] = setup.tokenizer.decode(r.prompt_ids)
        row["text"] = setup.tokenizer.decode(r.ids)
    return row


def print_report(lesson: str, setup: Setup, report: dict, figures: dict) -> None:
    dtype = str(setup.dtype).removeprefix("torch.")
    print(f"{lesson} · model {setup.model_dir} · {setup.device} {dtype}")
    for i, row in enumerate(report["requests"]):
        label = f" {row['label']}" if row["label"] else ""
        print(f"[{i}]{label} prompt {_show(row, 'prompt_text', 'prompt_ids')}")
        print(f"     ours   {_show(row, 'text', 'ids')}")
        print(f"     HF     {_verdict(row)}")
    for key, value in figures.items():
        print(f"{key}: {value}")
    print(summary_line(report["requests"]))


def summary_line(rows: list[dict]) -> str:
    """PASS/FAIL and the counts: equal ids, near-ties cleared by teacher forcing, failures."""
    n_equal = sum(r["verdict"] == "equal" for r in rows)
    ties = [(i, r) for i, r in enumerate(rows) if r["verdict"] == "near-tie"]
    fails = [(i, r) for i, r in enumerate(rows) if r["verdict"] == "fail"]
    line = f"{'FAIL' if fails else 'PASS'}: {n_equal}/{len(rows)} requests equal HF's greedy ids"
    if ties:
        where = "; ".join(f"[{i}] {r['verdict_reason']}" for i, r in ties)
        line += f", {len(ties)} diverge at near-ties ({where}) and match HF teacher-forced"
    if fails:
        line += f"; {len(fails)} fail: " + "; ".join(f"[{i}] {r['verdict_reason']}" for i, r in fails)
    return line


def _show(row: dict, text_key: str, ids_key: str) -> str:
    text = f"{row[text_key]!r} " if text_key in row else ""
    return f"{text}ids {row[ids_key]}"


def _verdict(row: dict) -> str:
    extra = f", min top-2 gap {row['min_top2_gap']:.3g}"
    if "max_logit_diff" in row:
        extra += f", max |logit diff| {row['max_logit_diff']:.2e}"
    if row["match"]:
        return f"match ({len(row['hf_ids'])} ids){extra}"
    i, gap = row["first_mismatch"], row["gap_at_mismatch"]
    hf_id = row["hf_ids"][i] if i < len(row["hf_ids"]) else "end"
    ours = row["ids"][i] if i < len(row["ids"]) else "end"
    tie = f"; HF's gap between its id and ours there is {gap:.2g}" if gap is not None else ""
    word = "NEAR-TIE" if row["verdict"] == "near-tie" else "MISMATCH"
    return f"{word} at new token {i}: ours {ours}, HF {hf_id}; HF ids {row['hf_ids']}{tie}{extra}; {row['verdict_reason']}"
