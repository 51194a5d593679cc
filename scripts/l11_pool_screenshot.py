#!/usr/bin/env python3
"""Take a screenshot of L11's pool page while requests stream (for the lesson): starts the server on
127.0.0.1, streams a few sampled requests that share a prompt, and points headless chromium at /.

    python scripts/l11_pool_screenshot.py lessons/img/L11-pool.png
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from harness.smoke import DEFAULT_MODEL  # noqa: E402
from l11_serve import Server, build_server  # noqa: E402

SYSTEM = "And the LORD spake unto Moses, saying, Speak unto the children of Israel, and say unto them,"
WORKLOAD = [(SYSTEM + " Blessed", 1, 300), (SYSTEM + " Hear, O Israel", 3, 200), ("In the beginning", 1, 400),
            ("Thus saith the LORD", 2, 250)]  # (prompt, n, max_tokens)


def browser() -> str | None:
    return next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


def chromium_args(exe: str, url: str, *extra: str) -> list[str]:
    return [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=1500",
            *extra, url]


def stream(url: str, prompt: str, n: int, max_tokens: int) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "n": n, "seed": 1, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for _ in r.iter_lines():
            pass


def main(out: str) -> int:
    exe = browser()
    if exe is None:
        print("error: no chromium found; install it (apt-get install chromium)", file=sys.stderr)
        return 2
    app, _, _ = build_server(DEFAULT_MODEL, num_blocks=128, block_size=16)
    with Server(app) as url:
        httpx.post(f"{url}/v1/completions", json={"prompt": "Blessed are the meek", "max_tokens": 60}, timeout=120)
        workers = [threading.Thread(target=stream, args=(url, *w)) for w in WORKLOAD]
        for w in workers:
            w.start()
        time.sleep(4)  # let the outputs grow a few blocks
        subprocess.run(chromium_args(exe, url + "/", "--window-size=900,600", f"--screenshot={out}"),
                       capture_output=True, timeout=120, check=True)
        for w in workers:
            w.join(300)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "lessons/img/L11-pool.png"))
