"""The playground page (`GET /` of `redwood serve`) in headless Chromium, against a real server.

A real `redwood serve` (tiny target + a draft that agrees often, so answers hold both accepted draft
tokens and the target's corrections / bonus tokens) on a loopback port; Debian's `chromium` driven over
the Chrome DevTools Protocol. The test types prompts as a user would, waits for each streamed answer, and
checks the page against the server's own non-streamed greedy answers: the coloured token spans
concatenate to that text, both colours appear, the counters match the server's figures, the second turn
carries the first (multi-turn), an API-key error shows in the page, the page requests nothing but its own
server, and a screenshot of the result is a real PNG showing both colours. Stop, on a throttled link,
ends the stream mid-answer and keeps the part that came (a prefix of the full answer).

Chromium: `scripts/setup.sh --test` (run by `scripts/test.sh`) installs it when root with apt; set
REDWOOD_SKIP_BROWSER=1 to skip instead.
"""

from __future__ import annotations

import base64
import fcntl
import io
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import save_target_and_draft

WIDTH, HEIGHT = 1200, 800
API_KEY = "playground-test-key"
MAX_TOKENS = 40
# The page's light-scheme token backgrounds (--draft, --target in playground.html): the screenshot must show both.
DRAFT_RGB, TARGET_RGB = (0xC9, 0xEF, 0xD3), (0xFD, 0xE2, 0xBD)


# ---------------------------------------------------------------------------------------------- the browser
def chromium_executable() -> str:
    for name in (os.environ.get("REDWOOD_CHROMIUM"), "chromium", "chromium-browser"):
        if name and (path := shutil.which(name)):
            return path
    if os.environ.get("REDWOOD_SKIP_BROWSER") == "1":
        pytest.skip("chromium not installed (REDWOOD_SKIP_BROWSER=1)")
    pytest.fail(
        "the playground test needs Debian's chromium: run scripts/setup.sh --test as root, or "
        "`sudo apt-get install --no-install-recommends chromium` (or set REDWOOD_SKIP_BROWSER=1 to skip)",
        pytrace=False,
    )


# A small Python process that moves the two pipe ends onto fds 3 and 4, then becomes the browser (exec).
_FD_SHIM = (
    "import os, sys; r, w = int(sys.argv[1]), int(sys.argv[2]); os.dup2(r, 3); os.dup2(w, 4); "
    "os.close(r); os.close(w); os.execv(sys.argv[3], sys.argv[3:])"
)


def _high_pipe() -> tuple[int, int]:
    """os.pipe() with both ends at fds >= 10, so the shim's dup2 onto 3 and 4 cannot clobber one of them."""
    ends = []
    for fd in os.pipe():
        ends.append(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10))
        os.close(fd)
    return ends[0], ends[1]


