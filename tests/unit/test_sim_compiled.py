"""The simulator's compiled build (``dpd.sim.compiled``): which sources a build belongs to, when a
process uses it, and that it replaces exactly the listed modules. The real mypyc build and its
outcomes: tests/integration/test_sim_compiled.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpd.sim import compiled

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable  # this interpreter, even where a test stands a fake one in for the build's


def environ(cache: Path, **extra: str) -> dict[str, str]:
    """A subprocess's environment: this checkout, the build cache ``cache``, and the compiled build
    used where there is one (``DPD_SIM_COMPILED`` as ``extra`` says, not as the unit tests set it)."""
    env = {k: v for k, v in os.environ.items() if k != compiled.ENV}
    env.update(DPD_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT), **extra)
    return env


def _run(code: str, cache: Path, **env: str) -> str:
    out = subprocess.run([PYTHON, "-c", code], env=environ(cache, **env), cwd=cache, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_builds_key_follows_every_source_file_and_nothing_else(tmp_path):
    package = tmp_path / "dpd"
    (package / "router").mkdir(parents=True)
    (package / "router" / "load.py").write_text("x = 1\n")
    (package / "cli.py").write_text("y = 1\n")
    (package / "model.bin").write_bytes(b"weights")
    key = compiled.source_key(package)
    (package / "model.bin").write_bytes(b"other weights")
    assert compiled.source_key(package) == key  # not a source
    (package / "cli.py").write_text("y = 2\n")  # not compiled, but a compiled module may import it
    assert compiled.source_key(package) != key
    (package / "cli.py").write_text("y = 1\n")
    assert compiled.source_key(package) == key
    (package / "router" / "load.py").rename(package / "router" / "loads.py")
    assert compiled.source_key(package) != key  # a path is part of it


def test_without_a_build_a_plan_runs_the_source_and_says_how_to_build(tmp_path):
    said = _run("from dpd.sim import compiled; print(compiled.use()); import dpd.router.load as m; "
                "print(compiled.is_compiled(m))", tmp_path)
    assert "no compiled build for these sources: `dpd plan --compile`" in said
    assert said.endswith("False")


def _fake_build(cache: Path, monkeypatch) -> Path:
    """A 'build' whose dpd.router.decide is a marked copy of the source (a .py stands in for the
    extension: the finder loads whatever file the manifest names)."""
    monkeypatch.setenv("DPD_CACHE_DIR", str(cache))
    out = compiled.build_dir()
    files = {}
    for name in compiled.MODULES:
        relative = name.replace(".", "/") + ".py"
        text = (compiled.PACKAGE_DIR.parent / relative).read_text()
        if name == "dpd.router.decide":
            text += "\nFROM_THE_BUILD = True\n"
        (out / relative).parent.mkdir(parents=True, exist_ok=True)
        (out / relative).write_text(text)
        files[name] = relative
    (out / compiled.MANIFEST).write_text(json.dumps({"files": files}))
    return out


def test_with_a_build_for_these_sources_the_listed_modules_come_from_it(tmp_path, monkeypatch):
    out = _fake_build(tmp_path, monkeypatch)
    said = _run("from dpd.sim import compiled; print(compiled.use()); import dpd.router.decide as d, dpd.router.app; "
                "print(d.FROM_THE_BUILD, d.__file__); import dpd.cli as c; print(c.__file__)", tmp_path)
    first, second, third = said.splitlines()
    assert first.startswith("the router's and engine's code compiled with mypyc") and str(out) in first
    assert second == f"True {out / 'dpd/router/decide.py'}"
    assert third == str(compiled.PACKAGE_DIR / "cli.py")  # everything else: the source


def test_a_build_is_not_used_when_turned_off_incomplete_or_too_late(tmp_path, monkeypatch):
    out = _fake_build(tmp_path, monkeypatch)
    assert "DPD_SIM_COMPILED=0" in _run("from dpd.sim import compiled; print(compiled.use())", tmp_path,
                                        DPD_SIM_COMPILED="0")
    late = _run("import dpd.router; from dpd.sim import compiled; print(compiled.use())", tmp_path)
    assert "dpd.router was imported before" in late
    (out / "dpd/router/pick.py").unlink()
    assert "no compiled build for these sources" in _run("from dpd.sim import compiled; print(compiled.use())", tmp_path)


def test_a_build_without_mypy_or_a_compiler_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("DPD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled, "_mypy_version", lambda: "none")
    with pytest.raises(compiled.CompileError, match="mypy .* is not installed"):
        compiled.build()
    monkeypatch.setattr(compiled, "_mypy_version", lambda: "2.4.1")
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    with pytest.raises(compiled.CompileError, match="no C compiler"):
        compiled.build()


def test_an_existing_build_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("DPD_CACHE_DIR", str(tmp_path))
    out = compiled.build_dir()
    out.mkdir(parents=True)
    files = {}
    for name in compiled.MODULES:
        (out / name).write_text("")
        files[name] = name
    (out / compiled.MANIFEST).write_text(json.dumps({"files": files}))
    said: list[str] = []
    assert compiled.build(say=said.append) == out
    assert said == [f"already built for these sources: {out}"]


def test_dpd_plan_compile_needs_no_profile_and_plan_still_needs_one(tmp_path, monkeypatch, capsys):
    from dpd.cli import main

    monkeypatch.setenv("DPD_CACHE_DIR", str(tmp_path))
    calls: list[bool] = []
    monkeypatch.setattr(compiled, "build", lambda say: calls.append(True) or tmp_path)
    assert main(["plan", "--compile"]) == 0 and calls == [True]
    assert main(["plan", "--trace", "synthetic"]) == 2
    assert "--profile is required" in capsys.readouterr().err


def _fake_mypyc(tmp_path: Path, monkeypatch, body: str) -> None:
    """``sys.executable -m mypyc …`` as a shell script: the build's steps around the compiler run
    for real (copy, key, install, prune), the compiler's part is ``body``."""
    script = tmp_path / "fake-python"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    installed = compiled._mypy_version()  # the key a subprocess computes uses the real one
    if installed == "none":
        pytest.skip("mypy is not installed")
    monkeypatch.setattr(sys, "executable", str(script))
    monkeypatch.setenv("DPD_CACHE_DIR", str(tmp_path / "cache"))


