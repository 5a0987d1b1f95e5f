"""The request log (router/requestlog.py): what it writes, and that the benchmark tools read it
back — audit and replay of what an endpoint served (issue 15)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

from dpd.bench.run import BenchSpec, workload_at_rate
from dpd.bench.stats import Slo
from dpd.bench.workloads import load_request_log, load_trace
from dpd.router.requestlog import RequestLog


def _line(t: float, prompt: int, output: int | None, outcome: str = "ok", tenant: str | None = None) -> dict:
    return {"time": t, "request_id": "r", "tenant": tenant, "api": "completions", "prompt_tokens": prompt,
            "output_tokens": output, "outcome": outcome}


def test_the_log_is_owner_only_and_rotates_once(tmp_path):
    path = tmp_path / "logs" / "requests.jsonl"
    log = RequestLog(path, max_bytes=200)
    for i in range(6):
        log.write(_line(1000.0 + i, 10 * i, 5))
    log.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    rotated = path.with_name("requests.jsonl.1")
    assert rotated.exists() and not path.with_name("requests.jsonl.2").exists()
    lines = [json.loads(x) for f in (rotated, path) for x in f.read_text().splitlines()]
    assert [x["prompt_tokens"] for x in lines] == [0, 10, 20, 30, 40, 50][-len(lines):]


def test_a_log_that_cannot_be_renamed_stays_bounded_and_owner_only(tmp_path, monkeypatch):
    """Where LOG cannot become LOG.1 (a read-only directory, a file mounted on its own) it starts
    again empty, every line still written; a file that existed with a loose mode is made 0600."""
    import dpd.router.requestlog as requestlog

    path = tmp_path / "requests.jsonl"
    path.write_text("")
    path.chmod(0o644)

    def cannot_rename(src, dst):
        raise OSError(16, "Device or resource busy")

    monkeypatch.setattr(requestlog.os, "replace", cannot_rename)
    log = RequestLog(path, max_bytes=200)
    for i in range(50):
        log.write(_line(1000.0 + i, i, 5))
        assert path.stat().st_size < 200 + 200
    log.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert json.loads(path.read_text().splitlines()[-1])["prompt_tokens"] == 49  # the last line written


def test_a_log_that_cannot_be_written_does_not_raise(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    log = RequestLog(blocker / "requests.jsonl", max_bytes=1 << 20)  # its directory is a file
    log.write(_line(1.0, 1, 1))  # logged as a warning; the request is unaffected
    log.close()


def test_a_log_reads_back_as_a_trace_of_what_was_served(tmp_path):
    path = tmp_path / "requests.jsonl"
    rows = [_line(1000.5, 300, 20, tenant="a"), _line(1000.0, 100, 7), _line(1002.0, 50, None, outcome="429"),
            _line(1003.0, 900, 40, tenant="b")]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    trace, skipped = load_request_log(path)
    assert skipped == 2  # the 429 (no output) and the unreadable line
    assert [(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens, r.source) for r in trace] == [
        (0.0, 100, 7, "completions"), (0.5, 300, 20, "a"), (3.0, 900, 40, "b")]
    assert load_trace(path) == trace
    # `dpd bench run --trace LOG` replays it from its start, time-scaled to the rate asked
    spec = BenchSpec(trace_dir=str(path), rates_rps=(1.0,), duration_s=3, threshold_tokens=512, slo=Slo(10, 0.2),
                     max_prompt_tokens=4096, max_output_tokens=64, output_scale=1)
    replay, text = workload_at_rate(trace, spec, 1.0)
    assert [r.num_prompt_tokens for r in replay] == [100, 300, 900] and "request log" in text
    assert [r.num_output_tokens for r in replay] == [7, 20, 40]


def test_dpd_bench_audit_reads_a_request_log(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(_line(1000.0 + i, 100 * (i + 1), 10)) for i in range(4)) + "\n")
    out = subprocess.run([sys.executable, "-m", "dpd", "bench", "audit", "--trace", str(path), "--threshold", "250"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "request log" in out.stdout and "4 served requests" in out.stdout
    missing = subprocess.run([sys.executable, "-m", "dpd", "bench", "audit", "--trace", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no trace at" in missing.stderr and "Traceback" not in missing.stderr
