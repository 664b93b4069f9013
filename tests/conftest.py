"""Shared fixtures. Token stores that configs naming raw text build on first use go to one temporary cache per
test run, not the user's ~/.cache/lmzoo. Compiled XLA programs go to JAX's persistent compilation cache, one
folder for the whole run (its xdist workers and the train.py processes tests start): many tests train the same tiny
models, and compiling dominates their time.

For the same reason the suite compiles with XLA's quickest CPU pipeline (`lmzoo.testing.FAST_COMPILE_XLA_FLAGS`, those
of them the installed XLA knows: it ends a process given one it does not);
tests/test_compile_flags.py trains one run with the default pipeline in a process of its own and checks its losses
against the suite's, so a difference between the two cannot hide."""

import os
import shutil
import subprocess
import tempfile

import jax
import pytest

from lmzoo import testing

FAST_XLA_FLAGS_VARIABLE = "LMZOO_TEST_FAST_XLA_FLAGS"

# Made by the first pytest process, which removes them at its end: xdist's workers and the processes tests start
# inherit the folders through the environment.
_MADE_HERE = []
for _variable, _prefix in (("LMZOO_CACHE", "lmzoo-cache-"), ("JAX_COMPILATION_CACHE_DIR", "lmzoo-tests-xla-")):
    if _variable not in os.environ:
        os.environ[_variable] = tempfile.mkdtemp(prefix=_prefix)
        _MADE_HERE.append(os.environ[_variable])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# JAX read its settings from the environment when `lmzoo.testing` imported it, before the lines above: this process
# gets them on its config (xdist's workers and the processes tests start read them from the environment they inherit).
# Without it a run without xdist (`-p no:xdist`) compiled every program anew, test after test.
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs", float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"])
)
jax.config.update(
    "jax_persistent_cache_min_entry_size_bytes", int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"])
)

# Those of them this XLA knows (checked once a run: the workers and the processes tests start inherit the answer); the
# caller's own flags (a device count, another value of one of these) come after them, where XLA lets them win.
if FAST_XLA_FLAGS_VARIABLE not in os.environ:
    os.environ[FAST_XLA_FLAGS_VARIABLE] = " ".join(testing.accepted_xla_flags(testing.FAST_COMPILE_XLA_FLAGS))
_CALLER_XLA_FLAGS = os.environ.get("XLA_FLAGS", "").split()
os.environ["XLA_FLAGS"] = " ".join(
    [*(f for f in os.environ[FAST_XLA_FLAGS_VARIABLE].split() if f not in _CALLER_XLA_FLAGS), *_CALLER_XLA_FLAGS]
)


# The test files that take longest, longest first (seconds: the file alone without xdist, 2026-12-06, load 2-7).
# Under `-n 2 --dist loadfile --no-loadscope-reorder` (the README's command) each file goes to one worker whole, so a
# module-scoped fixture (a trained run, a chain of stages) is made once, not by both workers; sending these first
# leaves short files for last, so the two workers end together.
SLOWEST_FILES = (
    "tests/test_matrix.py",  # 8 of its 41 cases took 7 min
    "tests/rl/test_alignment.py",  # 322
    "tests/scaleout/test_scaleout.py",  # 207
    "tests/models/test_elmo.py",  # one test of it 111 in a whole run
    "tests/convert/test_hf_shapes.py",  # one test of it 96 in a whole run
    "tests/test_device_suite.py",  # 81
    "tests/rl/test_lora_alignment.py",  # 38
    "tests/kernels/test_host_memory.py",  # 35
    "tests/scaleout/test_moe_scaleout.py",  # 26
)


DIST_VARIABLE = "LMZOO_TEST_DIST"  # xdist's --dist of this run, for its workers: theirs is set to "no"


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the first pytest process (its workers are started after this)
        os.environ[DIST_VARIABLE] = getattr(config.option, "dist", "no")


def pytest_collection_modifyitems(config, items):
    """With file-grouped distribution, the files of SLOWEST_FILES first (each file's own order kept)."""
    if os.environ.get(DIST_VARIABLE) not in ("loadfile", "loadscope"):
        return  # `--dist load` sends consecutive runs of tests to each worker: slow ones first would pile up on one
    rank = {path: i for i, path in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest as collected


def pytest_unconfigure(config):
    for folder in _MADE_HERE:
        shutil.rmtree(folder, ignore_errors=True)


FAILING_OPEN = r"""
/* open(2) of every path containing $FAILFS_MATCH fails with errno $FAILFS_ERRNO. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

static int failing(const char *path) {
    const char *match = getenv("FAILFS_MATCH");
    if (!match || !path || !strstr(path, match)) return 0;
    errno = atoi(getenv("FAILFS_ERRNO"));
    return 1;
}

#define MODE(flags) mode_t mode = 0; if (flags & (O_CREAT | O_TMPFILE)) { va_list ap; va_start(ap, flags); mode = va_arg(ap, int); va_end(ap); }

int open(const char *path, int flags, ...) {
    MODE(flags) if (failing(path)) return -1;
    return ((int (*)(const char *, int, ...))dlsym(RTLD_NEXT, "open"))(path, flags, mode);
}
int open64(const char *path, int flags, ...) {
    MODE(flags) if (failing(path)) return -1;
    return ((int (*)(const char *, int, ...))dlsym(RTLD_NEXT, "open64"))(path, flags, mode);
}
int openat(int dir, const char *path, int flags, ...) {
    MODE(flags) if (failing(path)) return -1;
    return ((int (*)(int, const char *, int, ...))dlsym(RTLD_NEXT, "openat"))(dir, path, flags, mode);
}
int openat64(int dir, const char *path, int flags, ...) {
    MODE(flags) if (failing(path)) return -1;
    return ((int (*)(int, const char *, int, ...))dlsym(RTLD_NEXT, "openat64"))(dir, path, flags, mode);
}
"""


@pytest.fixture(scope="module")
def failing_open(tmp_path_factory):
    """Path of the compiled shim (skips without a C compiler)."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("needs a C compiler for the failing-filesystem shim")
    folder = tmp_path_factory.mktemp("shim")
    (folder / "failing_open.c").write_text(FAILING_OPEN)
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-o", str(folder / "failing_open.so"), str(folder / "failing_open.c"), "-ldl"],
        check=True,
    )
    return folder / "failing_open.so"
