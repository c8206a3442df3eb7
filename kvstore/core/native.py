"""C sources of this package built on the host that runs them, loaded with ctypes.

Offers ``build(source, flags)``, returning the loaded library (or raising with every
attempt's reason), and ``cache_dirs()``. Each source is compiled once per host with the
system compiler, first with ``-march=native`` and without it where the compiler refuses,
and cached under ``$KVSTORE_CACHE_DIR`` (default ``~/.cache/kvstore``, or a folder in the
temp dir where that cannot be written), named by a hash of the source, the flags and the
compiler, so a changed source or compiler never loads a stale build. No torch here: the
store uses it too.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

NATIVE = ["-march=native"]  # dropped where the compiler refuses it


def cache_dirs() -> list[Path]:
    env = os.environ.get("KVSTORE_CACHE_DIR")
    first = Path(env) if env else Path.home() / ".cache" / "kvstore"
    return [first, Path(tempfile.gettempdir()) / f"kvstore-cache-{os.getuid()}"]


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _compile(cc: str, flags: list[str], source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *flags, str(source), "-o", tmp], check=True, capture_output=True, timeout=120
        )
        os.replace(tmp, target)  # concurrent builders: the last one wins, whole
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build(source: Path, flags: Sequence[str]) -> ctypes.CDLL:
    """``source`` compiled into a shared object with ``flags`` (plus ``-march=native``
    where it works) and loaded; the cached build where there is one."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    src = source.read_bytes()
    errors = []
    for opts, folder in [(f, d) for f in ([*flags, *NATIVE], list(flags)) for d in cache_dirs()]:
        tag = hashlib.sha256(src + " ".join([cc, *opts, platform.machine()]).encode())
        target = folder / f"{source.stem}-{tag.hexdigest()[:16]}.so"
        try:
            if not target.exists():
                _compile(cc, opts, source, target)
            return ctypes.CDLL(str(target))
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            errors.append(f"{' '.join(opts)}: {exc} {detail.decode(errors='replace')[-300:]}")
    raise RuntimeError("; ".join(errors))