class Browser:
    """Headless Chromium spoken to over the DevTools protocol on a pipe (--remote-debugging-pipe: the
    browser reads NUL-terminated JSON messages on fd 3 and writes them on fd 4, as Puppeteer does). A pipe
    needs no port (no race for one, nothing listening) and no websocket framing: the stdlib suffices."""

    def __init__(self, executable: str, profile: Path):
        to_child_r, self._to_child = _high_pipe()
        self._from_child, from_child_w = _high_pipe()
        args = [
            executable,
            "--headless",
            "--no-sandbox",  # (root needs --no-sandbox)
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--mute-audio",
            "--hide-scrollbars",
            f"--window-size={WIDTH},{HEIGHT}",
            f"--user-data-dir={profile}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        self.log = profile / "chromium.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _FD_SHIM, str(to_child_r), str(from_child_w), *args],
                pass_fds=(to_child_r, from_child_w),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        os.close(to_child_r)
        os.close(from_child_w)
        self._next_id = 0
        self._waiting: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        self.events: queue.Queue = queue.Queue()  # every event message, for the test to inspect
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buffer = b""
        with os.fdopen(self._from_child, "rb", buffering=0) as pipe:
            while chunk := pipe.read(1 << 16):
                *messages, buffer = (buffer + chunk).split(b"\0")
                for raw in messages:
                    message = json.loads(raw)
                    if "id" not in message:
                        self.events.put(message)
                        continue
                    with self._lock:
                        box = self._waiting.pop(message["id"], None)
                    if box is not None:
                        box.put(message)

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30.0) -> dict:
        with self._lock:
            self._next_id += 1
            call_id = self._next_id
            box = self._waiting[call_id] = queue.Queue(maxsize=1)
        message = {"id": call_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        try:
            reply = box.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(
                f"chromium gave no reply to {method} in {timeout} s; its log:\n"
                f"{self.log.read_text(errors='replace')[-3000:]}"
            ) from None
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    def drain_events(self) -> list[dict]:
        out = []
        while not self.events.empty():
            out.append(self.events.get_nowait())
        return out

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
            self.proc.wait(timeout=10)
        os.close(self._to_child)


class Tab:
    """One page of the browser, attached through a flat session, at WIDTH × HEIGHT CSS pixels (scale 1)."""

    def __init__(self, browser: Browser):
        self.browser = browser
        target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Network"):
            self.send(f"{domain}.enable")
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False},
        )
        # The light palette, whatever the host prefers: the screenshot check looks for its colours.
        self.send("Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": "light"}]})

    def send(self, method: str, params: dict | None = None, timeout: float = 30.0) -> dict:
        return self.browser.send(method, params, session=self.session, timeout=timeout)

    def eval(self, expression: str):
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float):
        deadline = time.monotonic() + timeout
        while not (value := self.eval(expression)):
            if time.monotonic() > deadline:
                state = self.eval(
                    "document.body && [document.body.dataset.state, document.getElementById('error').textContent]"
                )
                raise TimeoutError(f"{expression!r} still false after {timeout} s (page state, error: {state})")
            time.sleep(0.05)
        return value

    def click(self, selector: str) -> None:
        """A mouse press and release at the element's centre, as a user's click."""
        x, y = self.eval(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1})

    def type(self, selector: str, text: str) -> None:
        """Focus the field and type `text` into it (input events, as a keyboard would)."""
        self.eval(f"document.querySelector({json.dumps(selector)}).focus()")
        self.send("Input.insertText", {"text": text})

    def set_value(self, selector: str, value: str) -> None:
        self.eval(f"document.querySelector({json.dumps(selector)}).value = {json.dumps(value)}")

    def screenshot(self) -> bytes:
        return base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"})["data"])


# ---------------------------------------------------------------------------------------------- the server
def _request(url: str, body: dict | None = None, key: str | None = API_KEY, timeout: float = 60.0):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=timeout) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read()


@pytest.fixture(scope="module")
def playground_url(serve_factory, tmp_path_factory, tokenizer) -> str:
    """`redwood serve` (tests/serve/conftest.py's factory) of a tiny target with a close draft (γ = 3:
    answers hold both accepted draft tokens and the target's own) and an API key; → its base URL."""
    root = tmp_path_factory.mktemp("playground-models")
    save_target_and_draft(root, tokenizer, noise=0.01)
    return serve_factory(
        "--draft-model", str(root / "draft"), "--gamma", "3", "--api-key", API_KEY, model=root / "target"
    ).url


@pytest.fixture(scope="module")
def chromium() -> str:
    """The browser's path (or the test fails / skips saying how to get it); tests ask for it before the
    server so that a missing browser is reported without starting one."""
    return chromium_executable()


@pytest.fixture()
def tab(chromium, tmp_path):
    profile = tmp_path / "profile"
    profile.mkdir()
    browser = Browser(chromium, profile)
    try:
        yield Tab(browser)
    finally:
        browser.close()


def greedy_answer(url: str, model: str, messages: list[dict]) -> dict:
    """The server's non-streamed greedy answer, with its redwood stats."""
    _, _, raw = _request(
        url + "/v1/chat/completions",
        {"model": model, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS, "redwood": {"stats": True}},
    )
    return json.loads(raw)


# ---------------------------------------------------------------------------------------------- the test
TOKENS_JS = (
    "Array.from(document.querySelectorAll('#messages .msg.assistant')).map(m => "
    "Array.from(m.querySelectorAll('.tok')).map(s => [s.textContent, s.className]))"
)


