"""The simulator compiled with mypyc for real (`dpd plan --compile`, a few minutes on two cores):
the compiled modules are the ones imported, and they decide exactly as the source does — the
pinned outcome digests, and a whole `dpd plan` search's table, equal to the source's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpd.sim import compiled
from dpd.sim.engine import EngineProfile
from dpd.sim.profile import Profile

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def build_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("dpd-cache")
    out = subprocess.run([sys.executable, "-m", "dpd", "plan", "--compile"], env=_env(cache), capture_output=True,
                         text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "compiling 7 modules with mypyc" in out.stderr and "built in" in out.stderr
    return cache


def _env(cache: Path, **extra: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if k != compiled.ENV}
    environ.update(DPD_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT), **extra)
    return environ


def test_the_compiled_modules_reproduce_the_pinned_outcomes(build_cache):
    code = """
from dpd.sim import compiled
said = compiled.use()
import importlib
modules = [importlib.import_module(name) for name in compiled.MODULES]
assert all(compiled.is_compiled(m) for m in modules), [m.__file__ for m in modules]
from tests.unit.test_sim import PINNED_DIGESTS, test_the_simulators_outcomes_are_pinned
for policy, digest in PINNED_DIGESTS:
    test_the_simulators_outcomes_are_pinned(policy, digest)
print(said)
"""
    out = subprocess.run([sys.executable, "-c", code], env=_env(build_cache), capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "compiled with mypyc" in out.stdout


def test_a_plan_decides_the_same_compiled_as_from_the_source(build_cache, tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(Profile(EngineProfile(prefill_tokens_per_s=800.0), "measured", "test cpu").to_json())
    tables = {}
    for mode in ("source", "compiled"):
        extra = {compiled.ENV: "0"} if mode == "source" else {}
        out = subprocess.run([sys.executable, "-m", "dpd", "plan", "--profile", str(profile), "--trace", "synthetic",
                              "--rate", "1.5", "--requests", "200", "--max-workers", "3", "--jobs", "1",
                              "--out", str(tmp_path / f"{mode}.yaml")],
                             env=_env(build_cache, **extra), capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        assert ("compiled with mypyc" in out.stderr) == (mode == "compiled")
        # all but the lines with the wall time and the config's path
        tables[mode] = [line for line in out.stdout.splitlines()
                        if "simulated requests in" not in line and not line.startswith("config written to")]
    assert tables["compiled"] == tables["source"]
    assert sum(line.startswith("| ") for line in tables["source"]) >= 8  # a table of candidates, not an empty one
    assert (tmp_path / "compiled.yaml").read_text() == (tmp_path / "source.yaml").read_text()
