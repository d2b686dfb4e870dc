"""Drive the page in headless Chromium: the check mode end to end, and a screenshot.

Chromium is started with `--remote-debugging-pipe` and spoken to over the DevTools protocol
on file descriptors 3/4 (no websocket library, no open port). WebGPU runs headless with
`--enable-unsafe-webgpu` (SwiftShader's Vulkan when there is no GPU). The page reports its
check JSON by POST to the `PageServer`, which is what `check_page` waits for.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Callable, Optional

from pocketdiff.errors import PocketdiffError

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> Optional[str]:
    """$POCKETDIFF_CHROMIUM, else the first Chromium on PATH (Debian: apt-get install chromium)."""
    env = os.environ.get("POCKETDIFF_CHROMIUM")
    if env:
        return env if Path(env).is_file() else shutil.which(env)
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


class Chromium:
    """One headless Chromium with a DevTools session on a page target."""

    def __init__(self, executable: Optional[str] = None, window: tuple[int, int] = (480, 1000),
                 extra_args: tuple[str, ...] = (), env: Optional[dict] = None, webgpu: bool = True):
        exe = executable or find_chromium()
        if exe is None:
            raise PocketdiffError("no Chromium found (apt-get install chromium, or set POCKETDIFF_CHROMIUM)")
        self.profile = tempfile.mkdtemp(prefix="pocketdiff-chromium-")
        r, self._to_chrome = os.pipe()
        self._from_chrome, w = os.pipe()
        # move the child's ends above 3/4, so the shell's `3<&N` never closes what it just made
        import fcntl

        to_chrome_r, from_chrome_w = fcntl.fcntl(r, fcntl.F_DUPFD, 100), fcntl.fcntl(w, fcntl.F_DUPFD, 100)
        os.close(r)
        os.close(w)
        args = [
            "--headless=new", "--remote-debugging-pipe", f"--user-data-dir={self.profile}",
            *(("--enable-unsafe-webgpu", "--enable-features=Vulkan", "--ignore-gpu-blocklist") if webgpu else ()),
            "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--mute-audio",
            f"--window-size={window[0]},{window[1]}", *extra_args, "about:blank",
        ]
        if os.geteuid() == 0:
            args.insert(0, "--no-sandbox")  # Chromium refuses to start as root with its sandbox
        # fd 3: commands to Chromium, fd 4: its answers
        script = f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w} {to_chrome_r}<&- {from_chrome_w}>&-'
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(["bash", "-c", script, exe, *args], pass_fds=(to_chrome_r, from_chrome_w),
                                     stdout=self.log, stderr=self.log, start_new_session=True, env=env)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._next = 0
        self._answers: dict[int, dict] = {}
        self._cv = threading.Condition()
        self.console: list[str] = []
        self._reader = threading.Thread(target=self._read, name="chromium-cdp", daemon=True)
        self._reader.start()
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.send("Runtime.enable", session=True)
        self.send("Page.enable", session=True)

    def _read(self) -> None:
        buf = b""
        with os.fdopen(self._from_chrome, "rb", buffering=0) as f:
            while True:
                chunk = f.read(1 << 16)
                if not chunk:
                    break
                buf += chunk
                while b"\0" in buf:
                    raw, buf = buf.split(b"\0", 1)
                    msg = json.loads(raw)
                    if "id" in msg:
                        with self._cv:
                            self._answers[msg["id"]] = msg
                            self._cv.notify_all()
                    elif msg.get("method") == "Runtime.consoleAPICalled":
                        p = msg["params"]
                        self.console.append(f"{p['type']}: " + " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"]))
                    elif msg.get("method") == "Runtime.exceptionThrown":
                        d = msg["params"]["exceptionDetails"]
                        self.console.append("exception: " + str(d.get("exception", {}).get("description") or d.get("text")))
        with self._cv:
            self._cv.notify_all()

    def send(self, method: str, params: Optional[dict] = None, session: bool = False, timeout: float = 60.0) -> dict:
        with self._cv:
            self._next += 1
            mid = self._next
        msg = {"id": mid, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._cv:
            while mid not in self._answers:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise PocketdiffError(f"chromium: no answer to {method} ({'exited' if self.proc.poll() is not None else 'timeout'}){self._tail()}")
                self._cv.wait(min(left, 0.5))
            ans = self._answers.pop(mid)
        if "error" in ans:
            raise PocketdiffError(f"chromium: {method}: {ans['error'].get('message')}")
        return ans.get("result", {})

    def _tail(self) -> str:
        self.log.seek(0)
        lines = [ln for ln in self.log.read().decode(errors="replace").splitlines() if ln.strip()]
        return ("; chromium said: " + " | ".join(lines[-5:])) if lines else ""

    def navigate(self, url: str) -> None:
        self.send("Page.navigate", {"url": url}, session=True)

    def evaluate(self, expression: str):
        res = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=True)
        return res.get("result", {}).get("value")

    def screenshot(self, path: str | Path, width: int = 480, scale: float = 2.0) -> Path:
        """A phone-sized capture of the whole page."""
        import base64

        metrics = {"width": width, "height": 800, "deviceScaleFactor": scale, "mobile": True}
        self.send("Emulation.setDeviceMetricsOverride", metrics, session=True)  # lay out at phone width first
        metrics["height"] = int(self.evaluate("Math.ceil(document.body.getBoundingClientRect().bottom) + 16") or 1000)
        self.send("Emulation.setDeviceMetricsOverride", metrics, session=True)
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session=True)["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send("Browser.close", timeout=10)
        except PocketdiffError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_chrome)
        shutil.rmtree(self.profile, ignore_errors=True)
        self.log.close()

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_url(base: str, prompt: Optional[str], seed: Optional[int], report: str = "/report/check", **extra) -> str:
    q = {"check": "1", "report": report, **{k: str(v) for k, v in extra.items()}}
    if prompt is not None:
        q["prompt"] = prompt
    if seed is not None:
        q["seed"] = str(seed)
    return base + "?" + urllib.parse.urlencode(q, quote_via=urllib.parse.quote)


def check_page(bundle: str | Path, prompt: Optional[str] = None, seed: Optional[int] = None, timeout_s: float = 300.0,
               screenshot: Optional[str | Path] = None, executable: Optional[str] = None,
               chromium_args: tuple[str, ...] = (), env: Optional[dict] = None, webgpu: bool = True,
               echo: Optional[Callable[[str], None]] = None, verify_files: bool = True, **extra) -> dict:
    """Serve BUNDLE (its own server takes the page's report: POST /report/check), open its page in check mode in
    headless Chromium, return the POSTed JSON (with `chromium_console`, and `screenshot` when one was taken). ECHO,
    when given, is called with each console line as it arrives (a long check can be followed). `verify_files=False`:
    the server sends the manifest's files even when they differ from it (a test of the page's own sha256 check)."""
    import queue

    from .serve import PageServer

    t0 = time.perf_counter()
    with PageServer(bundle, host="127.0.0.1", port=0, reports=True, verify_files=verify_files) as srv, Chromium(executable, extra_args=chromium_args, env=env, webgpu=webgpu) as chrome:
        chrome.navigate(check_url(srv.url, prompt, seed, **extra))
        deadline = time.monotonic() + timeout_s
        result, echoed = None, 0
        while result is None:
            if echo is not None:
                lines = chrome.console[echoed:]
                echoed += len(lines)
                for line in lines:
                    echo(line)
            try:
                _, result = srv.reports.get(timeout=1.0)
            except queue.Empty:
                if chrome.proc.poll() is not None:
                    raise PocketdiffError(f"chromium exited before the page reported{chrome._tail()}") from None
                if time.monotonic() > deadline:
                    raise PocketdiffError(f"the page did not report within {timeout_s:.0f} s; console: {' | '.join(chrome.console[-8:])}")
        result["chromium_console"] = chrome.console[-50:]
        result["check_wall_s"] = round(time.perf_counter() - t0, 2)
        if screenshot:
            result["screenshot"] = str(chrome.screenshot(screenshot))
    return result
