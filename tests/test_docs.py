"""Every ```python and ```bash block of README.md and docs/*.md runs on its own, from an empty
directory, so no block leans on the repository root or on an earlier block's names or files
(docs/testing.md, "The documentation's commands", says the same for readers).

- python: a fresh interpreter (this one), which must exit 0 and print something.
- bash: run by bash, with `.venv/bin/` (and `python` on PATH) the test's own interpreter's bin
  folder. Install commands (`python3 -m venv .venv`, `pip install ...`) are checked, not run:
  the extras they name exist in pyproject.toml, the packages they name are installed, and the
  README's test command is the line .ci/run reads and runs. A server command
  (`python -m specjax.serve ...`) runs in the background on a free port until /health answers,
  shared by the blocks that talk to it (`:8000`, rewritten to its port): those after it on its
  page, or, with no server before them on their page, the quick start's
  `python -m specjax.serve`. It stops after the last of them. Everything else must exit 0; a
  client's output must be a non-error answer.

Only python, bash and text (formulas, output: never run) fences may open a block, so a changed
fence cannot drop a block silently. The guards (fence languages, block counts, README length,
links, .ci/run's command) are cheap and run in the default suite; the blocks are slow."""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

from tests.serve.live_server import free_port

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300
RUN = {"python", "bash"}
NEVER_RUN = {"text"}
BIN = Path(sys.executable).parent            # what `.venv/bin/` and `python` mean in a block

DEFAULT_SERVER = "python -m specjax.serve"   # the quick start's; talked to by pages with none
SERVER = re.compile(  # env assignments, then `python -m specjax.serve` (not .loadtest/.soak)
    r"^(?:[A-Za-z_][A-Za-z0-9_]*=(?:\"[^\"]*\"|'[^']*'|\S+)\s+)*"
    r"(?:\S*/)?python3? -m specjax\.serve(?:\s|$)")
INSTALL = re.compile(r"^(?:python3 -m venv |(?:\S*/)?pip install )")
CI_TAIL = ".venv/bin/python -m pytest -q"    # the README's test command ends with the suite
ADDRESS = re.compile(r"\b(localhost|127\.0\.0\.1):8000\b")
HEALTH_TIMEOUT_S = 900
BLOCK_TIMEOUT_S = 900


@dataclasses.dataclass
class Block:
    page: str          # relative to the repository root
    line: int          # of the opening fence
    lang: str
    code: str
    servers: tuple[str, ...] = ()   # server command lines this block starts (bash)
    script: str = ""                # what bash runs: the block without install/server lines
    installs: tuple[str, ...] = ()  # install command lines, checked instead of run
    server_key: str | None = None   # the server group it starts or talks to
    client: bool = False            # talks to a server (`:8000`)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def fences(text: str) -> list[tuple[int, str, str]]:
    """(line of the opening fence, info string, body) of every fenced block; a line starting
    with ``` is always a fence, so inline spans must not start a line."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, info, body = i + 1, lines[i][3:].strip(), []
            i += 1
            while i < len(lines) and lines[i].rstrip() != "```":
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise AssertionError(f"unclosed fence at line {start}")
            out.append((start, info, "\n".join(body) + "\n"))
        i += 1
    return out


def normalise(command: str) -> str:
    command = re.sub(r"(^|\s)\.venv/bin/", r"\1", command.strip().rstrip("&").strip())
    return " ".join(command.split())


def split_bash(block: Block) -> None:
    """Sort a bash block's command lines into servers, installs and the script bash runs."""
    servers, installs, script = [], [], []
    for line in re.sub(r"\\\n", " ", block.code).splitlines():
        command = line.strip()
        if SERVER.match(command):
            servers.append(normalise(command))
        elif INSTALL.match(command):
            installs.append(command)
            servers += [normalise(part) for part in command.split("&&")
                        if SERVER.match(part.strip())]
        else:
            script.append(line)
    block.servers, block.installs = tuple(servers), tuple(installs)
    commands = [line for line in script if line.strip() and not line.strip().startswith("#")]
    block.script = "\n".join(script).strip() if commands else ""


