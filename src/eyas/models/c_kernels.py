"""Building eyas's C kernels (the .c files beside this module): compiled with the machine's C compiler on first
use (well under a second each), for this CPU (-march=native), and kept in `compiled_dir()` under a name that hashes
the source, the flags and the CPU's feature flags, written atomically. Where none builds or loads, the caller runs
torch's op instead, after one warning that says why."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path

from eyas.paths import compiled_dir

# -ffp-contract=fast: every a += b * c is one fused multiply-add, so a result does not depend on which code path
# (vector block or scalar tail) computed it
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=fast", "-shared", "-fPIC"]
COMPILER = os.environ.get("CC", "cc")


def _cpu_features() -> str:
    """What -march=native compiles for: the CPU's feature flags (a cache shared by machines must not mix them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_path(source: Path) -> Path:
    """Where the library built from `source`, with these flags, for this CPU, is kept."""
    key = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join([COMPILER, *FLAGS]).encode(),
                                     _cpu_features().encode(), platform.machine().encode()])).hexdigest()[:24]
    return compiled_dir() / f"{source.stem}-{key}.so"


def build(source: Path, what: str, instead: str) -> ctypes.CDLL | None:
    """The library of `source`, compiled first if this machine has not; None (after a warning that `what` runs
    `instead`, and why) where it cannot be built or loaded."""
    path = library_path(source)
    if not path.is_file():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # a complete library or none, even if killed
                staged = Path(tmp) / path.name
                subprocess.run([COMPILER, *FLAGS, str(source), "-o", str(staged), "-lm"], check=True,
                               capture_output=True, text=True)
                os.replace(staged, path)
        except (OSError, subprocess.CalledProcessError) as e:
            detail = e.stderr.strip().splitlines()[-1] if isinstance(e, subprocess.CalledProcessError) and e.stderr \
                else str(e)
            warnings.warn(f"{what} runs {instead}: compiling {source.name} with {COMPILER} failed ({detail}); set "
                          "CC to a C compiler for the faster kernel", stacklevel=4)
            return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:  # a library this machine cannot load (another's, or damaged): rebuilt once removed
        warnings.warn(f"{what} runs {instead}: {path} does not load ({e}); remove it to build the kernel again",
                      stacklevel=4)
        return None
