"""JAX's persistent compilation cache, on by default for train.py, eval.py and the server.

Every compiled program (train step, evaluation, sampler, the engine's prefill and chunks) is kept on disk keyed by
its HLO, compile options, JAX/XLA versions and devices, so a second run of the same config in a new workdir, a resume
and an eval.py load it instead of compiling it again (MaxText and levanter do the same). The cache is shared by every
run on the host: `$LMZOO_CACHE/xla` (default ~/.cache/lmzoo/xla, beside the token stores), bounded at
`MAX_BYTES` (least recently used entries go first).

`LMZOO_COMPILATION_CACHE=FOLDER` moves it, `LMZOO_COMPILATION_CACHE=off` turns it off; a cache folder JAX was
already given (`JAX_COMPILATION_CACHE_DIR`, `jax.config`) is kept. A folder that cannot be created or written is one
warning line and the run compiles as without the cache; an unreadable entry (a file truncated by a run killed while
writing it, or corrupted) is JAX's warning and a compile. With the size bound JAX locks the folder (filelock) around
each read and write, so concurrent runs sharing it read whole entries. The cache is local to the host whatever the
workdir (a bucket workdir included)."""

import os
import sys

import jax

from lmzoo import storage
from lmzoo.data import store

VARIABLE = "LMZOO_COMPILATION_CACHE"
OFF = ("off", "0", "false", "no", "none")
MAX_BYTES = 4 * 2**30


def folder() -> str | None:
    """The cache folder this process would use (None: off), without touching it."""
    setting = os.environ.get(VARIABLE, "").strip()
    if setting.lower() in OFF:
        return None
    return os.path.expanduser(setting) if setting else os.path.join(store.cache_base(), "xla")


def enable() -> str | None:
    """Turns the persistent cache on in this process (before its first compile) -> the folder, or None when it is
    off or unusable (then one warning line on stderr says why)."""
    if jax.config.jax_compilation_cache_dir:  # the user's (or a test run's) own cache
        return jax.config.jax_compilation_cache_dir
    path = folder()
    if path is None:
        return None
    try:
        storage.writable_local_folder(path)
    except OSError as e:
        print(
            f"warning: the compilation cache {path} cannot be written ({e.strerror or e}); compiling without it "
            f"(set {VARIABLE}=FOLDER to move it, or {VARIABLE}=off)",
            file=sys.stderr,
        )
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    # Small programs too: a tiny run's every step, evaluation and sampler compile in well under JAX's 1 s default.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path
