"""Reading the docs' code blocks, and running a shell block the way a reader would.

A shell block is a small session: commands run one after another in one folder, servers
(``stagerun stage``, ``stagerun serve``, a command ending in ``&``) are left running in the
background once they say they are ready, and everything started is stopped at the end. The
few substitutions that make a block quick and self-contained are made here, in one place
(`Session.substitute`, `Session.stagerun_argv`), and test_docs.py's docstring lists them.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable

import attrs

from stagerun._cli._options import build_parser

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted(ROOT.glob("plugins/*/README.md")),
    *sorted(ROOT.glob("examples/*/README.md")),
]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
HEREDOC = re.compile(r"<<\s*'?(\w+)'?")
SHELLS = ("sh", "console")
# stagerun subcommands that take --model (bench's own subcommands each do)
TAKES_MODEL = {"generate", "serve", "stage", "bench"}
READY_TIMEOUT = 180.0
# a port the docs name: on a loopback or any-address host, or given to --port
PORT = re.compile(r"(?:(?<=127\.0\.0\.1:)|(?<=0\.0\.0\.0:)|(?<=localhost:)|(?<=--port ))(\d{4})\b")


@attrs.frozen
class Snippet:
    document: str
    line: int  # where the code starts (1-based)
    language: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.document}:{self.line}"


@attrs.frozen
class Command:
    """One shell command of a block: continuations joined, a heredoc's body kept apart."""

    document: str
    line: int
    head: str  # the command line itself
    body: str = ""  # a heredoc's lines and terminator, if the command has one

    @property
    def id(self) -> str:
        return f"{self.document}:{self.line}"

    @property
    def script(self) -> str:
        return f"{self.head}\n{self.body}" if self.body else self.head


def snippets(language: str) -> list[Snippet]:
    found = []
    for path in DOCUMENTS:
        text = path.read_text()
        for match in FENCE.finditer(text):
            if match.group(1) == language:
                line = text.count("\n", 0, match.start(2)) + 1
                document = str(path.relative_to(ROOT))
                found.append(Snippet(document, line, language, match.group(2)))
    return found


def _closed(line: str) -> bool:
    """Whether every quote opened on ``line`` is closed (a quoted argument may span lines)."""
    try:
        shlex.split(line, comments=True)
    except ValueError:
        return False
    return True


def shell_commands(snippet: Snippet) -> list[Command]:
    """The block's commands in order. In a ``console`` block only ``$ `` lines are commands
    (the rest is output)."""
    commands: list[Command] = []
    lines = snippet.code.splitlines()
    i = 0
    while i < len(lines):
        line, start = lines[i], snippet.line + i
        i += 1
        if snippet.language == "console":
            if not line.startswith("$ "):
                continue
            line = line.removeprefix("$ ")
        while i < len(lines) and (line.endswith("\\") or not _closed(line)):
            line = (
                line[:-1].rstrip() + " " + lines[i].strip()
                if line.endswith("\\")
                else line + "\n" + lines[i]
            )
            i += 1
        body = ""
        heredoc = HEREDOC.search(line)
        if heredoc:  # the body, up to and including the terminator
            end = i
            while end < len(lines) and lines[end].strip() != heredoc.group(1):
                end += 1
            body = "\n".join(lines[i : end + 1]) + "\n"
            i = end + 1
        line = line.strip()
        if line and not line.startswith("#"):
            commands.append(Command(snippet.document, start, line, body))
    return commands


