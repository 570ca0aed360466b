"""Issue 15 acceptance 1 and 3: /dashboard in headless Chromium against a real server with an API key. While a few
concurrent streams run, the page's running count, step chart and KV gauge move; afterwards they return to idle.

Needs Debian's chromium (scripts/install.sh installs it) and the playwright package (test extras; it drives the
system browser, it downloads none). Skipped, saying so, where either is missing. The README's screenshot is made
by scripts/dashboard_screenshot.py.
"""

import asyncio
import json
import os
import random
import shutil

import aiohttp
import pytest

from tests.server import ShuttleServer

CHROMIUM = os.environ.get("SHUTTLE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
# The flags that work on these machines: no sandbox as root, no GPU, and no background traffic to a closed network.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
KEY = "sk-dash-browser-0815"
MAX_TOKENS = 400  # more than the test waits for: the clients leave once the page has shown the load

try:
    from playwright.async_api import async_playwright
except ImportError:  # pragma: no cover - depends on the machine
    async_playwright = None

pytestmark = [
    pytest.mark.skipif(async_playwright is None, reason="the playwright package is not installed (pip install "
                       "playwright; it drives the system's chromium, no browser download)"),
    pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK), reason=f"no Chromium at {CHROMIUM} (Debian: apt-get install "
                       "chromium chromium-driver, as scripts/install.sh does; or set SHUTTLE_CHROMIUM)"),
]

CONNECTION = """document.getElementById("connection").dataset.state === "{}" """
READ_DOM = """() => ({
    frames: Number(document.body.dataset.frames),
    connection: document.getElementById("connection").dataset.state,
    running: Number(document.getElementById("running").dataset.value),
    bars: Number(document.getElementById("step-chart").dataset.bars),
    decode: Number(document.getElementById("step-chart").dataset.decodeTokens || 0),
    prefill: Number(document.getElementById("step-chart").dataset.prefillTokens || 0),
    kvInUse: Number(document.getElementById("kv-gauge").dataset.inUse),
    kvTotal: Number(document.getElementById("kv-gauge").dataset.total),
    kvWidth: document.getElementById("kv-in-use").style.width,
    address: location.href,
})"""


@pytest.fixture(scope="module")
def server():
    srv = ShuttleServer("--max-num-batched-tokens", "64", "--num-kv-blocks", "96", step_delay=0.02,
                        env={"SHUTTLE_API_KEY": KEY})
    yield srv
    srv.stop()


async def wait_until(page, condition: str, timeout: float = 15.0) -> None:
    """Poll a JavaScript expression until it is true. Not page.wait_for_function: that evaluates its predicate with
    eval() inside the page, which the page's Content-Security-Policy forbids (as it should)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await page.evaluate(condition):
        assert asyncio.get_running_loop().time() < deadline, f"still false after {timeout} s: {condition}"
        await asyncio.sleep(0.1)


async def stream(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> int:
    """One streamed completion; returns its usage's completion_tokens."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    usage = None
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200
        async for line in response.content:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage["completion_tokens"] if usage else 0


async def test_dashboard_follows_load_and_returns_to_idle(server):
    rng = random.Random(15)
    prefix = [rng.randrange(3, 500) for _ in range(48)]  # shared: later requests hit the prefix cache
    prompts = [[1, *prefix, *(rng.randrange(3, 500) for _ in range(40))] for _ in range(4)]
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 860})
            await page.goto(f"{server.url}/dashboard?window=2")  # no key yet: the feed refuses, the page asks
            await wait_until(page, CONNECTION.format("unauthorized"))
            assert (await page.evaluate(READ_DOM))["frames"] == 0
            await page.fill("#key", KEY)
            await page.click("#key-form button")
            await wait_until(page, "Number(document.body.dataset.frames) >= 2")
            idle = await page.evaluate(READ_DOM)
            assert idle["connection"] == "live"
            assert (idle["running"], idle["bars"], idle["kvInUse"]) == (0, 0, 0) and idle["kvTotal"] == 96

            seen = []
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session:

                async def staggered(i: int) -> int:
                    await asyncio.sleep(0.3 * i)  # later prefills share steps with earlier decodes
                    return await stream(session, server.url, prompts[i], MAX_TOKENS)

                # Load for as long as it takes the page to show it (short on a quiet machine, longer on a busy
                # one), then the clients leave: their requests are aborted and the engine goes idle.
                load = [asyncio.create_task(staggered(i)) for i in range(4)]
                try:
                    while not any(task.done() for task in load):
                        seen.append(await page.evaluate(READ_DOM))
                        if (max(x["running"] for x in seen) >= 3 and max(x["decode"] for x in seen) > 0
                                and max(x["prefill"] for x in seen) > 0 and max(x["kvInUse"] for x in seen) > 0):
                            break
                        await asyncio.sleep(0.2)
                    assert not any(task.done() for task in load), "the load ended before the page showed it"
                finally:
                    for task in load:
                        task.cancel()
                    await asyncio.gather(*load, return_exceptions=True)
            assert max(s["running"] for s in seen) >= 3
            assert max(s["bars"] for s in seen) > 0
            assert max(s["decode"] for s in seen) > 0 and max(s["prefill"] for s in seen) > 0
            assert max(s["kvInUse"] for s in seen) > 0 and any(s["kvWidth"] not in ("", "0%") for s in seen)
            assert seen[-1]["frames"] > seen[0]["frames"]

            # idle again: nobody running, no step in the 2 s window, no KV block referenced
            await wait_until(page, """document.getElementById("running").dataset.value === "0"
                && document.getElementById("step-chart").dataset.bars === "0"
                && document.getElementById("kv-gauge").dataset.inUse === "0" """)
            after = await page.evaluate(READ_DOM)
            assert after["connection"] == "live" and after["kvWidth"] == "0%"

            # the key in the address fragment (never sent to the server): a fresh tab connects, and the key leaves
            # the address bar at once
            second = await browser.new_page()
            await second.goto(f"{server.url}/dashboard#key={KEY}")
            await wait_until(second, "Number(document.body.dataset.frames) >= 1")
            fresh = await second.evaluate(READ_DOM)
            assert fresh["connection"] == "live" and KEY not in fresh["address"]
        finally:
            await browser.close()
    assert not any(KEY in line for line in server.output)
