"""llama.cpp beside specjax on the same weights (`--llama-cpp PYTHON` of `bench decode` and
`bench spec`): the engine's own float32 weights written as a GGUF, and a child process
(`llamacpp_side.py`, run by an interpreter with llama-cpp-python, which specjax never installs)
that loads it and generates greedily, plainly or with llama.cpp's prompt-lookup drafting."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

from specjax.llm import LLM
from specjax.models.gguf_checkpoint import GGUFFile, gguf_metadata, gguf_tensors, write_gguf


@contextlib.contextmanager
def llama_cpp_child(python: str | None, gguf: Path | None, n_ctx: int, prompt_lookup: int = 0):
    """The llama.cpp side, the model loaded with as many threads as this machine has cores
    and, with `prompt_lookup` > 0, llama-cpp-python's prompt-lookup drafter proposing that many
    tokens (None: no side). Yields `generate(prompt, max_tokens, stop=()) -> (seconds,
    tokens)` (generation ends after a token in `stop`) and llama-cpp-python's version."""
    if python is None or gguf is None:
        yield None
        return
    side = Path(__file__).with_name("llamacpp_side.py")
    child = subprocess.Popen([python, str(side)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)

    def ask(**command):
        child.stdin.write(json.dumps(command) + "\n")
        child.stdin.flush()
        line = child.stdout.readline()
        if not line:
            raise SystemExit(f"--llama-cpp: {python} {side} stopped (is llama-cpp-python "
                             "installed there?)")
        return json.loads(line)

    def generate(prompt: list[int], max_tokens: int, stop=()) -> tuple[float, list[int]]:
        answer = ask(prompt=prompt, max_tokens=max_tokens, stop=list(stop))
        return answer["seconds"], answer["tokens"]

    try:
        version = ask(load=str(gguf), threads=os.cpu_count(), n_ctx=n_ctx,
                      prompt_lookup=prompt_lookup)["version"]
        yield generate, version
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def float32_gguf(llm: LLM, source: Path, folder: str) -> Path:
    """The engine's own (dequantized) weights as a float32 GGUF, with `source`'s tokenizer."""
    meta = {k: v for k, v in GGUFFile(source).meta.items() if k.startswith("tokenizer.")}
    return write_gguf(Path(folder) / "float32.gguf", {**gguf_metadata(llm.model.config), **meta},
                      gguf_tensors(llm.model))
