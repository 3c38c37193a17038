"""Linux CPU: run with OpenBLAS, not the reference BLAS MLX's CPU wheel links.

Preloading Debian's OpenBLAS (``libopenblas0-pthread``) was measured 20x faster on float32
matmuls and 8x on a training step (docs/design.md, Linux CPU). ``./run`` preloads it; a
``pomona`` or ``python -m engine`` started straight from the venv re-executes itself once
with the preload when the library is installed, and otherwise warns once with the fix.
Ray workers of a private local cluster inherit the preload from the process that started
it. Nothing happens on macOS, on CUDA builds, or when OpenBLAS is already loaded.
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

from engine.host.reexec import reexec

# Where Debian/Ubuntu install it; POMONA_OPENBLAS names another library file.
OPENBLAS_GLOB = "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0"
CHECKED = "POMONA_BLAS_CHECKED"  # set in the re-executed process (and by users to opt out)


def openblas_loaded() -> bool:
    """Whether this process has an OpenBLAS mapped (preloaded or linked)."""
    try:
        return "libopenblas" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def openblas_library() -> str | None:
    named = os.environ.get("POMONA_OPENBLAS")
    if named is not None:
        return named if Path(named).is_file() else None
    found = sorted(glob.glob(OPENBLAS_GLOB))
    return found[0] if found else None


def ensure_fast_blas(argv: list[str] | None = None) -> None:
    """Re-execute this process with OpenBLAS preloaded where it matters and is installed
    (``argv``: the interpreter's arguments, default this process's own); else warn once."""
    if sys.platform != "linux" or os.environ.get(CHECKED) or openblas_loaded():
        return
    import mlx.core as mx

    if mx.default_device() != mx.cpu:  # a CUDA build: the matmuls run on the GPU
        return
    os.environ[CHECKED] = "1"  # children and a re-executed self do not check again
    lib = openblas_library()
    if lib is None:
        print("warning: MLX on this Linux CPU uses its reference BLAS (training ~8x slower); "
              "install OpenBLAS (sudo apt-get install libopenblas0-pthread) or run through "
              "./run, which preloads it", file=sys.stderr)
        return
    preload = ":".join([lib, *filter(None, [os.environ.get("LD_PRELOAD")])])
    reexec(sys.orig_argv[1:] if argv is None else argv, {"LD_PRELOAD": preload})
    print(f"warning: could not re-run {sys.executable} with {lib} preloaded; MLX uses its "
          "reference BLAS (training ~8x slower)", file=sys.stderr)
