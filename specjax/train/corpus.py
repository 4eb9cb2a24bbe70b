"""The training corpus: the running Python's standard library source.

Python ships with every machine that runs specjax, so the corpus needs no download. A manifest (relative
path, sha256, split) pins exactly which files were used, so a run is reproducible and a different Python
version is detected instead of silently training on other text.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path

# Folder names never descended into: test suites are huge, repetitive and full of odd fixtures, and
# site-packages is whatever the user installed, not the standard library.
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
# Build-time generated files: their content depends on the machine that compiled Python.
EXCLUDED_PREFIXES = ("_sysconfigdata_", "config-")
# gencodec.py output (encodings/cp*.py...): 120 near-identical lookup tables that would teach the model
# Unicode character names rather than Python.
GENERATED_CODEC_MARKER = "Python Character Mapping Codec"
VAL_FRACTION = 0.05
# The only sizeable English prose in the stdlib (the help() topics, ~750 KB); the path hash would put it
# in validation, where it would dominate the held-out loss instead of teaching the model English.
ALWAYS_TRAIN = frozenset({"pydoc_data/topics.py"})
MANIFEST_NAME = "corpus_manifest.json"


@dataclass(frozen=True)
class CorpusFile:
    path: str  # POSIX path relative to the stdlib root
    sha256: str
    split: str  # "train" or "val"
    size: int


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str, val_fraction: float = VAL_FRACTION) -> str:
    """Held-out split by file, from a hash of the path alone, so it is stable across machines."""
    if relpath in ALWAYS_TRAIN:
        return "train"
    bucket = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:8], "big") / 2**64
    return "val" if bucket < val_fraction else "train"


def _excluded(rel: Path) -> bool:
    if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
        return True
    return any(part.startswith(EXCLUDED_PREFIXES) for part in rel.parts)


def collect_files(root: Path | None = None) -> list[str]:
    """Sorted relative paths of the corpus's `.py` files under `root` (default: this Python's stdlib)."""
    root = Path(root) if root is not None else stdlib_root()
    paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _excluded(rel) or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if GENERATED_CODEC_MARKER in text[:2000]:
            continue
        paths.append(rel.as_posix())
    return sorted(paths)


def build_manifest(root: Path | None = None, val_fraction: float = VAL_FRACTION) -> dict:
    root = Path(root) if root is not None else stdlib_root()
    files = []
    for rel in collect_files(root):
        data = (root / rel).read_bytes()
        files.append(CorpusFile(rel, hashlib.sha256(data).hexdigest(), split_of(rel, val_fraction), len(data)))
    return {
        "source": "python-stdlib",
        "python_version": platform.python_version(),
        "val_fraction": val_fraction,
        "files": [f.__dict__ for f in files],
    }


def write_manifest(manifest: dict, path: Path) -> None:
    Path(path).write_text(json.dumps(manifest, indent=1) + "\n")


def load_manifest(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def manifest_files(manifest: dict, split: str | None = None) -> list[CorpusFile]:
    files = [CorpusFile(**f) for f in manifest["files"]]
    return [f for f in files if split is None or f.split == split]


def verify_manifest(manifest: dict, root: Path | None = None) -> list[str]:
    """Differences between the manifest and the stdlib on this machine; empty when identical."""
    root = Path(root) if root is not None else stdlib_root()
    problems = []
    for f in manifest_files(manifest):
        path = root / f.path
        if not path.is_file():
            problems.append(f"missing: {f.path}")
        elif hashlib.sha256(path.read_bytes()).hexdigest() != f.sha256:
            problems.append(f"changed: {f.path}")
    listed = {f.path for f in manifest_files(manifest)}
    problems += [f"extra: {rel}" for rel in collect_files(root) if rel not in listed]
    return problems


def warn_if_mismatched(manifest: dict, root: Path | None = None) -> list[str]:
    """Training and evaluation still proceed on a different Python: the numbers just are not comparable."""
    problems = verify_manifest(manifest, root)
    if problems:
        shown = "; ".join(problems[:5]) + (f"; ... ({len(problems)} in all)" if len(problems) > 5 else "")
        warnings.warn(
            f"corpus differs from manifest (built on Python {manifest.get('python_version')}, "
            f"running {platform.python_version()}): {shown}",
            stacklevel=2,
        )
    return problems


def read_documents(manifest: dict, split: str, root: Path | None = None) -> list[str]:
    """Text of the manifest's files in `split`, in manifest order; files missing here are skipped."""
    root = Path(root) if root is not None else stdlib_root()
    docs = []
    for f in manifest_files(manifest, split):
        path = root / f.path
        if path.is_file():
            docs.append(path.read_text(encoding="utf-8", errors="replace"))
    return docs
