"""Persistent, node-shared kernel store: compile each kernel once per node, load it everywhere.

A replica of TP ranks on one node would otherwise JIT the same kernels once per rank at start-up
(K3 TP16: 32 CuTe GEMVs ≈ 1 s each on one core, plus the Triton kernels). The cache directory
(`RAYDECODE_KERNEL_CACHE`, node-local disk) holds:

    cute/<digest>.o       a CuTe DSL TVM-FFI GEMV exported with `export_to_c` (host code + the
                          embedded cubin); loaded with `cute.runtime.load_module` (JITLink, no
                          recompile); the digest is the sha256 of the key below
    triton/               TRITON_CACHE_DIR for the ranks: Triton's own on-disk cache, which the
                          offline compiles (`aot_triton`) and every rank's JIT share
    locks/<digest>.lock   flock per kernel: the first process compiles, the others wait, then load
    manifest.json         {"format": 1, "entries": {digest: {key, file, sha256, ...}}}

Key of a CuTe GEMV (a change in any field → a new digest → a new compile, never a stale load):
kind, dtype, M, N, K, GemvConfig, arch, FFI flag, package versions (nvidia-cutlass-dsl,
apache-tvm-ffi) and the sha256 of kernels/gemv.py (any edit of the kernel source invalidates).
An entry whose object file does not match its recorded sha256, or fails to load, is reported with
a warning, removed and recompiled.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from raydecode.kernels import settings

log = logging.getLogger(__name__)

ENV = "RAYDECODE_KERNEL_CACHE"
FORMAT = 1
_GEMV_SOURCE = Path(__file__).with_name("gemv.py")
# this process's counts, reported by `prepare_kernel_cache` and read by tests
STATS = {"compiled": 0, "loaded": 0, "recompiled_corrupt": 0}


class KernelCacheError(ValueError):
    """Bad cache directory / arch / plan input (names the value and what is accepted)."""


def cache_dir(explicit: str | os.PathLike | None = None) -> Path | None:
    """The cache directory: `explicit`, else $RAYDECODE_KERNEL_CACHE, else None (no persistence)."""
    raw = os.fspath(explicit) if explicit is not None else settings.kernel_cache_dir()
    if not raw:
        return None
    p = Path(raw).expanduser().resolve()
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KernelCacheError(f"kernel cache dir {raw!r} cannot be created ({e}); set {ENV} to a "
                               "writable node-local directory") from e
    return p


def check_arch(arch: str) -> str:
    """'sm_90a' style arch string (what CUTE_DSL_ARCH accepts) → itself; else KernelCacheError."""
    ok = arch.startswith("sm_") and arch[3:].rstrip("af").isdigit() and len(arch) >= 5
    if not ok:
        raise KernelCacheError(f"arch {arch!r}: expected an 'sm_XY[a|f]' string such as sm_90a "
                               "(H100/H200) or sm_100a (B200)")
    return arch


def current_arch() -> str:
    """CUTE_DSL_ARCH when set, else the current CUDA device's sm_XYa (arch-specific from sm_90)."""
    env = os.environ.get("CUTE_DSL_ARCH")
    if env:
        return check_arch(env)
    if not torch.cuda.is_available():
        raise KernelCacheError("no CUDA device and CUTE_DSL_ARCH unset: name the target arch "
                               "(e.g. CUTE_DSL_ARCH=sm_90a)")
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Versions that change generated code or its ABI."""
    return {p: package_version(p) for p in ("nvidia-cutlass-dsl", "apache-tvm-ffi", "triton")}


def source_sha(path: Path = _GEMV_SOURCE) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[float]:
    """Exclusive flock on `path` (created); yields the seconds spent waiting for it.

    flock is per open file description, so it also excludes threads of one process that each
    open the file. Node-local filesystems only (flock over NFS is not reliable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield time.monotonic() - t0
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)   # readers see the old file or the whole new one, never a torn one


