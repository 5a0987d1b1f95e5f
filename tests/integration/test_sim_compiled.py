"""The simulator compiled with mypyc for real (`dpd plan --compile`, a few minutes on two cores):
the compiled modules are the ones imported, and they decide exactly as the source does — the
pinned outcome digests, and a whole `dpd plan` search's table, equal to the source's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dpd.sim import compiled
from dpd.sim.engine import EngineProfile
from dpd.sim.profile import Profile
from tests.unit.test_sim_compiled import environ

ROOT = Path(__file__).resolve().parents[2]  # where the check's subprocess imports tests.unit from


@pytest.fixture(scope="module")
def build_cache(tmp_path_factory) -> Path:
    if (missing := compiled.missing_tool()) is not None:  # `make sim-compiled` is optional: skipped, not failed
        pytest.skip(f"the simulator cannot be compiled here: {missing}")
    cache = tmp_path_factory.mktemp("dpd-cache")
    # in a session of its own: past the time limit, the compiler it started is stopped with it
    process = subprocess.Popen([sys.executable, "-m", "dpd", "plan", "--compile"], env=environ(cache), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, err = process.communicate(timeout=1200)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, err[-3000:]
    assert "compiling 7 modules with mypyc" in err and "built in" in err
    return cache


def _plan(cache: Path, mode: str, *argv: str) -> str:
    """``dpd plan ARGV``'s stdout, from the source or compiled."""
    out = subprocess.run([sys.executable, "-m", "dpd", "plan", *argv],
                         env=environ(cache, **({compiled.ENV: "0"} if mode == "source" else {})), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("compiled with mypyc" in out.stderr) == (mode == "compiled"), out.stderr[-3000:]
    return out.stdout


def test_the_compiled_modules_reproduce_the_pinned_outcomes(build_cache):
    code = """
from dpd.sim import compiled
said = compiled.use()
import importlib
modules = [importlib.import_module(name) for name in compiled.MODULES]
assert all(compiled.is_compiled(m) for m in modules), [m.__file__ for m in modules]
from tests.unit.test_sim import (MACHINE_DIGESTS, PINNED_DIGESTS, test_the_simulators_outcomes_are_pinned,
                                 test_the_simulators_outcomes_on_one_machine_are_pinned)
for policy, digest in PINNED_DIGESTS:
    test_the_simulators_outcomes_are_pinned(policy, digest)
for policy, digest in MACHINE_DIGESTS:
    test_the_simulators_outcomes_on_one_machine_are_pinned(policy, digest)
print(said)
"""
    out = subprocess.run([sys.executable, "-c", code], env=environ(build_cache), capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "compiled with mypyc" in out.stdout


def test_a_plan_decides_the_same_compiled_as_from_the_source(build_cache, tmp_path):
    profile = tmp_path / "profile.json"
    # two workers a machine slowing each other, as dpd profile measures them on this project's machine
    profile.write_text(Profile(EngineProfile(prefill_tokens_per_s=800.0, prefill_slowdown=1.3, decode_slowdown=1.25,
                                             machine_workers=2), "measured", "test cpu").to_json())
    tables = {}
    for mode in ("source", "compiled"):
        out = _plan(build_cache, mode, "--profile", str(profile), "--trace", "synthetic", "--rate", "1.5", "--requests",
                    "200", "--max-workers", "3", "--jobs", "2", "--out", str(tmp_path / f"{mode}.yaml"))
        # all but the lines with the wall time and the config's path
        tables[mode] = [line for line in out.splitlines()
                        if "simulated requests in" not in line and not line.startswith("config written to")]
    assert tables["compiled"] == tables["source"]
    assert sum(line.startswith("| ") for line in tables["source"]) >= 8  # a table of candidates, not an empty one
    assert (tmp_path / "compiled.yaml").read_text() == (tmp_path / "source.yaml").read_text()


def test_the_check_and_the_speed_run_decide_the_same_compiled(build_cache, tmp_path):
    """`dpd plan --check` (a ladder's runs replayed) and `--speed` (the whole trace per policy):
    every figure the same but the wall times."""
    from dpd.bench.ladder import LadderSpec
    from dpd.bench.stats import RequestRecord
    from dpd.bench.stats import Slo as BenchSlo
    from tests.unit.test_plan_sim import _ladder_results

    profile = tmp_path / "profile.json"
    profile.write_text(Profile(EngineProfile(), "measured", "test cpu").to_json())
    spec = LadderSpec(trace_dir="/nowhere", rates_rps=(0.5,), slo=BenchSlo(10, 0.2), workloads=("synthetic",),
                      num_requests=40, max_prompt_tokens=2048)
    records = [RequestRecord(ttft_s=1.0 + i % 7, e2e_s=3.0 + i, num_output_tokens=11, itls_s=[0.2] * 10, index=i)
               for i in range(40)]
    results = _ladder_results(tmp_path, spec, records, ("colocated", "dpd", "dpd-adaptive"), 0.5)
    checks = {mode: _plan(build_cache, mode, "--profile", str(profile), "--check", str(results))
              for mode in ("source", "compiled")}
    assert checks["compiled"] == checks["source"] and "dpd-adaptive" in checks["source"]

    def figures(table: str) -> list[list[str]]:  # each row but its wall time and requests/s
        rows = [line.split("|") for line in table.splitlines() if line.startswith("| ") and "wall time" not in line]
        return [row[:5] + row[7:] for row in rows]

    speeds = {mode: _plan(build_cache, mode, "--profile", str(profile), "--speed") for mode in ("source", "compiled")}
    assert figures(speeds["compiled"]) == figures(speeds["source"]) and len(figures(speeds["source"])) == 3
