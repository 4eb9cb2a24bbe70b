"""JAX's persistent compilation cache, on for `LLM` users: a second start with the same
model and sizes loads its compiled steps from disk instead of compiling them again
(XLA:CPU supports it; measured in the README).

The folder: `$SPECJAX_COMPILATION_CACHE` if it is a path, else `$XDG_CACHE_HOME/specjax/jax`
(`~/.cache/specjax/jax`). `SPECJAX_COMPILATION_CACHE=off` turns it off. A cache folder the
user already gave JAX (`jax_compilation_cache_dir`, `$JAX_COMPILATION_CACHE_DIR`) is left
alone, and so is the rest of JAX's cache configuration then.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import jax

OFF = {"0", "off", "false", "no", "none"}
log = logging.getLogger("specjax.engine")


def cache_dir(environ=os.environ) -> Path | None:
    """Where specjax would keep compiled steps (None: turned off)."""
    value = environ.get("SPECJAX_COMPILATION_CACHE", "").strip()
    if value.lower() in OFF:
        return None
    if value:
        return Path(value).expanduser()
    base = environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specjax" / "jax"


def enable() -> Path | None:
    """Turn the persistent cache on (once per process; idempotent). Returns the folder in
    use, or None when it is off or cannot be created."""
    given = jax.config.jax_compilation_cache_dir
    if given:
        return Path(given)
    folder = cache_dir()
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.debug("compilation cache off: cannot create %s (%s)", folder, e)
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    # A step compiles in well under JAX's default 1 s threshold on small models, and every
    # one is worth keeping: warm-up is many of them.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return folder
