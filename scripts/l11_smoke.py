#!/usr/bin/env python3
"""L11 smoke test: start the server on 127.0.0.1 (a free port), send every prompt at once through a
real HTTP client (streamed, greedy), and compare each request's ids with HF's; the text must equal
the tokenizer's decoding of those ids, and every block must be free again when the server stops."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.cli import starting  # noqa: E402

with starting():  # a Ctrl-C during these imports (a second or more) ends in one line, exit 2
    import httpx  # noqa: E402

    from harness.smoke import LessonRun, RequestResult, run_smoke  # noqa: E402
    from l1_contiguous import InputError  # noqa: E402
    from l11_serve import Server, build_server  # noqa: E402


LESSON = "L11"
TIMEOUT_S = 120  # per request: the server must answer (and each stream end) well within this


def add_options(parser):
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=256, help="KV pool size in blocks (default 256)")
    parser.add_argument("--prefix-sharing", choices=["on", "off"], default="on")


def stream_completion(url: str, prompt_ids: list[int], max_tokens: int) -> dict:
    """POST one streamed greedy completion; returns its ids, text, finish reason and event count."""
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    ids, text, finish, events = [], "", None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as response:
        if response.status_code != 200:
            raise InputError(f"the server answered {response.status_code}: {response.read().decode()[:200]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events += 1
            choice = json.loads(line[len("data: "):])["choices"][0]
            ids += choice["token_ids"]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
    return {"ids": ids, "text": text, "finish_reason": finish, "events": events}


def run(args, setup) -> LessonRun:
    if args.block_size < 1 or args.num_blocks < 1:
        raise InputError("--block-size and --num-blocks must be at least 1")
    app, loop, tokenizer = build_server(setup.model_dir, args.num_blocks, args.block_size, setup.device,
                                        setup.dtype, prefix_sharing=args.prefix_sharing == "on")
    with Server(app) as url, ThreadPoolExecutor(len(setup.prompts)) as pool:
        answers = list(pool.map(lambda p: stream_completion(url, p.ids, setup.max_new_tokens), setup.prompts))
        state = httpx.get(f"{url}/pool", timeout=TIMEOUT_S).json()
    loop.engine.alloc.check()
    texts_ok = [tokenizer is None or a["text"] == tokenizer.decode(a["ids"], skip_special_tokens=True)
                for a in answers]
    results = [RequestResult(p.ids, a["ids"], label=f"{a['events']} events, finish {a['finish_reason']}")
               for p, a in zip(setup.prompts, answers)]
    figures = {"url_host": "127.0.0.1", "texts_equal_decoded_ids": all(texts_ok),
               "blocks_total": state["num_blocks"], "blocks_used_after": state["blocks_used"],
               "all_blocks_free_at_end": state["blocks_used"] == 0, "engine_steps": state["step"],
               "texts": [a["text"] for a in answers]}
    if not all(texts_ok) or state["blocks_used"]:
        raise RuntimeError(f"server bookkeeping broken: texts equal their ids {texts_ok}, "
                           f"blocks still used {state['blocks_used']}")
    return LessonRun(results, figures)


if __name__ == "__main__":
    sys.exit(run_smoke(LESSON, __doc__, run, add_options))