def test_playground_page_is_self_contained(playground_url):
    status, content_type, raw = _request(playground_url + "/", key=None)
    page = raw.decode()
    assert status == 200 and content_type.startswith("text/html")
    assert page == (Path(__file__).parents[2] / "src/redwood/serve/static/playground.html").read_text()
    # Nothing that needs the network: no external URL a browser would load; model text only via textContent.
    for external in ("http://", "https://", "//fonts.", "@import", "<script src", '<link rel="stylesheet"'):
        assert external not in page, external
    script = page.split("<script>", 1)[1].split("</script>", 1)[0]
    for html_sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert html_sink not in script, html_sink


def test_playground_streams_coloured_tokens(chromium, playground_url, tab, tmp_path):
    tab.send("Page.navigate", {"url": playground_url + "/"})
    # Without the key the model list fails with the server's 401 message, shown in the page.
    tab.wait_for("document.body && document.body.dataset.models === '0'", timeout=15)
    error = tab.eval("document.getElementById('error').textContent")
    assert error.startswith("Could not list models: HTTP 401"), error
    tab.type("#api-key", API_KEY)
    tab.eval("document.getElementById('api-key').dispatchEvent(new Event('change'))")  # (as on leaving it)
    tab.wait_for("document.body.dataset.models === '1'", timeout=15)
    assert tab.eval("document.getElementById('error').hidden") is True
    model = tab.eval("document.getElementById('model').value")
    assert model == "tiny"  # (the factory's --served-model-name)
    tab.set_value("#temperature", "0")
    tab.set_value("#max-tokens", str(MAX_TOKENS))

    prompts = ["Paris is the capital of", "And Rome?"]
    messages: list[dict] = []
    for turn, prompt in enumerate(prompts):
        tab.type("#prompt", prompt)
        tab.click("#send")
        tab.wait_for(
            f"document.body.dataset.state === 'done' && "
            f"document.querySelectorAll('#messages .msg.assistant').length === {turn + 1}",
            timeout=60,
        )
        spans = tab.eval(TOKENS_JS)[turn]
        messages.append({"role": "user", "content": prompt})
        reference = greedy_answer(playground_url, model, messages)  # (the same conversation, the page's history)
        answer = reference["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": answer})

        classes = {cls for _, cls in spans}
        assert classes <= {"tok draft", "tok target"}, classes
        assert classes == {"tok draft", "tok target"}, f"turn {turn}: both kinds of token should appear: {spans}"
        assert "".join(text for text, _ in spans) == answer
        # The counters: the server's token count, and at the end its acceptance figures for the same request.
        stats = reference["redwood"]
        assert tab.eval("document.getElementById('stat-tokens').textContent") == str(
            reference["usage"]["completion_tokens"]
        )
        assert (
            tab.eval("document.getElementById('stat-acceptance').textContent")
            == f"{100 * stats['acceptance_rate']:.1f}%"
        )
        assert tab.eval("document.getElementById('stat-mal').textContent") == f"{stats['mean_accepted_length']:.2f}"
        share = 100 * sum(cls == "tok draft" for _, cls in spans) / len(spans)
        shown = tab.eval("document.getElementById('stat-draft').textContent")
        assert shown.endswith("%") and abs(float(shown[:-1]) - share) <= 0.5, (shown, share)  # (rounded to 1%)
        assert float(tab.eval("document.getElementById('stat-tps').textContent")) > 0

    png = tab.screenshot()
    (tmp_path / "playground.png").write_bytes(png)
    check_screenshot(png)

    # Every request went to the page's own server; the page threw nothing and logged no error.
    events = tab.browser.drain_events()
    urls = [e["params"]["request"]["url"] for e in events if e["method"] == "Network.requestWillBeSent"]
    assert urls and all(u.startswith(playground_url + "/") for u in urls), urls
    assert not [e for e in events if e["method"] == "Runtime.exceptionThrown"]
    assert not [e for e in events if e["method"] == "Runtime.consoleAPICalled" and e["params"]["type"] == "error"]