def split_words(head: str) -> tuple[dict[str, str], list[str]]:
    """A command line's ``VAR=value`` prefixes and its words (a trailing ``&`` dropped)."""
    words = shlex.split(head, comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if words and words[-1] == "&":
        words.pop()
    return env, words


def stagerun_argv(head: str) -> list[str] | None:
    """The arguments of a ``stagerun`` command line, or None if it runs something else."""
    words = split_words(head)[1]
    if not words or words[0].rsplit("/", 1)[-1] != "stagerun":
        return None
    return words[1:]


def quick_bench(argv: list[str]) -> list[str]:
    """A `stagerun bench` command with one round of 16 tokens (and a kill after 8 of them;
    a chat of two turns; one request per client; `QUICK_BY_BENCH`; of a swept list, the
    first two stage counts (``--stages 1,2,3``: no test sweeps those) or the first point of
    the others (``--clients 1,8,16``, ``--hop-delays 0,5,10,20``: tests/test_bench_serve.py
    and test_report.py sweep them), where it takes those options: every option as written is
    still used, on a run that takes seconds instead of minutes."""
    taken = vars(build_parser().parse_args(argv))
    argv = list(argv)
    quick: tuple[tuple[str, str], ...] = (
        ("--rounds", "1"),
        ("--tokens", "16"),
        ("--kill-at", "8"),
        ("--turns", "2"),  # bench chat: two turns over a short system prompt
        ("--system-tokens", "100"),
        ("--stagger-ms", "100"),
        ("--requests-per-client", "1"),  # bench serve: each client's curve point once
    )
    quick += QUICK_BY_BENCH.get(argv[1], ())
    for option, value in quick:
        if option.removeprefix("--").replace("-", "_") not in taken:
            continue
        if option in argv:
            argv[argv.index(option) + 1] = value
        else:
            argv += [option, value]
    for option, keep in SWEPT.items():
        if option in argv and "," in argv[argv.index(option) + 1]:
            at = argv.index(option) + 1
            argv[at] = ",".join(argv[at].split(",")[:keep])
    return argv


# options of one bench only (another bench's option of the same name means something else)
QUICK_BY_BENCH: dict[str, tuple[tuple[str, str], ...]] = {
    "load": (("--requests", "32"),),  # 200 by default
    "prefill": (("--prompt-tokens", "400"),),  # 1500 by default: still several chunks of 128
}
# lists a bench runs one config per item -> how many of their items a quick run keeps
SWEPT = {"--hop-delays": 1, "--clients": 1, "--stages": 2}
# the longest emulated link delay a docs block runs with (the docs show 10-20 ms; a hop's
# delay is measured at full size by test_pipeline.py, and test_ui_timeline.py runs 10 ms links)
QUICK_HOP_DELAY_MS = 2.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class CommandFailed(AssertionError):
    pass


@attrs.define
class Session:
    """Runs a shell block's commands in ``folder``, as a reader would, with the substitutions.

    * Each 4-digit port in the block is replaced, consistently, by a free one; port 8000 (and
      ``$U``) is the shared served model when the block starts no server of its own.
    * ``/tmp/`` and ``/var/log/`` paths become paths in the block's folder.
    * A benchmark runs one round of 16 tokens (`quick_bench`).
    * An emulated link's delay (``--hop-delay-ms``) is at most `QUICK_HOP_DELAY_MS`: the
      link is still emulated (every frame goes through the delaying path), the run waits less.
    * The model: ``--model`` (or its absence) on a stagerun command, and ``model = "smollm2"``
      in a heredoc, become the tiny test model (its Q4_0 twin for torch-int4), unless the block
      is `real_model`.
    """

    folder: pathlib.Path
    model: pathlib.Path
    q4_model: pathlib.Path
    served: str | None = None  # the shared `stagerun serve` URL, for blocks without their own
    real_model: bool = False
    ports: dict[str, str] = attrs.Factory(dict)
    background: list[tuple[Command, subprocess.Popen[bytes], pathlib.Path]] = attrs.Factory(list)

    def __attrs_post_init__(self) -> None:
        # Relative paths the docs use: the virtual environment, the built llama.cpp, and the
        # examples and scripts they run.
        for name, target in (
            (".venv", pathlib.Path(sys.prefix)),
            (".cache", ROOT / ".cache"),
            ("examples", ROOT / "examples"),
        ):
            link = self.folder / name
            if not link.exists():
                link.symlink_to(target, target_is_directory=True)

    @property
    def env(self) -> dict[str, str]:
        bin_dir = str(pathlib.Path(sys.executable).parent)
        port = self.ports.get("8000")
        url = f"http://127.0.0.1:{port}" if port else (self.served or "")
        return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "U": url}

    def plan_ports(self, commands: Iterable[Command], own_server: bool) -> None:
        for command in commands:
            for port in PORT.findall(command.script):
                if port in self.ports:
                    continue
                if port == "8000" and not own_server and self.served:
                    self.ports[port] = self.served.rsplit(":", 1)[1]
                else:
                    self.ports[port] = str(free_port())

    def substitute(self, text: str) -> str:
        text = PORT.sub(lambda m: m.group(0).replace(m.group(1), self.ports[m.group(1)]), text)
        text = re.sub(r"(?<![\w.])/(?:tmp|var/log)/", f"{self.folder}/", text)
        if not self.real_model:
            text = text.replace('model = "smollm2"', f'model = "{self.model}"')
        return text

    def stagerun_command(self, head: str) -> tuple[dict[str, str], list[str]]:
        env, words = split_words(self.substitute(head))
        argv = words[1:]
        if argv[:1] == ["bench"]:
            argv = quick_bench(argv)
        if "--hop-delay-ms" in argv:
            at = argv.index("--hop-delay-ms") + 1
            argv[at] = str(min(float(argv[at]), QUICK_HOP_DELAY_MS)).removesuffix(".0")
        if argv[:1] == ["serve"] and "--port" not in argv:  # its default port is 8000
            argv += ["--port", self.ports.setdefault("8000", str(free_port()))]
        if not self.real_model and argv and argv[0] in TAKES_MODEL:
            model = str(self.q4_model if "torch-int4" in head else self.model)
            if "--model" in argv:
                argv[argv.index("--model") + 1] = model
            elif "--topology" not in argv:
                argv += ["--model", model]
        return env, [sys.executable, "-m", "stagerun", *argv]

    def run(self, command: Command) -> str:
        """Run one command; return what it printed on stdout (nothing for a background one)."""
        argv = stagerun_argv(command.head)
        if argv is not None and argv[:1] in (["stage"], ["serve"]):
            env, cmd = self.stagerun_command(command.head)
            ready = "READY " if argv[0] == "stage" else "listening on "
            self._start(command, cmd, {**self.env, **env}, ready=ready)
            return ""
        if argv is not None:
            env, cmd = self.stagerun_command(command.head)
        else:
            env, cmd = {}, ["bash", "-c", self.substitute(command.script)]
        if command.head.endswith("&"):
            script = self.substitute(command.script).rstrip().removesuffix("&")
            self._start(command, ["bash", "-c", f"exec {script}"], self.env, ready=None)
            return ""
        done = subprocess.run(
            cmd, cwd=self.folder, env={**self.env, **env}, capture_output=True, text=True,
            stdin=subprocess.DEVNULL,
            timeout=600,
        )  # fmt: skip
        if done.returncode != 0:
            raise CommandFailed(
                f"{command.id}: `{command.head}` exited {done.returncode}\n"
                f"--- stdout ---\n{done.stdout[-2000:]}\n--- stderr ---\n{done.stderr[-3000:]}"
            )
        return done.stdout

    def _start(
        self, command: Command, cmd: list[str], env: dict[str, str], ready: str | None
    ) -> None:
        log = self.folder / f"background-{len(self.background)}.log"
        with log.open("wb") as err:
            proc = subprocess.Popen(
                cmd, cwd=self.folder, env=env, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,  # noqa: E501
                start_new_session=True,
            )  # fmt: skip
        self.background.append((command, proc, log))
        watchdog = threading.Timer(READY_TIMEOUT, proc.kill)
        watchdog.start()
        try:
            if ready is None:
                self._wait_for_port(command, proc)
                return
            assert proc.stdout is not None
            seen = []
            while line := proc.stdout.readline().decode():
                seen.append(line)
                if ready in line:
                    return
            raise CommandFailed(
                f"{command.id}: `{command.head}` never said {ready!r} "
                f"(exit {proc.wait()}): {''.join(seen)[-1000:]}\n{log.read_text()[-3000:]}"
            )
        finally:
            watchdog.cancel()

    def _wait_for_port(self, command: Command, proc: subprocess.Popen[bytes]) -> None:
        match = re.search(r"--port (\d+)", self.substitute(command.head))
        assert match, f"{command.id}: a background command without --port to wait for"
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", int(match.group(1))), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        raise CommandFailed(f"{command.id}: `{command.head}` never listened (exit {proc.poll()})")

    def close(self) -> None:
        for _, proc, _ in reversed(self.background):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
