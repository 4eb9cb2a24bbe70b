"""What every checkpoint reader shares (target, EAGLE-3 head, MTP modules): finding the folder
and its safetensors, taking tensors by name with their shapes checked, refusing leftovers, and
building an NNX module from arrays without random-initialising it first. Errors name the file,
folder or tensor."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file


def checkpoint_folder(path: str | os.PathLike, what: str) -> Path:
    """`path` as a folder holding config.json; `what` names it in errors ("EAGLE-3 head")."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{what} folder {str(folder)!r} does not exist")
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder / 'config.json'} is missing")
    return folder


def read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file or tensor."""


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / name for name in weight_map.values()})
        for f in files:
            if not f.exists():
                raise FileNotFoundError(f"{f} is named by {index.name} but missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


def read_safetensors(folder: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint folder as numpy arrays (bfloat16 via ml_dtypes)."""
    tensors: dict[str, np.ndarray] = {}
    for path in _safetensors_files(Path(folder)):
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def _process_umask() -> int:
    """The process's file-creation mask, read without changing it where Linux shows it (changing
    it, even for an instant, races with other threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_safetensors(tensors: dict[str, np.ndarray], path: str | os.PathLike,
                     metadata: dict[str, str] | None = None) -> Path:
    """Write numpy `tensors` to the safetensors file `path`: the one writer of every file specjax
    exports (checkpoints, heads, SAVE_HIDDEN_STATES). safetensors writes through a private temp
    file and leaves mode 0600; the file gets what `open(path, "w")` would give it instead,
    0o666 masked by the process umask."""
    path = Path(path)
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_process_umask())
    return path


def checked_shape(name: str, array: np.ndarray, expected: tuple[int, ...]) -> np.ndarray:
    if tuple(array.shape) != tuple(expected):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(array.shape)}, expected "
                              f"{tuple(expected)} from config.json")
    return array


def tensor_taker(tensors: dict[str, np.ndarray], np_dtype, where: str):
    """`take(name, expected, transpose=False)`: pop a tensor from `tensors`, check its shape
    (named in the error, in the file's own layout) and return it in our layout and dtype."""

    def take(name: str, expected: tuple[int, ...], transpose: bool = False) -> np.ndarray:
        if name not in tensors:
            raise CheckpointError(f"tensor {name!r} is missing from {where}")
        # Compare in the file's own layout so the message matches what the user sees on disk.
        file_shape = tuple(reversed(expected)) if transpose else expected
        array = checked_shape(name, tensors.pop(name), file_shape)
        return (array.T if transpose else array).astype(np_dtype)

    return take




def refuse_leftovers(names: Iterable[str], message: str) -> None:
    """Tensors nothing took are a checkpoint for something else: name (up to five of) them."""
    names = sorted(names)
    if names:
        raise CheckpointError(f"{message}: {', '.join(names[:5])}"
                              + (f" (+{len(names) - 5} more)" if len(names) > 5 else ""))


def module_from_params(build: Callable[[], nnx.Module], params: dict) -> nnx.Module:
    """The module `build()` makes, holding the arrays of the nested dict `params` (its
    `nnx.to_pure_dict` layout) -- traced abstractly, never random-initialised."""
    graphdef, state = nnx.split(nnx.eval_shape(build))
    to_jnp = lambda tree: ({k: to_jnp(v) for k, v in tree.items()} if isinstance(tree, dict)
                           else jnp.asarray(tree))
    nnx.replace_by_pure_dict(state, to_jnp(params))
    return nnx.merge(graphdef, state)
