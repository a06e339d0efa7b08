"""Open a report in headless Chromium and report what a user's browser would see.

Speaks the DevTools protocol over `--remote-debugging-pipe` (JSON messages separated by NUL
bytes on file descriptors 3 and 4), so it needs no websocket library and no open port. It
records console messages, uncaught exceptions, log entries and every network request, can
evaluate JavaScript in the page, and takes screenshots. Used by the tests and to make the
screenshot in docs/.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from assay.core.errors import AssayError

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
    "--disable-extensions", "--remote-debugging-pipe",
)  # fmt: skip


def find_chromium() -> str | None:
    """The path of a Chromium/Chrome binary on PATH (or $CHROMIUM), or None."""
    env = os.environ.get("CHROMIUM")
    if env and shutil.which(env):
        return shutil.which(env)
    return next((shutil.which(c) for c in CANDIDATES if shutil.which(c)), None)


class Browser:
    """A headless Chromium driven over the DevTools pipe; use as a context manager."""

    def __init__(
        self, binary: str | None = None, width: int = 1280, height: int = 2000, timeout: float = 60.0
    ):
        binary = binary or find_chromium()
        if binary is None:
            raise AssayError("no chromium found; install it with `make browser` (apt-get install chromium)")
        self.timeout, self.size = timeout, (width, height)
        self.profile = tempfile.mkdtemp(prefix="assay-chromium-")
        cmd_r, cmd_w = os.pipe()  # we write commands; chromium reads fd 3
        out_r, out_w = os.pipe()  # chromium writes fd 4; we read
        child_fds = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (cmd_r, out_w)]
        os.close(cmd_r)
        os.close(out_w)

        def place_fds() -> None:  # in the child, before exec: the pipe ends become fds 3 and 4
            os.dup2(child_fds[0], 3)
            os.dup2(child_fds[1], 4)

        args = [
            binary,
            *FLAGS,
            f"--user-data-dir={self.profile}",
            f"--window-size={width},{height}",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=place_fds, close_fds=False
        )
        for fd in child_fds:
            os.close(fd)
        self._w, self._r = cmd_w, out_r
        self._buf = b""
        self._next = 0
        self.events: list[dict[str, Any]] = []
        self.session = ""

    # --- protocol -----------------------------------------------------------------------------
    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            ready, _, _ = select.select([self._r], [], [], max(deadline - time.monotonic(), 0.0))
            if not ready:
                raise AssayError("chromium did not answer in time")
            chunk = os.read(self._r, 1 << 16)
            if not chunk:
                raise AssayError("chromium exited unexpectedly")
            self._buf += chunk
        message, self._buf = self._buf.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, params: dict[str, Any] | None = None, session: bool = True) -> dict[str, Any]:
        """Send one command and return its result; events arriving meanwhile are kept."""
        self._next += 1
        msg: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise AssayError(f"chromium: {method} failed: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, event: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        while True:
            for e in self.events:
                if e.get("method") == event:
                    return e
            self.events.append(self._read(deadline))

    # --- page ---------------------------------------------------------------------------------
    def __enter__(self) -> Browser:
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)
        attached = self.send(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}, False
        )
        self.session = attached["sessionId"]
        for domain in ("Runtime", "Log", "Page", "Network"):
            self.send(f"{domain}.enable")
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": self.size[0], "height": self.size[1], "deviceScaleFactor": 1, "mobile": False},
        )
        return self

    def open(self, path: Path | str) -> None:
        """Load a local file and wait for its load event."""
        self.events.clear()
        self.send("Page.navigate", {"url": Path(path).resolve().as_uri()})
        self.wait_for("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-serialisable values only)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise AssayError(f"page script failed: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def screenshot(self, path: Path | str) -> Path:
        """A PNG of the viewport (width × height given at start)."""
        data = self.send("Page.captureScreenshot", {"format": "png"})["data"]
        Path(path).write_bytes(base64.b64decode(data))
        return Path(path)

    def problems(self) -> list[str]:
        """Console errors/warnings, uncaught exceptions and error log entries since the last open()."""
        out = []
        for e in self.events:
            method, p = e.get("method"), e.get("params", {})
            if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "warning", "assert"):
                out.append(
                    f"console.{p['type']}: "
                    + " ".join(str(a.get("value", a.get("description"))) for a in p["args"])
                )
            elif method == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                out.append(f"exception: {d.get('text')} {d.get('exception', {}).get('description', '')}")
            elif method == "Log.entryAdded" and p.get("entry", {}).get("level") in ("error", "warning"):
                out.append(f"log.{p['entry']['level']}: {p['entry'].get('text')}")
        return out

    def requests(self) -> list[str]:
        """URLs of every request the page made since the last open() (the page itself included)."""
        return [
            e["params"]["request"]["url"]
            for e in self.events
            if e.get("method") == "Network.requestWillBeSent"
        ]

    def __exit__(self, *exc: object) -> None:
        try:
            self.send("Browser.close", session=False)
        except (AssayError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._w)
        os.close(self._r)
        shutil.rmtree(self.profile, ignore_errors=True)
