"""A live ``stagerun serve`` child process, for tests that drive it over HTTP."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai


class LiveServer:
    """A ``stagerun serve --port 0`` child process and the URL it printed."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self._log_file = log.open("wb")
        cmd = [sys.executable, "-m", "stagerun", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self._log_file, env={**os.environ, **(env or {})}
        )
        self.url = ""
        self.line = ""

    def wait_ready(self, timeout: float = 120.0) -> str:
        if self.line:
            return self.line
        assert self.proc.stdout is not None
        fd, buf, deadline = self.proc.stdout.fileno(), b"", time.monotonic() + timeout
        while b"\n" not in buf:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"no URL line within {timeout}s; log: {self.log.read_text()}"
            data = os.read(fd, 4096)
            assert data, f"server exited ({self.proc.wait()}); log: {self.log.read_text()}"
            buf += data
        self.line = buf.decode().splitlines()[0]
        self.url = self.line.split("listening on ", 1)[1].split(" ", 1)[0]
        return self.line

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=10)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def stop(self, sig: int = signal.SIGINT) -> tuple[int, bytes]:
        """Signal the server, wait for it, and return (exit code, the rest of its stdout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        assert self.proc.stdout is not None
        rest = self.proc.stdout.read()
        self.proc.stdout.close()
        self._log_file.close()
        return code, rest
