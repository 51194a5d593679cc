"""L11 §7: the live pool page in a real headless browser (Debian's chromium; skipped without one):
it loads, shows blocks in use while a long request streams, and all blocks free after it."""

from __future__ import annotations

import re
import subprocess
import threading

import httpx
import pytest

from helpers import load_script
from probes_l11 import slow_steps
from l11_serve import Server, build_server
from serve_helpers import TIMEOUT_S, wait_idle

pytestmark = [pytest.mark.l11, pytest.mark.usefixtures("one_torch_thread")]

shot = load_script("l11_pool_screenshot")
BROWSER = shot.browser()


def rendered(url: str) -> str:
    """The page's DOM after its script has run (fetched /pool and drawn the grid)."""
    out = subprocess.run(shot.chromium_args(BROWSER, url + "/", "--dump-dom"), capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-500:]
    return out.stdout


def headline(dom: str, name: str) -> str:
    return re.search(rf'<b id="{name}">([^<]*)</b>', dom).group(1)


@pytest.mark.skipif(BROWSER is None, reason="no headless chromium on this machine (make setup installs it "
                                            "where it may: apt-get install chromium)")
def test_page_shows_blocks_in_use_while_a_request_streams_and_all_free_after(embedded_model_dir):
    app, loop, _ = build_server(embedded_model_dir, num_blocks=64, block_size=16)
    # The request must still stream while the browser starts and draws (seconds on a loaded machine):
    # each step waits 50 ms, so its 900 tokens would take 45 s; the test hangs up long before.
    slow_steps(loop, 0.05)
    with Server(app) as url:
        started, stop = threading.Event(), threading.Event()

        def long_stream():
            body = {"prompt": "Blessed are the", "max_tokens": 900, "temperature": 0, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
                for line in r.iter_lines():
                    started.set()
                    if stop.is_set():
                        break  # hang up: the server aborts the request

        worker = threading.Thread(target=long_stream)
        worker.start()
        try:
            assert started.wait(TIMEOUT_S)
            during = rendered(url)
        finally:
            stop.set()
            worker.join(TIMEOUT_S)
        wait_idle(loop)
        after = rendered(url)
    assert "live" in during and headline(during, "running") == "1" and headline(during, "blocks-total") == "64"
    used = int(headline(during, "blocks-used"))
    assert used >= 1 and during.count('data-state="used"') == used  # the grid draws what the headline says
    assert headline(after, "blocks-used") == "0" and headline(after, "running") == "0"
    assert 'data-state="used"' not in after and after.count('class="block ') == 64
