"""Serve: `slidesnake serve`, the project's embedder behind Triton Inference Server
(NVIDIA PyTriton).

Runs in its own environment (`make serve-env`): PyTriton pins numpy<2, the rest of the
project needs numpy 2. Imports only `models` and `errors`, never zarr, OpenSlide or
pandas, which that environment does not have.
"""

import os
import sys
import sysconfig


def ensure_own_libpython() -> None:
    """Re-execute this process with its interpreter's libpython first on the library path.

    Triton's Python stub loads libpython from the library path; without this interpreter's
    own it finds another one (the system's) and fails in odd ways (an `_thread.RLock`
    without `_recursion_count`, a model that never answers its handshake)."""
    libdir = sysconfig.get_config_var("LIBDIR")
    paths = os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)
    if not libdir or libdir in paths:
        return
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join([libdir, *filter(None, paths)])}
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