def test_a_failed_compile_says_why_and_leaves_no_build(tmp_path, monkeypatch):
    _fake_mypyc(tmp_path, monkeypatch, "echo 'dpd/router/load.py:1: error: boom'; exit 1")
    with pytest.raises(compiled.CompileError, match=r"(?s)mypyc failed \(exit 1\).*error: boom"):
        compiled.build()
    assert not list((tmp_path / "cache" / "sim-compiled").glob("*"))


def test_a_build_is_installed_whole_and_replaces_older_ones(tmp_path, monkeypatch):
    suffix = compiled._ext_suffix()
    made = " ".join(f"{name.replace('.', '/')}{suffix}" for name in compiled.MODULES)
    _fake_mypyc(tmp_path, monkeypatch, f"mkdir -p build/dpd/sim && touch build/dpd/sim/engine{suffix} "
                                       f"&& for f in {made} abc__mypyc{suffix}; do echo not-an-elf > $f; done")
    root = tmp_path / "cache" / "sim-compiled"
    unused, in_use, staging = root / "0123456789abcdef0123", root / "3210fedcba9876543210", root / ".x.killed"
    for folder in (unused, in_use, staging):
        folder.mkdir(parents=True)
        (folder / compiled.MANIFEST).write_text("{}")
    month_ago = time.time() - 31 * 86400
    os.utime(unused / compiled.MANIFEST, (month_ago, month_ago))
    os.utime(staging, (month_ago, month_ago))
    said: list[str] = []
    out = compiled.build(say=said.append)
    assert out == compiled.build_dir()
    files = compiled._built_files(out)
    assert files is not None and set(files) == {*compiled.MODULES, "abc__mypyc"}
    assert said[-1].startswith("built in")
    # another checkout's build in use is kept; one unused for a month and a killed build's staging are not
    assert sorted(p.name for p in root.iterdir()) == sorted([out.name, in_use.name])
    # a build that does not load (here: not even an ELF file) falls back to the source, saying so
    said_use = _run("from dpd.sim import compiled; print(compiled.use()); import dpd.router.load as m; "
                    "print(compiled.is_compiled(m))", tmp_path / "cache")
    assert "does not load" in said_use and said_use.endswith("False")
    # one of its files gone: not 'already built', built again
    (out / "dpd" / "router" / ("pick" + suffix)).unlink()
    assert compiled._built_files(out) is None
    said.clear()
    assert compiled.build(say=said.append) == out and said[-1].startswith("built in")


def test_an_editors_lock_file_neither_breaks_nor_changes_the_key(tmp_path):
    package = tmp_path / "dpd"
    package.mkdir()
    (package / "load.py").write_text("x = 1\n")
    key = compiled.source_key(package)
    (package / ".#load.py").symlink_to(tmp_path / "nowhere")
    (package / ".ipynb_checkpoints").mkdir()
    (package / ".ipynb_checkpoints" / "load-checkpoint.py").write_text("x = 2\n")
    assert compiled.source_key(package) == key
    assert compiled.sources(package) == [package / "load.py"]  # what is copied to be compiled, too


def test_no_compiled_module_lies_beside_the_source():
    """An extension beside its ``.py`` is imported instead of it (by the serving router too): a
    build never goes there, and none may be left there."""
    assert not [p for p in compiled.PACKAGE_DIR.rglob("*") if p.name.endswith((".so", ".pyd"))]