@dataclass
class KernelStore:
    """One cache directory: manifest + per-kernel objects + locks."""
    root: Path
    events: list[dict] = field(default_factory=list)   # what this process did, in order

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    def manifest(self) -> dict:
        try:
            m = json.loads(self.manifest_path.read_text())
        except FileNotFoundError:
            return {"format": FORMAT, "entries": {}}
        except (json.JSONDecodeError, UnicodeDecodeError):
            warnings.warn(f"kernel cache manifest {self.manifest_path} is corrupt; rebuilding it")
            return {"format": FORMAT, "entries": {}}
        if m.get("format") != FORMAT:
            warnings.warn(f"kernel cache manifest format {m.get('format')!r} != {FORMAT}; "
                          "rebuilding it")
            return {"format": FORMAT, "entries": {}}
        return m

    def _update(self, fn: Callable[[dict], None]) -> None:
        with file_lock(self.root / "locks" / "manifest.lock"):
            m = self.manifest()
            fn(m["entries"])
            _atomic_write(self.manifest_path, json.dumps(m, indent=1, sort_keys=True).encode())

    def record(self, dg: str, entry: dict) -> None:
        def put(entries: dict) -> None:
            old = entries.get(dg, {})
            entry["compiles"] = old.get("compiles", 0) + 1
            entries[dg] = entry
        self._update(put)

    def forget(self, dg: str) -> None:
        self._update(lambda entries: entries.pop(dg, None))

    def valid_object(self, dg: str, entry: dict | None) -> Path | None:
        """The object file of entry `dg` when present and matching its sha256; else None,
        warning (and dropping it) when it exists but is damaged."""
        if entry is None:
            return None
        path = self.root / entry["file"]
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = None
        if data is not None and hashlib.sha256(data).hexdigest() == entry["sha256"]:
            return path
        warnings.warn(f"kernel cache entry {dg} ({entry.get('key', {}).get('kind')}) at {path} is "
                      f"{'missing' if data is None else 'corrupt (sha256 mismatch)'}; recompiling")
        STATS["recompiled_corrupt"] += 1
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self.forget(dg)
        return None

    def _load_quiet(self, dg: str, load: Callable[[Path, str], Any]) -> Any:
        """Lock-free fast path: load entry dg if it is recorded and intact, else None (the
        locked path then validates loudly and rebuilds)."""
        entry = self.manifest()["entries"].get(dg)
        if entry is None:
            return None
        path = self.root / entry["file"]
        try:
            ok = hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"]
        except FileNotFoundError:
            return None
        if not ok:
            return None
        try:
            fn = load(path, entry["symbol"])
        except Exception:
            return None
        STATS["loaded"] += 1
        self.events.append({"digest": dg, "action": "loaded", "wait_s": 0.0})
        return fn

    def get_or_build(self, key: dict, build: Callable[[Path, str], None],
                     load: Callable[[Path, str], Any]) -> Any:
        """Load kernel `key` from the cache, compiling it first (under its lock) when absent.

        build(path, symbol) writes the object file; load(path, symbol) returns the callable.
        Exactly one process per node builds a given key; the rest block on the lock and load."""
        dg = digest(key)
        symbol = f"rd_{dg[:20]}"
        rel = f"{key['kind']}/{dg}.o"
        fn = self._load_quiet(dg, load)   # common case: already there, no lock taken
        if fn is not None:
            return fn
        with file_lock(self.root / "locks" / f"{dg}.lock") as waited:
            path = self.valid_object(dg, self.manifest()["entries"].get(dg))
            if path is not None:
                try:
                    fn = load(path, symbol)
                except Exception as e:   # a truncated-but-hash-matching file cannot happen; an
                    warnings.warn(f"kernel cache entry {dg} failed to load ({e}); recompiling")
                    STATS["recompiled_corrupt"] += 1   # ABI drift of the loader can
                    self.forget(dg)
                    path = None
                else:
                    STATS["loaded"] += 1
                    self.events.append({"digest": dg, "action": "loaded", "wait_s": waited})
                    return fn
            out = self.root / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
            build(tmp, symbol)
            os.replace(tmp, out)
            secs = time.monotonic() - t0
            self.record(dg, {"key": key, "file": rel, "symbol": symbol,
                             "sha256": hashlib.sha256(out.read_bytes()).hexdigest(),
                             "compile_s": round(secs, 3), "pid": os.getpid(),
                             "host": os.uname().nodename, "time": time.time()})
            STATS["compiled"] += 1
            self.events.append({"digest": dg, "action": "compiled", "compile_s": secs})
            return load(out, symbol)


# ---- CuTe GEMV ---------------------------------------------------------------------------


def _dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def gemv_key(dtype: torch.dtype, M: int, N: int, K: int, cfg, arch: str,
             out_dtype: torch.dtype | None = None) -> dict:
    return {"kind": "cute_gemv", "dtype": _dname(dtype), "out_dtype": _dname(out_dtype or dtype),
            "M": M, "N": N, "K": K, "config": asdict(cfg), "arch": arch, "ffi": True,
            "versions": {k: v for k, v in versions().items() if k != "triton"},
            "source": source_sha()}


def _export_gemv(dtype, M, N, K, cfg, compile_fn, out_dtype):
    extra = {} if out_dtype in (None, dtype) else {"out_dtype": out_dtype}

    def build(path: Path, symbol: str) -> None:
        compiled = compile_fn(dtype, M, N, K, cfg, ffi=True, **extra)
        compiled.export_to_c(str(path), function_name=symbol)
    return build


def _load_gemv(path: Path, symbol: str):
    import cutlass.cute as cute

    return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), symbol)


def load_or_compile_gemv(dtype: torch.dtype, M: int, N: int, K: int, cfg,
                         compile_fn: Callable, root: Path | None = None, arch: str | None = None,
                         out_dtype: torch.dtype | None = None):
    """The TVM-FFI launch function for one GEMV from the persistent cache (compiling and storing
    it when absent), or None when no cache dir is configured (caller JIT-compiles as before)."""
    root = root or cache_dir()
    if root is None:
        return None
    arch = arch or current_arch()
    key = gemv_key(dtype, M, N, K, cfg, arch, out_dtype)
    return _store(root).get_or_build(key, _export_gemv(dtype, M, N, K, cfg, compile_fn, out_dtype),
                                     _load_gemv)


_STORES: dict[Path, KernelStore] = {}


def _store(root: Path) -> KernelStore:
    root = Path(root).resolve()
    return _STORES.setdefault(root, KernelStore(root))


def triton_cache_dir(root: Path) -> Path:
    return root / "triton"


def use_triton_cache(root: Path) -> Path:
    """Point this process's Triton JIT at the shared cache (unless the operator set one)."""
    os.environ.setdefault("TRITON_CACHE_DIR", str(triton_cache_dir(root)))
    return Path(os.environ["TRITON_CACHE_DIR"])


__all__ = ["ENV", "KernelCacheError", "KernelStore", "STATS", "cache_dir", "check_arch",
           "current_arch", "digest", "file_lock", "gemv_key", "load_or_compile_gemv",
           "use_triton_cache", "versions"]
