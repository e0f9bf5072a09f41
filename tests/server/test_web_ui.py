"""The chat page at ``/`` and the API docs, in a real browser (Debian's chromium driven
by Playwright) against a real ``llmctl serve demo`` with an API key. (Waits are
written as functions: the pages' Content-Security-Policy forbids evaluating strings.)

Every request the browser makes is recorded; none may go to another host. Screenshots
land in ``test-artifacts/web/`` (ignored by git).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import REPO
from tests.helpers.server_process import ServerProcess, start_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
INSTALL = (
    "needs Debian's chromium and Playwright: `apt-get install -y chromium` and "
    "`pip install playwright` (scripts/setup.sh does both; no browser download)"
)
if CHROMIUM is None:
    pytest.skip(f"chromium not found: {INSTALL}", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason=f"playwright missing: {INSTALL}")

API_KEY = "web-key-7c2e"
ARTIFACTS = REPO / "test-artifacts" / "web"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # torch is the slower backend on demo (~600 tokens/s here): a long answer lasts
    # long enough to press stop in the middle of it.
    args = ["demo", "--backend", "torch", "--api-key", API_KEY, "--max-batch-size", "8"]
    process = start_server(args, env={"OMP_NUM_THREADS": "1"})
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


class Page:
    """A browser tab on the server, recording the host of every request it makes."""

    def __init__(self, browser: object, server: ServerProcess, **context_options: object) -> None:
        self.server = server
        self.context = browser.new_context(**context_options)
        self.urls: list[str] = []
        self.errors: list[str] = []
        self.context.on("request", lambda request: self.urls.append(request.url))
        self.page = self.context.new_page()
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))

    def open_with_key(self) -> None:
        """Load ``/``; the server answers 401, so the page asks for the key."""
        self.page.goto(self.server.url + "/")
        self.page.wait_for_selector("#key-dialog[open]", timeout=10_000)
        self.page.fill("#key-input", API_KEY)
        self.page.click("#key-form button")
        self.page.wait_for_function("() => document.querySelector('#model').value === 'demo'")

    def screenshot(self, name: str) -> None:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)

    def check_only_the_server_was_asked(self) -> None:
        server = urlsplit(self.server.url)
        assert self.urls, "the browser recorded no request at all"
        # data: and blob: URLs are made in the page (ReDoc's worker, an empty image)
        elsewhere = {
            url
            for url in self.urls
            if urlsplit(url).scheme not in ("data", "blob") and urlsplit(url)[:2] != server[:2]
        }
        assert not elsewhere, f"requests to other hosts: {elsewhere}"
        assert not self.errors, f"errors in the page: {self.errors}"

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def tab(browser: object, server: ServerProcess) -> Iterator[Page]:
    page = Page(browser, server, viewport={"width": 1280, "height": 800})
    try:
        yield page
    finally:
        page.close()


def metric(server: ServerProcess, sample: str) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[1])
    return 0.0  # a labelled counter not incremented yet


def test_a_message_gets_a_streamed_answer(tab: Page, server: ServerProcess) -> None:
    tab.context.grant_permissions(["clipboard-read", "clipboard-write"])
    tab.open_with_key()
    assert tab.page.evaluate("sessionStorage.getItem('llmctl-api-key')") == API_KEY
    page = tab.page
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "400")
    page.fill("#system", "You are terse.")
    # Count how often the answer's text changes before it is finished: a streamed
    # answer grows many times, a whole one would appear once.
    page.evaluate(
        """() => {
        window.answerUpdates = 0;
        new MutationObserver(() => {
          const body = document.querySelector('.msg.assistant .body');
          if (body && !document.querySelector('.msg.assistant .meta')) window.answerUpdates++;
        }).observe(document.querySelector('#messages'), {childList: true, subtree: true});
      }"""
    )
    page.fill("#prompt", "Tell me a story")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant .meta", timeout=60_000)
    assert page.evaluate("window.answerUpdates") > 3
    assert page.inner_text(".msg.user") == "Tell me a story"
    meta = page.inner_text(".msg.assistant .meta")
    assert "400 tokens" in meta and "length" in meta, meta

    # Copy gives the answer's own text: the same as the API's greedy answer.
    page.click(".msg.assistant .copy")
    copied = page.evaluate("navigator.clipboard.readText()")
    reference = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Tell me a story"},
            ],
            "temperature": 0,
            "top_p": 1,
            "max_tokens": 400,
        },
        timeout=60,
    ).json()
    assert copied == reference["choices"][0]["message"]["content"]
    tab.screenshot("chat")

    # The server panel shows the server's settings.
    page.wait_for_function("() => document.querySelector('#facts').textContent.includes('torch')")
    facts = page.inner_text("#facts")
    assert "Block size" in facts and "64 tokens" in facts
    assert "KV budget" in facts and "Quantization" in facts

    page.click("#new-chat")
    assert page.locator(".msg").count() == 0
    tab.check_only_the_server_was_asked()


def test_stop_aborts_the_answer_on_the_server(tab: Page, server: ServerProcess) -> None:
    tab.open_with_key()
    page = tab.page
    page.fill("#max_tokens", "2000")
    aborted_before = metric(server, 'llmctl_request_finished_total{reason="abort"}')
    page.fill("#prompt", "A long one, please")
    page.press("#prompt", "Enter")
    page.wait_for_function(
        "() => document.querySelector('.msg.assistant .body').textContent.length > 20",
        timeout=30_000,
    )
    assert metric(server, "llmctl_kv_blocks_used") > 0  # the answer holds KV blocks
    page.click("#stop")
    page.wait_for_selector(".msg.assistant .meta", timeout=10_000)
    assert "stopped" in page.inner_text(".msg.assistant .meta")
    deadline = time.monotonic() + 10
    while metric(server, "llmctl_kv_blocks_used") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server, "llmctl_kv_blocks_used") == 0  # the blocks are back in the pool
    assert metric(server, 'llmctl_request_finished_total{reason="abort"}') == aborted_before + 1
    assert page.is_visible("#send") and not page.is_visible("#stop")
    tab.check_only_the_server_was_asked()


def test_a_refused_request_shows_the_servers_reason(tab: Page) -> None:
    tab.open_with_key()
    page = tab.page
    page.fill("#max_tokens", "100000")  # beyond demo's session of 2048 tokens
    page.fill("#prompt", "too long")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant.error .meta", timeout=30_000)
    text = page.inner_text(".msg.assistant.error .body")
    assert "max_tokens" in text and "2048" in text, text
    assert page.is_visible("#send")  # ready for the next message
    page.fill("#max_tokens", "8")
    page.fill("#seed", "7")
    page.fill("#prompt", "shorter")
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant:not(.error) .meta", timeout=30_000)
    body = json.loads(sent.value.post_data)
    # The refused question is not part of the chat any more; the controls are sent.
    assert body["messages"] == [{"role": "user", "content": "shorter"}]
    assert (body["max_tokens"], body["seed"], body["stream"]) == (8, 7, True)
    tab.check_only_the_server_was_asked()


def _load(server: ServerProcess, stop: threading.Event) -> None:
    """Requests of 600 tokens, 4 at a time, until ``stop`` (bounded: 40 at most)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"messages": [{"role": "user", "content": "load"}], "max_tokens": 600}

    def one_client() -> None:
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
            for _ in range(10):
                if stop.is_set():
                    return
                client.post("/v1/chat/completions", json=body)

    threads = [threading.Thread(target=one_client) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_the_plots_move_while_a_load_runs(tab: Page, server: ServerProcess) -> None:
    tab.open_with_key()
    page = tab.page
    page.wait_for_function("() => document.querySelector('#plot-tps').dataset.last !== undefined")
    idle_points = page.get_attribute("#plot-tps polyline", "points")
    stop = threading.Event()
    load = threading.Thread(target=_load, args=(server, stop))
    load.start()
    try:
        # Tokens/s above zero, requests running and KV blocks in use, all in the plots.
        page.wait_for_function(
            """() => {
              const last = (id) => document.querySelector(id).dataset.last.split(',').map(Number);
              return last('#plot-tps')[0] > 0 && last('#plot-requests')[0] > 0
                && last('#plot-kv')[0] > 0;
            }""",
            timeout=30_000,
        )
        page.wait_for_function(
            "() => document.querySelector('#plot-ttft').dataset.last > 0", timeout=30_000
        )
        tab.screenshot("plots-under-load")
    finally:
        stop.set()
        load.join()
    assert page.get_attribute("#plot-tps polyline", "points") != idle_points
    tab.check_only_the_server_was_asked()


def test_a_wrong_or_no_key_is_asked_again_or_refused(tab: Page) -> None:
    page = tab.page
    page.goto(tab.server.url + "/")
    page.wait_for_selector("#key-dialog[open]", timeout=10_000)
    page.fill("#key-input", "wrong-key")
    page.click("#key-form button")
    page.wait_for_selector("#key-dialog[open]", timeout=10_000)  # 401 again: asked again
    page.fill("#key-input", "")
    page.click("#key-form button")  # given up
    page.wait_for_function(
        "() => document.querySelector('#server-status').textContent.includes('API key')"
    )
    assert page.locator("#model option").count() == 0
    tab.check_only_the_server_was_asked()


def test_first_paint_within_a_second(tab: Page) -> None:
    tab.page.goto(tab.server.url + "/")
    first_paint = tab.page.evaluate(
        """() => new Promise((resolve) => {
          const found = () => performance.getEntriesByName('first-contentful-paint')[0];
          if (found()) return resolve(found().startTime);
          new PerformanceObserver(() => found() && resolve(found().startTime))
            .observe({type: 'paint', buffered: true});
        })"""
    )
    print(f"first contentful paint: {first_paint:.0f} ms")
    assert first_paint < 1000


def test_readable_on_a_phone(browser: object, server: ServerProcess) -> None:
    tab = Page(browser, server, viewport={"width": 390, "height": 844}, is_mobile=True)
    try:
        tab.open_with_key()
        page = tab.page
        page.fill("#max_tokens", "60")
        page.fill("#prompt", "hi")
        page.press("#prompt", "Enter")
        page.wait_for_selector(".msg.assistant .meta", timeout=30_000)
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"the page is {width}px wide on a 390px screen"
        box = page.locator("#prompt").bounding_box()
        assert box is not None and box["width"] > 200  # the message box is usable
        tab.screenshot("phone")
        tab.check_only_the_server_was_asked()
    finally:
        tab.close()


def test_the_markdown_renderer(tab: Page) -> None:
    tab.page.goto(tab.server.url + "/")
    source = "\n".join(
        [
            "# Title",
            "Some **bold**, *italic* and `code <b>`.",
            "",
            "- one",
            "- two",
            "",
            "```python",
            "print('<script>')",
            "```",
            "[site](https://example.org) [bad](javascript:alert(1)) ![img](https://example.org/x.png)",
            "```",
            "unclosed fence, as while streaming",
        ]
    )
    parsed = tab.page.evaluate(
        """(source) => {
          const doc = new DOMParser().parseFromString(renderMarkdown(source), 'text/html');
          const q = (s) => [...doc.querySelectorAll(s)].map((e) => e.textContent);
          return {h1: q('h1'), strong: q('strong'), em: q('em'), code: q('p code'),
                  li: q('li'), pre: q('pre code'), lang: q('pre .lang'),
                  links: [...doc.querySelectorAll('a')].map((a) => a.getAttribute('href')),
                  images: doc.querySelectorAll('img').length,
                  scripts: doc.querySelectorAll('script, b').length};
        }""",
        source,
    )
    assert parsed["h1"] == ["Title"]
    assert parsed["strong"] == ["bold"] and parsed["em"] == ["italic"]
    assert parsed["code"] == ["code <b>"]
    assert parsed["li"] == ["one", "two"]
    assert parsed["pre"] == ["print('<script>')", "unclosed fence, as while streaming"]
    assert parsed["lang"] == ["python"]
    # Only http(s) links, an image only as a link: an answer cannot make the page load
    # anything, nor run script.
    assert parsed["links"] == ["https://example.org", "https://example.org/x.png"]
    assert parsed["images"] == 0 and parsed["scripts"] == 0


@pytest.mark.parametrize(
    ("path", "ready"),
    [("/docs", ".swagger-ui .opblock"), ("/redoc", "text=Create Chat Completion")],
)
def test_the_api_docs_render_offline(tab: Page, path: str, ready: str) -> None:
    tab.page.goto(tab.server.url + path)
    tab.page.wait_for_selector(ready, timeout=30_000)
    tab.page.wait_for_load_state("networkidle")
    if path == "/docs":
        assert tab.page.locator(".swagger-ui .opblock").count() >= 6
    tab.screenshot(path.strip("/"))
    tab.check_only_the_server_was_asked()


def test_stats_takes_the_api_key(server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/stats", timeout=10).status_code == 401
    stats = httpx.get(
        f"{server.url}/stats", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10
    ).json()
    assert stats["backend"] == "torch" and stats["model"] == "demo"
    assert stats["engine"]["block_size"] == stats["settings"]["cache_block_seq_len"] == 64
    assert stats["settings"]["quantization"] == "none"
    assert json.dumps(stats)  # plain JSON values only (the KV budget as text)