def collect() -> list[Block]:
    blocks = []
    for page in PAGES:
        current = None   # the server group this page's blocks talk to so far
        for line, info, body in fences(page.read_text()):
            lang = info.split()[0] if info else ""
            if lang not in RUN:
                continue
            block = Block(str(page.relative_to(ROOT)), line, lang, body)
            if lang == "bash":
                split_bash(block)
            else:
                block.script = body
            if block.servers:
                current = block.server_key = "\n".join(block.servers)
            block.client = bool(ADDRESS.search(block.script))
            if block.client and block.server_key is None:
                block.server_key = current or DEFAULT_SERVER
            blocks.append(block)
    return blocks


BLOCKS = collect()
LAST_USE = {b.server_key: i for i, b in enumerate(BLOCKS) if b.server_key}


# --- guards: cheap, in the default run -----------------------------------------------------

def test_only_known_fences_and_enough_blocks():
    for page in PAGES:
        for line, info, _ in fences(page.read_text()):
            lang = info.split()[0] if info else ""
            assert lang in RUN | NEVER_RUN, (
                f"{page.relative_to(ROOT)}:{line}: fence {info!r}: use python or bash (run by "
                f"tests/test_docs.py) or text (never run)")
    langs = [b.lang for b in BLOCKS]
    assert langs.count("python") >= 10 and langs.count("bash") >= 6, langs
    assert {b.page for b in BLOCKS} >= {"README.md", "docs/serving.md",
                                        "docs/several-devices.md"}
    assert sum(b.client for b in BLOCKS) >= 4     # curl and OpenAI blocks found their server
    assert sum(bool(b.servers) for b in BLOCKS) >= 4
    # A server line the pattern missed would run in the foreground until the block times out.
    missed = [f"{b.page}:{b.line}: {line.strip()}" for b in BLOCKS if b.lang == "bash"
              for line in b.script.splitlines() if re.search(r"-m specjax\.serve(\s|$)", line)]
    assert not missed, f"server commands not recognised as servers: {missed}"


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def readme_test_command() -> str:
    [command] = [c for b in BLOCKS if b.page == "README.md" for c in b.installs
                 if c.endswith(CI_TAIL)]
    return command


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    [read] = [line for line in ci.splitlines() if line.startswith("readme_test_command=")]
    assert 'eval "$readme_test_command"' in ci
    out = subprocess.run(["bash", "-c", f'{read} && printf %s "$readme_test_command"'],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout == readme_test_command()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {slug(h.replace("`", "")) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_links_between_pages_resolve():
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.relative_to(ROOT)}: broken link {target}"
            if anchor and dest.suffix == ".md":
                assert anchor in anchors(dest), f"{page.relative_to(ROOT)}: no anchor {target}"
    readme, index = (ROOT / "README.md").read_text(), (ROOT / "docs" / "README.md").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        if page.name != "README.md":   # every page is listed by both indexes
            assert f"](docs/{page.name})" in readme and f"]({page.name})" in index, page.name


# --- the blocks: slow -----------------------------------------------------------------------

def check_install(command: str) -> None:
    """An install line is not re-run; what it names must exist."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for part in (p.strip() for p in command.split("&&")):
        if part == "python3 -m venv .venv" or SERVER.match(part):
            continue
        if part.endswith(CI_TAIL):
            assert part == CI_TAIL
            assert command == readme_test_command(), "only the README's test command runs pytest"
            continue
        words = shlex.split(part)
        assert re.fullmatch(r"(\.venv/bin/)?pip", words[0]) and words[1] == "install", part
        for word in (w for w in words[2:] if not w.startswith("-")):
            match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", word)
            if match:
                for extra in filter(None, (match.group(1) or "").split(",")):
                    assert extra in extras, f"{command}: no extra {extra!r} in pyproject.toml"
            else:
                importlib.metadata.distribution(word)   # raises if the package is missing


def block_env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["SPECJAX_COMPILATION_CACHE"] = str(cache)   # one cache for the docs' compiled steps
    env["PYTHONUNBUFFERED"] = "1"
    return env


def empty_dir(cwd: Path, venv: bool) -> Path:
    """An empty working directory; for bash, `.venv/bin` in it is this interpreter's."""
    cwd.mkdir()
    if venv:
        (cwd / ".venv").mkdir()
        (cwd / ".venv" / "bin").symlink_to(BIN, target_is_directory=True)
    return cwd


class Servers:
    """Server groups by key, started on first use, each on a free port."""

    def __init__(self, env: dict[str, str], tmp_path_factory):
        self.env, self.tmp, self.running = env, tmp_path_factory, {}

    def get(self, key: str) -> int:
        if key not in self.running:
            self.running[key] = self.start(key)
        return self.running[key][0]

    def start(self, key: str):
        port, coordinator_port = free_port(), free_port()
        cwd, procs = empty_dir(self.tmp.mktemp("server") / "cwd", venv=True), []
        for command in key.split("\n"):
            command = re.sub(r"(--coordinator-address\s+\S+?):\d+", rf"\g<1>:{coordinator_port}",
                             command)
            command = (re.sub(r"--port\s+\d+", f"--port {port}", command) if "--port" in command
                       else f"{command} --port {port}")
            log = (cwd.parent / f"server{len(procs)}.log").open("w")
            procs.append((subprocess.Popen(["bash", "-c", command], cwd=cwd, env=self.env,
                                           stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True), log))
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                return port, procs
            except OSError:
                ended = [p for p, _ in procs if p.poll() is not None]
                if ended or time.monotonic() > deadline:
                    logs = "\n".join(Path(log.name).read_text()[-3000:] for _, log in procs)
                    self.stop_procs(procs)
                    raise AssertionError(f"{key!r} did not answer /health:\n{logs}")
                time.sleep(1)

    @staticmethod
    def stop_procs(procs) -> None:
        for proc, _ in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        for proc, log in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()

    def stop(self, key: str) -> None:
        if key in self.running:
            self.stop_procs(self.running.pop(key)[1])

    def stop_all(self) -> None:
        for key in list(self.running):
            self.stop(key)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return block_env(tmp_path_factory.mktemp("jax-cache"))


@pytest.fixture(scope="module")
def servers(env, tmp_path_factory):
    pool = Servers(env, tmp_path_factory)
    yield pool
    pool.stop_all()


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[b.id for b in BLOCKS])
def test_block_runs_on_its_own(index, env, servers, tmp_path):
    block = BLOCKS[index]
    try:
        for command in block.installs:
            check_install(command)
        code = block.script
        if block.server_key:
            port = servers.get(block.server_key)
            code = ADDRESS.sub(lambda m: f"{m.group(1)}:{port}", code)
        if not code:
            return
        cwd = empty_dir(tmp_path / "cwd", venv=block.lang == "bash")
        script = tmp_path / f"block.{'py' if block.lang == 'python' else 'sh'}"
        script.write_text(code)
        argv = ([sys.executable, str(script)] if block.lang == "python"
                else ["bash", "-e", "-o", "pipefail", str(script)])
        out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                             timeout=BLOCK_TIMEOUT_S)
        report = (f"{block.id}:\n{code}\n--- stdout:\n{out.stdout[-2000:]}\n"
                  f"--- stderr:\n{out.stderr[-3000:]}")
        assert out.returncode == 0, report
        if block.lang == "python" or block.client:
            assert out.stdout.strip(), f"printed nothing: {report}"
        if block.client and block.lang == "bash":
            try:
                answer = json.loads(out.stdout)
            except json.JSONDecodeError:
                answer = None
            assert not (isinstance(answer, dict) and "error" in answer), report
    finally:
        if block.server_key and LAST_USE[block.server_key] == index:
            servers.stop(block.server_key)
