"""The simulator's modules compiled with mypyc: the same source, run as C.

``dpd plan`` simulates requests through the router's own decision code (``dpd.router.load``,
``adaptive``, ``decide``, ``pick``, ``pools``, ``breaker``) and the engine model
(``dpd.sim.engine``). In CPython that caps a two-worker simulation at ~40,000 requests a second
(~15,000 under the adaptive policy). mypyc (the mypy project's compiler for type-annotated Python,
pinned with mypy) compiles those modules, unchanged, to C extensions; ``use()`` makes a ``dpd plan``
process import them instead of the ``.py`` files. Nothing else ever imports them: the router
serving traffic runs the source.

A build belongs to the exact sources it was made from: its directory is named after a hash of
every ``dpd`` source file, the Python ABI and the mypy version, so an edited tree never runs a
stale build — it runs the source, and says so, until ``dpd plan --compile`` builds again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import ModuleType

# What a simulation runs per request, compiled together (one C library with a module for each).
MODULES = ("dpd.sim.engine", "dpd.router.load", "dpd.router.adaptive", "dpd.router.decide", "dpd.router.pick",
           "dpd.router.pools", "dpd.router.breaker")
ENV = "DPD_SIM_COMPILED"  # "0": run the source even where a build exists
PACKAGE_DIR = Path(__file__).resolve().parent.parent  # the dpd package
MANIFEST = "manifest.json"
KEEP_UNUSED_S = 30 * 86400.0  # a build no plan has used for this long is removed by the next build


def _ext_suffix() -> str:
    return str(sysconfig.get_config_var("EXT_SUFFIX") or ".so")


def _mypy_version() -> str:
    try:
        return version("mypy")
    except PackageNotFoundError:
        return "none"


def sources(package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """The Python sources a build is made from and named after, sorted: every regular ``.py`` file
    under ``package_dir``, but in hidden folders or ``__pycache__`` and an editor's lock or backup
    (``.#load.py``, a link to nowhere). Symlinked folders are not followed."""
    found = []
    for directory, folders, files in os.walk(package_dir):
        folders[:] = [f for f in folders if not f.startswith(".") and f != "__pycache__"]
        for name in files:
            path = Path(directory, name)
            if name.endswith(".py") and not name.startswith(".") and path.is_file():
                found.append(path)
    return sorted(found)


def source_key(package_dir: Path = PACKAGE_DIR) -> str:
    """A build's identity: the ``sources`` (path and bytes), the interpreter's extension ABI and
    the compiler's version. Any edit anywhere in the package changes it (a compiled module is
    bound to the interfaces of what it imports, so not only its own file counts)."""
    digest = hashlib.sha256()
    digest.update(f"{_ext_suffix()}\0{sys.version}\0mypy {_mypy_version()}\0".encode())
    for path in sources(package_dir):
        digest.update(path.relative_to(package_dir).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def cache_root() -> Path:
    base = os.environ.get("DPD_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                           os.path.expanduser("~/.cache"), "dpd")
    return Path(base) / "sim-compiled"


def build_dir(package_dir: Path = PACKAGE_DIR) -> Path:
    return cache_root() / source_key(package_dir)


class CompileError(RuntimeError):
    pass


def _built_files(out: Path) -> dict[str, Path] | None:
    """A complete build's files by module name, or None (no build, or a broken one)."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
        files = {str(name): out / str(relative) for name, relative in manifest["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if set(MODULES) - set(files) or not all(path.is_file() for path in files.values()):
        return None
    return files


def _compiler() -> str:
    return (os.environ.get("CC") or str(sysconfig.get_config_var("CC") or "cc")).split()[0]


def missing_tool() -> str | None:
    """What this machine lacks to compile the simulator, in words, or None."""
    if _mypy_version() == "none":
        return "mypy (with its compiler, mypyc) is not installed: `make install` installs it"
    if shutil.which(_compiler()) is None:
        return f"no C compiler ({_compiler()}) on PATH: install gcc to compile the simulator"
    include = sysconfig.get_paths()["include"]
    if not Path(include, "Python.h").is_file():
        return f"no Python headers ({include}/Python.h): install the Python development package"
    return None


def build(*, package_dir: Path = PACKAGE_DIR, say: Callable[[str], None] = lambda line: None,
          every_s: float = 30.0) -> Path:
    """Compile ``MODULES`` from ``package_dir`` with mypyc into their build directory (kept if it
    is already built and whole); the directory. ``say``: progress lines. Needs mypy, a C compiler
    and Python's headers; once this one is in place, builds unused for a while are removed (``_prune``)."""
    out = build_dir(package_dir)
    if _built_files(out) is not None:
        say(f"already built for these sources: {out}")
        return out
    missing = missing_tool()
    if missing is not None:
        raise CompileError(missing)
    files = [name.replace(".", "/") + ".py" for name in MODULES]
    # the compiler's own switches stay out of it: a build is named after the sources alone
    env = {k: v for k, v in os.environ.items() if not k.startswith("MYPYC_")}
    with tempfile.TemporaryDirectory(prefix="dpd-mypyc-", ignore_cleanup_errors=True) as tmp:
        work = Path(tmp)
        for path in sources(package_dir):
            copy = work / "dpd" / path.relative_to(package_dir)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, copy)
        out = cache_root() / source_key(work / "dpd")  # what is compiled: an edit during the copy gets its own key
        log_path = work / "mypyc.log"
        command = [sys.executable, "-m", "mypyc", "--config-file=", "--ignore-missing-imports", "--check-untyped-defs",
                   *files]
        say(f"compiling {len(MODULES)} modules with mypyc (type-check, C, gcc -O3): a few minutes on a small machine")
        started = time.monotonic()
        with open(log_path, "wb") as log:
            # its own process group: mypyc runs setup.py, which runs gcc; an interrupted build stops them all
            process = subprocess.Popen(command, cwd=work, stdout=log, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
            try:
                while True:
                    try:
                        rc = process.wait(timeout=every_s)
                        break
                    except subprocess.TimeoutExpired:
                        say(f"  still compiling, {time.monotonic() - started:.0f} s")
            finally:
                if process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
        if rc != 0:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
            raise CompileError(f"mypyc failed (exit {rc}):\n{tail}")
        _install(work, out, started)
    say(f"built in {time.monotonic() - started:.0f} s: {out}")
    if build_dir(package_dir) != out:
        say("the sources changed while they were compiled: this build is for the copy taken; `dpd plan --compile` again")
    _prune(out.parent)
    return out


def _prune(root: Path, *, unused_s: float = KEEP_UNUSED_S, stale_s: float = 3600.0) -> None:
    """Remove the builds no plan has used for ``unused_s`` (other checkouts and branches share the
    cache: theirs are kept while in use) and staging folders a killed build left."""
    now = time.time()
    for other in root.iterdir():
        try:
            if other.name.startswith("."):
                if now - other.stat().st_mtime > stale_s:
                    shutil.rmtree(other, ignore_errors=True)
            elif now - (other / MANIFEST).stat().st_mtime > unused_s:
                shutil.rmtree(other, ignore_errors=True)
        except OSError:
            continue  # no manifest: a build in place elsewhere, or none


def _install(work: Path, out: Path, started: float) -> None:
    """Move the extensions mypyc built in ``work`` to ``out``, whole or not at all."""
    suffix = _ext_suffix()
    staging = Path(tempfile.mkdtemp(prefix="." + out.name + ".", dir=_made(out.parent)))
    try:
        built: dict[str, str] = {}
        for path in work.rglob("*" + suffix):
            relative = path.relative_to(work)
            if relative.parts[0] == "build":
                continue  # setuptools' intermediate copies; mypyc copies each extension next to its source
            name = ".".join(relative.parts)[: -len(suffix)]
            (staging / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, staging / relative)
            built[name] = relative.as_posix()
        missing = [name for name in MODULES if name not in built]
        if missing:
            raise CompileError(f"mypyc built no extension for {', '.join(missing)}")
        (staging / MANIFEST).write_text(json.dumps({"key": out.name, "modules": list(MODULES), "files": built,
                                                    "mypy": _mypy_version(), "python": sys.version,
                                                    "built_s": round(time.monotonic() - started, 1)}, indent=1))
        if out.exists() and _built_files(out) is None:  # a broken build of these sources: replaced
            shutil.rmtree(out, ignore_errors=True)
        try:
            staging.rename(out)
        except OSError:
            if _built_files(out) is None:
                raise CompileError(f"could not put the build in place at {out}") from None
            # a concurrent build of the same sources won: its files are these
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _made(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


class _Finder(importlib.abc.MetaPathFinder):
    """Imports the listed modules from their compiled files (ahead of the source on sys.path)."""

    def __init__(self, files: dict[str, Path], where: Path):
        self.files = files
        self.where = where

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        file = self.files.get(fullname)
        if file is None:
            return None
        return importlib.util.spec_from_file_location(fullname, file)


def _described(where: Path) -> str:
    return f"the router's and engine's code compiled with mypyc ({len(MODULES)} modules, {where})"


def use(package_dir: Path = PACKAGE_DIR) -> str:
    """Have this process import the compiled modules where a build for these sources exists; what
    the simulator runs, in words. Must come before anything imports ``dpd.router``."""
    for finder in sys.meta_path:
        if isinstance(finder, _Finder):  # a second plan in one process
            load = sys.modules.get("dpd.router.load")
            if load is None or is_compiled(load):
                return _described(finder.where)
    if os.environ.get(ENV, "") == "0":
        return f"the source (CPython; {ENV}=0)"
    imported = [name for name in ("dpd.router", *MODULES) if name in sys.modules]
    if imported:
        return f"the source (CPython; {imported[0]} was imported before the compiled build could be used)"
    try:
        out = build_dir(package_dir)
    except OSError as exc:
        return f"the source (CPython; its files could not be read for the build's key: {exc})"
    files = _built_files(out)
    if files is None:
        return "the source (CPython; no compiled build for these sources: `dpd plan --compile` makes one, ~4 min)"
    with contextlib.suppress(OSError):
        os.utime(out / MANIFEST)  # in use: kept by other builds' pruning
    finder = _Finder(files, out)
    sys.meta_path.insert(0, finder)
    try:
        for name in MODULES:
            importlib.import_module(name)
    except Exception as exc:  # a damaged build, or one made on another machine: the source, as if none
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == "dpd.router" or n.startswith("dpd.router.") or n in files]:
            del sys.modules[name]
            parent, _, child = name.rpartition(".")
            if parent in sys.modules:  # the package's attribute too, so that nothing reaches the dropped module
                vars(sys.modules[parent]).pop(child, None)
        return (f"the source (CPython; the compiled build in {out} does not load — {type(exc).__name__}: {exc}; "
                f"remove it, then `dpd plan --compile`)")
    return _described(out)


def is_compiled(module: ModuleType) -> bool:
    return str(getattr(module, "__file__", "")).endswith(_ext_suffix())
