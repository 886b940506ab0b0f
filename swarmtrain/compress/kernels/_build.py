"""Run-time build of the kernel sources into a per-user cache keyed by a hash of all that shapes the binary."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

__all__ = ["KernelBuildError", "build_shared_library", "cache_root"]

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent


class KernelBuildError(RuntimeError):
    """A kernel library could not be built or loaded; the message says why."""


def cache_root() -> Path:
    """`$SWARMTRAIN_KERNEL_CACHE`, else `$XDG_CACHE_HOME/swarmtrain/kernels`, else `~/.cache/swarmtrain/kernels`."""
    explicit = os.environ.get("SWARMTRAIN_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "swarmtrain" / "kernels"


def _cpu_flags() -> str:
    """-march=native makes the binary CPU-specific: a shared home dir must not reuse it elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler_version(compiler: str) -> str:
    exe = shutil.which(compiler)
    if exe is None:
        raise KernelBuildError(f"no {compiler!r} compiler on PATH")
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30, check=False)
    return f"{exe}\n{out.stdout}"  # all of it: nvcc puts its version on the last line


def _digest(sources: Sequence[Path], parts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for src in sources:
        h.update(src.name.encode())
        h.update(src.read_bytes())
    for part in parts:
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def build_shared_library(name: str, *, sources: Sequence[str], cflags: Sequence[str],
                         cuda_cflags: Sequence[str] = (), ldflags: Sequence[str] = ()) -> ctypes.CDLL:
    """Builds (or reuses the cached) shared library from kernel sources in this package and loads it.

    Concurrent builders of the same key wait on torch's lock file in the build directory.
    """
    import torch
    from torch.utils import cpp_extension

    paths = [SOURCE_DIR / s for s in sources]
    uses_cuda = any(p.suffix == ".cu" for p in paths)
    compiler = "nvcc" if uses_cuda else os.environ.get("CXX", "c++")
    key_parts = [*cflags, *cuda_cflags, *ldflags, torch.__version__, platform.machine(), _cpu_flags(),
                 _compiler_version(compiler)]
    module = f"{name}_{_digest(paths, key_parts)}"
    build_dir = cache_root() / module
    build_dir.mkdir(parents=True, exist_ok=True)
    lib_path = build_dir / f"{module}.so"
    fresh = not lib_path.exists()
    try:
        cpp_extension.load(
            name=module, sources=[str(p) for p in paths], extra_cflags=list(cflags),
            extra_cuda_cflags=list(cuda_cflags), extra_ldflags=list(ldflags), build_directory=str(build_dir),
            is_python_module=False, verbose=False,
        )
        lib = ctypes.CDLL(str(lib_path))
    except (RuntimeError, OSError, subprocess.SubprocessError, ImportError) as exc:
        first = str(exc).strip().splitlines()
        raise KernelBuildError(f"building {module} in {build_dir} failed: {first[-1] if first else exc!r}") from exc
    log.debug("kernel library %s %s", "built" if fresh else "loaded from cache", lib_path)
    return lib
