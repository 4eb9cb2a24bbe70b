"""Every Python block of README.md runs on its own: in a fresh interpreter, from an empty
directory (so no block leans on the repository root or on an earlier block's names). The
OpenAI client block runs against `python -m specjax.serve`, started as the README says."""
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.serve.live_server import free_port

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)
SERVER_ADDRESS = "127.0.0.1:8000"  # what the README's client block talks to

pytestmark = pytest.mark.slow


def test_the_readme_has_python_blocks():
    # A changed fence or pattern must not turn this file into zero tests.
    assert len(BLOCKS) >= 5
    assert sum(SERVER_ADDRESS in block for block in BLOCKS) == 1


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    """`python -m specjax.serve` with its defaults, on a free port."""
    port = free_port()
    log = (tmp_path_factory.mktemp("server") / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "specjax.serve", "--port", str(port)],
                            cwd=tmp_path_factory.mktemp("cwd"), stdout=log, stderr=log)
    url = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(f"http://{url}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the server did not start: "
                                         f"{Path(log.name).read_text()[-2000:]}")
                time.sleep(1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs_on_its_own(index, tmp_path, request):
    code = BLOCKS[index]
    if SERVER_ADDRESS in code:
        code = code.replace(SERVER_ADDRESS, request.getfixturevalue("server_url"))
    script = tmp_path / f"block_{index}.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"README block {index}:\n{code}\n--- stderr:\n{out.stderr[-3000:]}"
    assert out.stdout.strip(), f"README block {index} printed nothing"