def open_playground(tab: Tab, url: str) -> str:
    """Load the page with the API key in, greedy, MAX_TOKENS; → the model it selected."""
    tab.send("Page.navigate", {"url": url + "/"})
    tab.wait_for("document.body && document.body.dataset.models !== undefined", timeout=15)
    tab.type("#api-key", API_KEY)
    tab.eval("document.getElementById('api-key').dispatchEvent(new Event('change'))")
    tab.wait_for("document.body.dataset.models === '1'", timeout=15)
    tab.set_value("#temperature", "0")
    tab.set_value("#max-tokens", str(MAX_TOKENS))
    return tab.eval("document.getElementById('model').value")


def test_playground_stop_keeps_the_partial_answer(chromium, playground_url, tab):
    model = open_playground(tab, playground_url)
    # A slow link (~2 KB/s, each chunk is ~0.5 KB) so the answer is still streaming when Stop is pressed.
    tab.send(
        "Network.emulateNetworkConditions",
        {"offline": False, "latency": 0, "downloadThroughput": 2000, "uploadThroughput": -1},
    )
    prompt = "def add(a, b):"
    tab.type("#prompt", prompt)
    tab.click("#send")
    tab.wait_for("document.querySelectorAll('#messages .msg.assistant .tok').length >= 2", timeout=60)
    assert tab.eval("document.body.dataset.state") == "streaming"
    tab.click("#stop")
    tab.wait_for("document.body.dataset.state === 'stopped'", timeout=15)
    tab.send(
        "Network.emulateNetworkConditions",
        {"offline": False, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1},
    )
    partial = "".join(text for text, _ in tab.eval(TOKENS_JS)[0])
    answer = greedy_answer(playground_url, model, [{"role": "user", "content": prompt}])
    full = answer["choices"][0]["message"]["content"]
    assert partial and full.startswith(partial) and len(partial) < len(full), (partial, full)
    assert tab.eval("document.querySelector('#messages .msg.assistant .note').textContent") == "stopped"
    assert tab.eval("document.getElementById('send').disabled") is False
    assert tab.eval("document.getElementById('stop').disabled") is True


# An SSE body with what a reader must cope with: CRLF, LF and lone-CR line ends, a comment, a field with no
# space after the colon, an event of two data lines, a multi-byte character, a last event with no blank line.
SSE_BODY = (
    'data: {"a": "é€😀"}\r\n\r\n: keep-alive\n\ndata:{"b": 1}\n\nevent: x\ndata: line 1\ndata: line 2\r\rdata: [DONE]'
)
SSE_EVENTS = ['{"a": "é€😀"}', '{"b": 1}', "line 1\nline 2", "[DONE]"]


def test_playground_sse_reader_any_split(chromium, playground_url, tab):
    """The page's SSE reader gives the same events however the bytes are cut into network reads (every
    `piece` bytes: through CRLF pairs and the middle of UTF-8 sequences)."""
    open_playground(tab, playground_url)
    for piece in (1, 2, 3, 7, 1000):
        events = tab.eval(f"""(async () => {{
            const bytes = new TextEncoder().encode({json.dumps(SSE_BODY)});
            const body = new ReadableStream({{ start(c) {{
                for (let i = 0; i < bytes.length; i += {piece}) c.enqueue(bytes.slice(i, i + {piece}));
                c.close(); }} }});
            const seen = [];
            await window.redwoodPlayground.readSSE(new Response(body), (d) => {{ seen.push(d); }});
            return seen; }})()""")
        assert events == SSE_EVENTS, piece


def check_screenshot(png: bytes) -> None:
    """A valid PNG of the viewport's size that is not blank and shows both token colours."""
    from PIL import Image

    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    image = Image.open(io.BytesIO(png))
    image.load()  # decodes every chunk: a truncated or corrupt file raises here
    assert image.size == (WIDTH, HEIGHT)
    colours = {rgb for _, rgb in image.convert("RGB").getcolors(maxcolors=WIDTH * HEIGHT)}
    assert len(colours) > 50, f"only {len(colours)} colours: a blank page?"
    assert DRAFT_RGB in colours and TARGET_RGB in colours
