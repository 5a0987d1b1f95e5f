"""`dpd profile` and `dpd plan` (issue 17): the profile's fits against a worker with known
speeds, the modelled profile, the search and its recommendation, the written config."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dpd.config import parse_config
from dpd.router.adaptive import Slo
from dpd.sim.engine import EngineProfile, SimEndpoint
from dpd.sim.plan import Candidate, best, candidates, config_for, evaluate, search
from dpd.sim.profile import Profile, fit_line, measure, modelled

RATE = 4000.0  # the fake worker's prefill rate, tokens/s
STEP_S = 0.012  # its decode step


class FakeWorker(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # chunked streams, as vLLM's server sends them

    def _json(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        self._json({"data": [{"id": "m"}]} if self.path == "/v1/models" else {"version": "0.0-test"})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._work(0.005 + len(body["prompt"]) / RATE)
        if not body.get("stream"):
            self._json({"choices": [{"text": "x"}], "usage": {"completion_tokens": 1}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def send(data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        for i in range(body["max_tokens"]):
            if i:
                self._work(STEP_S)
            chunk = {"choices": [{"text": "x"}], "usage": {"completion_tokens": i + 1}}
            send(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        send(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _work(self, seconds: float) -> None:
        time.sleep(seconds)

    def log_message(self, *args) -> None:
        pass


class OneEngineWorker(FakeWorker):
    """Every prefill and every stream's step holds one engine: a prefill delays the streams."""

    engine = threading.Lock()

    def _work(self, seconds: float) -> None:
        with self.engine:
            time.sleep(seconds)


@pytest.fixture
def fake_worker(request):
    server = ThreadingHTTPServer(("127.0.0.1", 0), getattr(request, "param", FakeWorker))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_fit_line_recovers_a_line():
    assert fit_line([1, 2, 3, 4], [3, 5, 7, 9]) == pytest.approx((1, 2))
    with pytest.raises(ValueError):
        fit_line([2, 2], [1, 3])


def test_a_profile_measures_a_workers_known_speeds(fake_worker, tmp_path):
    profile = measure(fake_worker, progress=lambda m: None)
    assert profile.source == "measured" and profile.model == "m" and profile.engine_version == "vllm 0.0-test"
    assert profile.engine.prefill_tokens_per_s == pytest.approx(RATE, rel=0.25)
    assert profile.engine.step_overhead_s == pytest.approx(STEP_S, rel=0.5)
    assert profile.engine.decode_s_per_stream < 0.003  # the fake's steps do not grow with the batch
    assert any("KV pull left at the default" in n for n in profile.notes)
    path = tmp_path / "p.json"
    path.write_text(profile.to_json())
    assert Profile.load(path) == profile


@pytest.mark.parametrize("fake_worker", [OneEngineWorker], indirect=True)
def test_a_streams_delay_is_the_time_a_load_held_its_engine(fake_worker):
    """What ``dpd profile`` measures a KV pull's cost to the decoder with: a stream's delay while
    a load runs. Two 4,000-token prefills hold the engine 1.005 s each: the stream waits 2.01 s.
    (Tolerances of a quarter second: on a loaded 2-core machine the stream's own thread runs late.)"""
    from dpd.sim.profile import WorkerClient, _stream_delay_s

    client = WorkerClient(fake_worker)

    def timed(work) -> tuple[float, float]:
        started = time.monotonic()
        work()
        return started, time.monotonic()

    def prefills() -> list[tuple[float, float]]:  # each one a window of interest
        return [timed(lambda s=s: client.complete(client.prompt(4000, s), 1)) for s in (1, 2)]

    assert _stream_delay_s(client, prefills, seed=3) == pytest.approx(2.01, abs=0.25)
    quiet = _stream_delay_s(client, lambda: [timed(lambda: time.sleep(0.3))], seed=4)
    assert quiet == pytest.approx(0.0, abs=0.25)  # no load: no delay
    def prefills_then_quiet() -> list[tuple[float, float]]:
        prefills()
        return [timed(lambda: time.sleep(0.3))]

    # only the windows returned count: the prefills before the quiet one delay nothing there
    assert _stream_delay_s(client, prefills_then_quiet, seed=5) == pytest.approx(0.0, abs=0.25)


class MachineWorker(FakeWorker):
    """Workers of one machine that slow each other: a prefill takes twice as long while a stream
    is decoding (a step in the last 50 ms), a decode step 1.5× while a prefill computes."""

    lock = threading.Lock()
    prefilling = 0
    last_step = 0.0

    def _work(self, seconds: float) -> None:
        cls = MachineWorker
        if seconds == STEP_S:
            with cls.lock:
                factor = 1.5 if cls.prefilling else 1.0
            time.sleep(seconds * factor)
            cls.last_step = time.monotonic()
            return
        with cls.lock:
            cls.prefilling += 1
            factor = 2.0 if time.monotonic() - cls.last_step < 0.05 else 1.0
        try:
            time.sleep(seconds * factor)
        finally:
            with cls.lock:
                cls.prefilling -= 1


def _serve(handler) -> tuple[ThreadingHTTPServer, str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _router_of(prefill: list[str], decode: list[str]):
    class Router(FakeWorker):
        def do_GET(self) -> None:  # noqa: N802
            self._json({"pools": {"prefill": {"workers": [{"url": u} for u in prefill]},
                                  "decode": {"workers": [{"url": u} for u in decode]}}})
    return Router


def test_the_profile_measures_how_workers_of_one_machine_slow_each_other():
    """Two fake workers on one host, a prefill ×2 beside a stream and a step ×1.5 beside a prefill:
    measured within a quarter (sleep-timed on a shared 2-core machine); workers on different hosts
    are not measured."""
    from dpd.sim.profile import measure_interference

    servers = [_serve(MachineWorker) for _ in range(2)]
    router, router_url = _serve(_router_of([servers[0][1]], [servers[1][1]]))
    far, far_url = _serve(_router_of(["http://10.0.0.1:8100"], ["http://10.0.0.2:8101"]))
    try:
        measured = measure_interference(router_url, "m", seed=7, progress=lambda m: None, rounds=2, prompt_tokens=800)
        assert measure_interference(far_url, "m", seed=7, progress=lambda m: None) is None
    finally:
        for server, _ in (*servers, (router, ""), (far, "")):
            server.shutdown()
            server.server_close()
    assert measured is not None
    prefill_slowdown, decode_slowdown, machine_workers = measured
    assert machine_workers == 2
    assert prefill_slowdown == pytest.approx(2.0, rel=0.25) and decode_slowdown == pytest.approx(1.5, rel=0.25)


@pytest.mark.parametrize("prefill, decode, expected", [
    (["http://h1:1"], ["http://h1:2", "http://h1:3"], ("http://h1:1", "http://h1:2", 3)),  # a prefill and a decode worker
    (["http://h0:1"], ["http://h2:1", "http://h2:2", "http://h2:1"], ("http://h2:1", "http://h2:2", 2)),  # listed twice
    (["http://h1:1"], ["http://h2:1"], None),  # no two on one host
])
def test_the_interference_is_measured_on_two_workers_of_the_busiest_host(prefill, decode, expected):
    from dpd.sim.profile import _same_machine_pair

    router, url = _serve(_router_of(prefill, decode))
    try:
        pair = _same_machine_pair(url, "m", None)
    finally:
        router.shutdown()
        router.server_close()
    assert (pair if pair is None else (pair[0].url, pair[1].url, pair[2])) == expected


@pytest.mark.parametrize("engine, error", [
    ({"prefill_tokens_per_s": 0}, "prefill_tokens_per_s must be positive"),
    ({"prefill_tokens_per_s": -5.0}, "prefill_tokens_per_s must be positive"),
    ({"prefill_tokens_per_s": "fast"}, "prefill_tokens_per_s must be a number"),
    ({"kv_transfer_s": float("nan")}, "kv_transfer_s must be zero or more and finite"),
    ({"max_batched_tokens": 2048.5}, "max_batched_tokens must be an integer"),
    ({"max_num_seqs": 0}, "max_num_seqs must be positive"),
    ({"step_overhead_s": 0.0, "decode_s_per_stream": 0.0}, "a decode step must take some time"),
    ({"speed": 1.0}, "unexpected keyword"),
])
def test_a_profile_file_with_bad_figures_is_refused_by_name(tmp_path, engine, error):
    """A profile is a file users edit: a bad figure is named, not a traceback or a loop mid-search."""
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"engine": {"prefill_tokens_per_s": 500.0, **engine}, "source": "measured"}))
    with pytest.raises(ValueError, match=f"is not a dpd profile: .*{error}"):
        Profile.load(path)


@pytest.mark.parametrize("text", ["not json", "[1, 2]", "{}", '{"engine": 3}'])
def test_a_file_that_is_no_profile_is_refused(tmp_path, text):
    path = tmp_path / "profile.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="is not a dpd profile"):
        Profile.load(path)


def test_a_modelled_profile_is_a_roofline_and_says_so():
    p = modelled("h100-sxm", 8, kv_bytes_per_token=131072)  # an 8B model, 128 KiB of KV per token
    assert p.source == "modelled" and "not measured" in p.notes[0]
    assert p.engine.prefill_tokens_per_s == pytest.approx(989e12 * 0.5 / 16e9, rel=1e-3)  # ~31k tokens/s
    assert p.engine.step_overhead_s == pytest.approx(16e9 / (3350e9 * 0.6))  # ~8 ms to read the weights
    with pytest.raises(ValueError, match="unknown hardware"):
        modelled("tpu9", 8, kv_bytes_per_token=1)


def test_the_search_space_and_the_recommendation():
    space = list(candidates(3, ("colocated", "threshold", "adaptive"), (512,)))
    assert [c.describe() for c in space] == [
        "colocated × 1", "colocated × 2", "1P:1D threshold 512", "1P:1D adaptive",
        "colocated × 3", "1P:2D threshold 512", "1P:2D adaptive", "2P:1D threshold 512", "2P:1D adaptive"]
    # One worker, requests 10 s apart, each alone: every one meets the SLO; the cheapest wins.
    profile = EngineProfile(prefill_tokens_per_s=1000, step_overhead_s=0.05, decode_s_per_stream=0.0)
    requests = [(i * 10.0, 500, 10) for i in range(10)]
    rows = search(requests, profile, Slo(2.0, 0.1), max_workers=2, policies=("colocated", "adaptive"))
    choice = best(rows, 0.9)
    assert choice.candidate == Candidate("colocated", 0, 1) and choice.attainment == 1.0
    # Each alone: TTFT = one step of 0.05 + 500/1000 s; TPOT = one step.
    assert choice.ttft_p99_s == pytest.approx(0.55) and choice.itl_p99_s == pytest.approx(0.05)
    assert choice.goodput_rps == pytest.approx(10 / (90 + 0.55 + 9 * 0.05))


def test_candidates_simulated_in_parallel_give_the_same_rows():
    profile = EngineProfile(prefill_tokens_per_s=300, step_overhead_s=0.05, decode_s_per_stream=0.005)
    requests = [(i * 0.7, 100 + (i * 37) % 900, 5 + i % 20) for i in range(60)]
    kwargs = dict(max_workers=3, policies=("colocated", "threshold", "adaptive"), thresholds=(256,))
    seen: list[tuple[int, int]] = []
    parallel = search(requests, profile, Slo(5.0, 0.2), jobs=2, progress=lambda done, total: seen.append((done, total)),
                      **kwargs)  # type: ignore[arg-type]
    assert parallel == search(requests, profile, Slo(5.0, 0.2), jobs=1, **kwargs)  # type: ignore[arg-type]
    assert seen[-1] == (len(parallel), len(parallel))


def test_the_recommended_config_loads_and_says_what_was_chosen():
    row = evaluate(Candidate("threshold", 1, 2, 768), [(0.0, 100, 4), (1.0, 2000, 4)], EngineProfile(), Slo(5.0, 0.1))
    config = parse_config(config_for(row, Slo(5.0, 0.1)))
    pd = config.spec.pdSpec
    assert (pd.prefillSpec.replicas, pd.decodingSpec.replicas, pd.routingPolicy, pd.routingThreshold) == (1, 2, "threshold", 768)
    assert (pd.router.slo.ttftS, pd.router.slo.tpotS) == (5.0, 0.1)


def test_dpd_plan_end_to_end(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(Profile(EngineProfile(), "measured", "test cpu").to_json())
    out = tmp_path / "planned.yaml"
    run = subprocess.run([sys.executable, "-m", "dpd", "plan", "--profile", str(profile), "--trace", "synthetic",
                          "--rate", "0.5", "--requests", "60", "--max-workers", "2", "--max-prompt-tokens", "768",
                          "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "Recommended:" in run.stdout and "| colocated × 1 |" in run.stdout and "simulated requests in" in run.stdout
    assert out.read_text().startswith("# dpd plan:")
    bad = subprocess.run([sys.executable, "-m", "dpd", "plan", "--profile", str(tmp_path / "none.json")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "dpd plan:" in bad.stderr and "Traceback" not in bad.stderr
    for args in (["--fit-speed"], ["--speed-under-load", "0"]):
        bad = subprocess.run([sys.executable, "-m", "dpd", "plan", "--profile", str(profile), "--trace", "synthetic",
                              "--requests", "10", "--out", str(out), *args], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and "dpd plan" in bad.stderr and "Traceback" not in bad.stderr, args


@pytest.mark.parametrize("argv, says", [
    (["--rate", "0"], "--rate must be > 0"),
    (["--rate", "-1"], "--rate must be > 0"),
    (["--policies", "threshhold"], "unknown policies ['threshhold']"),
    (["--policies", "threshold", "--max-workers", "1"], "no candidate endpoint"),
    (["--min-workers", "3", "--max-workers", "2"], "no candidate endpoint"),
    (["--requests", "0"], "--requests must be >= 1"),
])
def test_dpd_plan_refuses_what_it_cannot_search(tmp_path, capsys, argv, says):
    """A zero rate, a misspelt policy or an empty search space: one line and exit 2, never a traceback."""
    from dpd.cli import main

    profile = tmp_path / "profile.json"
    profile.write_text(Profile(EngineProfile(), "measured", "test cpu").to_json())
    assert main(["plan", "--profile", str(profile), "--trace", "synthetic", "--out", str(tmp_path / "o.yaml"), *argv]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "o.yaml").exists()


@pytest.mark.parametrize("argv, says", [
    (["plan", "--slo-ttft", "-1"], "argument --slo-ttft: must be a finite number > 0, got '-1'"),
    (["plan", "--slo-tpot", "nan"], "argument --slo-tpot: must be a finite number > 0"),
    (["plan", "--target", "2"], "argument --target: must be a finite number > 0 and <= 1"),
    (["plan", "--price-per-worker-hour", "-3"], "argument --price-per-worker-hour: must be a finite number >= 0"),
    (["plan", "--max-prompt-tokens", "0"], "argument --max-prompt-tokens"),
    (["plan", "--speed-under-load", "fast"], "argument --speed-under-load: expected a number, got 'fast'"),
    (["bench", "ladder", "--slo-ttft", "0"], "argument --slo-ttft"),
    (["bench", "run", "--duration", "-5"], "argument --duration"),
    (["bench", "correctness", "--rate", "0"], "argument --rate"),
])
def test_a_figure_out_of_range_is_a_usage_error(tmp_path, capsys, argv, says):
    """SLOs, shares, prices, durations and rates out of range stop at the command line (exit 2)
    before any work starts, naming the argument."""
    from dpd.cli import main

    profile = tmp_path / "profile.json"
    profile.write_text(Profile(EngineProfile(), "measured", "test cpu").to_json())
    extra = ["--profile", str(profile), "--out", str(tmp_path / "o.yaml")] if argv[0] == "plan" else []
    with pytest.raises(SystemExit) as exited:
        main([*argv, *extra])
    assert exited.value.code == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "o.yaml").exists()


def test_plan_check_names_a_file_that_is_no_ladder_results(tmp_path, capsys):
    from dpd.cli import main

    profile = tmp_path / "profile.json"
    profile.write_text(Profile(EngineProfile(), "measured", "test cpu").to_json())
    for text, says in [("{}", "(no 'spec')"), ("[1]", "is not a `dpd bench ladder` results.json"), ("nope", "Expecting value")]:
        results = tmp_path / "results.json"
        results.write_text(text)
        assert main(["plan", "--profile", str(profile), "--check", str(results)]) == 2
        err = capsys.readouterr().err
        assert says in err and "is not a `dpd bench ladder` results.json" in err


def _ladder_results(tmp_path, spec, records, scenarios, rate, window=0):
    """A ``dpd bench ladder`` results.json of one round: ``records`` (RequestRecords) for each scenario."""
    from dataclasses import asdict

    results = {"spec": {**asdict(spec), "slo": asdict(spec.slo)}, "workloads": {"synthetic": "x"},
               "runs": [{"round": window, "window": window, "workload": "synthetic", "rate_rps": rate,
                         "scenario": scenario, "records": [asdict(r) for r in records]} for scenario in scenarios]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    return path


def test_the_simulator_is_checked_against_a_ladders_runs(tmp_path):
    """`dpd plan --check`: each run of a ladder results file replayed in the simulator."""
    from dpd.bench.ladder import LadderSpec
    from dpd.bench.stats import RequestRecord
    from dpd.bench.stats import Slo as BenchSlo
    from dpd.sim.check import check, table

    spec = LadderSpec(trace_dir="/nowhere", rates_rps=(0.5,), slo=BenchSlo(10, 0.2), workloads=("synthetic",),
                      num_requests=10, max_prompt_tokens=512)
    records = [RequestRecord(ttft_s=1.0 + i, e2e_s=3.0 + i, num_output_tokens=11, itls_s=[0.2] * 10, index=i)
               for i in range(10)]
    path = _ladder_results(tmp_path, spec, records, ("colocated", "dpd", "dpd-adaptive"), 0.5)
    rows = check(path, EngineProfile())
    assert [r.scenario for r in rows] == ["colocated", "dpd", "dpd-adaptive"]
    assert all(r.measured_attainment == 1.0 and 0 <= r.predicted_attainment <= 1 for r in rows)
    assert rows[0].ttft_p50[1] == pytest.approx(5.5)  # the measured median of 1..10 s
    assert "Attainment within 10 points in" in table(rows)
    low, high = rows[0].measured_intervals[0]  # the measured median's own interval holds it
    assert low <= 5.5 <= high and low < high
    assert "inside the measured figure's own 95% interval" in table(rows)


def test_the_check_sets_what_the_real_router_learned_beside_the_simulated_one(tmp_path):
    """A ladder records the router's GET /admin/workers at each run's start and end; the check
    shows the end's rates, split overhead and TTFT errors beside the simulated router's."""
    from dpd.bench.ladder import LadderSpec
    from dpd.bench.stats import RequestRecord
    from dpd.bench.stats import Slo as BenchSlo
    from dpd.sim.check import LEARNED, check, table

    spec = LadderSpec(trace_dir="/nowhere", rates_rps=(0.5,), slo=BenchSlo(10, 0.2), workloads=("synthetic",),
                      num_requests=10, max_prompt_tokens=512)
    records = [RequestRecord(ttft_s=1.0, e2e_s=3.0, num_output_tokens=11, itls_s=[0.2] * 10, index=i, path="disaggregated")
               for i in range(10)]
    path = _ladder_results(tmp_path, spec, records, ("dpd", "colocated"), 0.5)
    results = json.loads(path.read_text())
    real = {"pools": {"prefill": {"workers": [{"name": "prefill-0", "prefill_tokens_per_s": 321.0}]},
                      "decode": {"workers": [{"name": "decode-0", "prefill_tokens_per_s": 250.0,
                                              "decode_tokens_per_s": 31.5}]}},
            "routing": {"split_overhead_s": 0.21, "ttft_errors": {"direct": {"p90_s": None},
                                                                    "disaggregated": {"p90_s": 1.5}}}}
    results["runs"][0]["router_state"] = {"start": None, "end": real}
    path.write_text(json.dumps(results))
    pd, colocated = check(path, EngineProfile())
    assert [measured for _, measured in pd.learned] == [321.0, 250.0, 31.5, 0.21, None, 1.5]
    assert len(pd.learned) == len(LEARNED) and all(sim is not None for sim, _ in pd.learned[:4])
    assert pd.split_share[1] == 1.0 and colocated.learned == ()  # no router state recorded there
    text = table([pd, colocated])
    assert "What the router had learned" in text and "/ 321 |" in text and "/ — |" in text


def test_the_check_replays_an_endpoints_runs_on_one_simulated_endpoint_in_order(tmp_path, monkeypatch):
    """The real P/D endpoint serves a ladder's static and adaptive runs one after the other, its
    router keeping what it learned; so does the simulated one (the policy switched between runs),
    each run starting after the one before. The colocated endpoint is another."""
    import dpd.sim.check as sim_check
    from dpd.bench.ladder import LadderSpec
    from dpd.bench.stats import RequestRecord
    from dpd.bench.stats import Slo as BenchSlo

    spec = LadderSpec(trace_dir="/nowhere", rates_rps=(0.5,), slo=BenchSlo(10, 0.2), workloads=("synthetic",),
                      num_requests=6, max_prompt_tokens=512)
    records = [RequestRecord(ttft_s=1.0, e2e_s=3.0, num_output_tokens=11, itls_s=[0.2] * 10, index=i) for i in range(6)]
    path = _ladder_results(tmp_path, spec, records, ("dpd", "colocated", "dpd-adaptive", "dpd", "colocated"), 0.5)
    made, served, shapes = [], [], []
    real_init, real_replay, real_switch = SimEndpoint.__init__, SimEndpoint.replay, SimEndpoint.switch

    def init(self, policy, **kwargs):
        made.append(policy)
        real_init(self, policy, **kwargs)

    def replay(self, requests, progress=None):
        served.append((id(self), self.policy, requests[0][0], self.sim.now))
        shapes.append([(n, m) for _, n, m in requests])
        return real_replay(self, requests, progress)

    switched = []

    def switch(self, policy, threshold_tokens):
        switched.append((policy, threshold_tokens))
        real_switch(self, policy, threshold_tokens)

    monkeypatch.setattr(SimEndpoint, "__init__", init)
    monkeypatch.setattr(SimEndpoint, "replay", replay)
    monkeypatch.setattr(SimEndpoint, "switch", switch)
    rows = sim_check.check(path, EngineProfile())
    assert [r.scenario for r in rows] == ["dpd", "colocated", "dpd-adaptive", "dpd", "colocated"]
    assert made == ["threshold", "colocated"]  # one per endpoint
    pd = [entry for entry in served if entry[0] == served[0][0]]
    # before each run its warm-ups (ladder.warm_every_worker, then ladder.warm_up under the run's policy)
    warm = ["threshold", "threshold"]
    assert [policy for _, policy, _, _ in pd] == [*warm, "threshold", "threshold", *warm, "adaptive", "adaptive",
                                                   *warm, "threshold", "threshold"]
    # the static split's warm-ups at thresholds past the longest prompt and 0, then the run's own
    run = {"threshold": spec.threshold_tokens, "adaptive": spec.adaptive_floor_tokens}
    assert switched == [(p, t) for policy in ("threshold", "adaptive", "threshold")
                        for p, t in (("threshold", 513), ("threshold", 0), (policy, run[policy]))]
    colocated = [entry for entry in served if entry[0] != served[0][0]]
    assert [policy for _, policy, _, _ in colocated] == ["colocated"] * 4  # a warm-up and the run, twice
    for replays in (pd, colocated):
        assert all(first_arrival >= now + sim_check.RUN_GAP_S for _, _, first_arrival, now in replays)
        assert all(b[3] >= a[2] for a, b in zip(replays, replays[1:]))  # each after the one before, on one clock
    assert shapes[:3] == [[(512, 4)], [(512, 4)], [(512, 4), (512, 4), (64, 4), (64, 4)]]  # the ladder's warm-ups
    # a ladder that recorded only the settling's warm-up gets only that
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "warm_ups": ["settle"]}))
    served.clear()
    switched.clear()
    sim_check.check(path, EngineProfile())
    assert len(served) == 10 and all(policy != "threshold" or t != 0 for policy, t in switched)
    with pytest.raises(ValueError):
        real_switch(SimEndpoint("colocated", profile=EngineProfile()), "adaptive", 0)


def test_a_run_with_nothing_measured_is_left_out_of_the_check(tmp_path):
    from dpd.bench.ladder import LadderSpec
    from dpd.bench.stats import Slo as BenchSlo
    from dpd.sim.check import check

    spec = LadderSpec(trace_dir="/nowhere", rates_rps=(0.5,), slo=BenchSlo(10, 0.2), workloads=("synthetic",),
                      num_requests=10, max_prompt_tokens=512)
    assert check(_ladder_results(tmp_path, spec, [], ("colocated",), 0.5), EngineProfile()) == []


def test_a_prediction_agrees_within_20_percent_or_inside_the_measured_interval():
    from dpd.sim.check import Comparison, inside, table, within

    assert within((1.15, 1.0)) and within((0.85, 1.0)) and not within((0.7, 1.0)) and not within((1.0, 0.0))
    assert inside((0.7, 1.0), (0.6, 1.4)) and not inside((0.5, 1.0), (0.6, 1.4))
    # failed requests make a measured P99 (or its interval's top) infinite: no agreement there
    assert not inside((5.0, 1.0), (0.6, float("inf"))) and not inside((5.0, float("inf")), (0.6, 9.0))
    rows = [Comparison("w", "colocated", 1.0, 1.0, 1.0, (0.7, 1.0), (2.0, 1.0), (1.0, 1.0),
                       ((0.6, 1.4), (0.9, 1.1), (0.9, 1.1)))]
    text = table(rows)
    assert "0.70× (in its interval)" in text and "| 2.00× |" in text
    p50, p99 = (line for line in text.splitlines() if line.startswith(("TTFT P50", "TTFT P99")))
    assert p50.startswith("TTFT P50 within 20% of measured in 0 of 1 runs;") and p50.endswith("requests) in 1.")
    assert p99.startswith("TTFT P99 within 20% of measured in 0 of 1 runs;") and p99.endswith("requests) in 0.")


def test_the_check_counts_points_whose_measurement_moved_between_rounds_and_compares_splits():
    from dpd.sim.check import Comparison, round_spread, table

    def row(scenario, ttft_p50, split=(0.5, 0.5)):
        return Comparison("w", scenario, 1.0, 1.0, 1.0, (1.0, ttft_p50), (2.0, 2.0), (0.1, 0.1), (), split)

    rows = [row("dpd-adaptive", 1.0, (0.8, 0.2)), row("dpd-adaptive", 1.3, (0.6, 0.5)),  # moved 1.3×: past 20%
            row("colocated", 1.0, (0.0, 0.0)), row("colocated", 1.1, (0.0, 0.0)),  # 1.1×: within
            row("dpd", 1.0)]  # one round: not counted
    assert round_spread(rows) == {"TTFT P50": (1, 2), "TTFT P99": (0, 2), "ITL P99": (0, 2)}
    text = table(rows)
    assert "| 80% / 20% |" in text
    assert "moved more than 20% between its own rounds at: TTFT P50 1 of 2 points; TTFT P99 0 of 2" in text
    assert "more than 20 points from the real router's in 1 of 2 runs" in text
    failed_once = [row("colocated", 1.0), row("colocated", float("inf"))]  # a failure in one round only
    assert round_spread(failed_once)["TTFT P50"] == (1, 1)
    assert "between its own rounds" not in table([row("colocated", 1.0)])


def test_the_check_simulates_the_adaptive_settings_the_ladder_ran_with(tmp_path, monkeypatch):
    """A ladder run with a stall weight, a stall limit or a TTFT target is replayed with them."""
    import dpd.sim.check as sim_check
    from dpd.bench.ladder import LadderSpec
    from dpd.bench.stats import RequestRecord
    from dpd.bench.stats import Slo as BenchSlo

    spec = LadderSpec(trace_dir="/nowhere", rates_rps=(0.5,), slo=BenchSlo(10, 0.2), workloads=("synthetic",),
                      num_requests=4, max_prompt_tokens=512, adaptive_stall_weight=0.25, adaptive_max_stall_s=0.04,
                      adaptive_ttft_target_s=3.0)
    records = [RequestRecord(ttft_s=1.0, e2e_s=3.0, num_output_tokens=11, itls_s=[0.2] * 10, index=i) for i in range(4)]
    path = _ladder_results(tmp_path, spec, records, ("dpd-adaptive",), 0.5)
    built = []
    real = sim_check.SimEndpoint

    def recording(*args, **kwargs):
        built.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(sim_check, "SimEndpoint", recording)
    [row] = sim_check.check(path, EngineProfile())
    assert built[0]["stall_weight"] == 0.25 and built[0]["max_stall_s"] == 0.04
    assert built[0]["slo"].ttft_s == 3.0 and built[0]["slo"].tpot_s == 0.2
    assert row.measured_attainment == 1.0  # judged against the ladder's SLO (10 s), not the planning target


def test_the_check_replays_each_run_on_its_own_request_set(tmp_path, monkeypatch):
    """A ladder with --windows ran round r on request set r mod windows: the check replays that set."""
    import dpd.sim.check as sim_check
    from dpd.bench.ladder import LadderSpec, at_rate, request_set
    from dpd.bench.stats import RequestRecord
    from dpd.bench.stats import Slo as BenchSlo

    spec = LadderSpec(trace_dir="/nowhere", rates_rps=(0.5,), slo=BenchSlo(10, 0.2), workloads=("synthetic",),
                      num_requests=6, max_prompt_tokens=512, rounds=2, windows=2)
    records = [RequestRecord(ttft_s=1.0, e2e_s=3.0, num_output_tokens=11, itls_s=[0.2] * 10, index=i) for i in range(6)]
    path = _ladder_results(tmp_path, spec, records, ("colocated",), 0.5, window=1)
    replayed = []
    real = sim_check.SimEndpoint.replay

    def recording(self, requests):
        replayed.append(list(requests))
        return real(self, requests)

    monkeypatch.setattr(sim_check.SimEndpoint, "replay", recording)
    sim_check.check(path, EngineProfile())
    sets = [[(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens)
             for r in at_rate(request_set(spec, "synthetic", window=k)[0], 0.5)] for k in (0, 1)]
    assert sets[0] != sets[1]
    [warm_up, got] = replayed  # the run begins RUN_GAP_S after its warm-up
    assert [(n, m) for _, n, m in got] == [(n, m) for _, n, m in sets[1]]
    start = got[0][0] - sets[1][0][0]
    assert start >= warm_up[-1][0] + sim_check.RUN_GAP_S
    assert [t - start for t, _, _ in got] == pytest.approx([t for t, _, _ in sets[1]])


def test_a_profile_under_load_is_slower_by_the_factor():
    from dpd.sim.profile import under_load

    engine = EngineProfile(prefill_tokens_per_s=800, step_overhead_s=0.02, decode_s_per_stream=0.001, kv_transfer_s=0.05)
    slowed = under_load(engine, 0.8)
    assert slowed.prefill_tokens_per_s == pytest.approx(640)
    assert slowed.step_overhead_s == pytest.approx(0.025) and slowed.decode_s_per_stream == pytest.approx(0.00125)
    assert slowed.kv_transfer_s == 0.05 and slowed.max_batched_tokens == engine.max_batched_tokens
    with pytest.raises(ValueError):
        under_load(engine, 0)


def test_the_speed_under_load_is_fitted_to_a_ladder(tmp_path):
    """A ladder whose runs all missed the SLO where an idle-speed simulation meets it: a slower
    speed fits better, and the factors come back best first."""
    from dpd.bench.ladder import LadderSpec
    from dpd.bench.stats import RequestRecord
    from dpd.bench.stats import Slo as BenchSlo
    from dpd.sim.check import SPEEDS, fit_speed

    spec = LadderSpec(trace_dir="/nowhere", rates_rps=(2.0,), slo=BenchSlo(10, 0.2), workloads=("synthetic",),
                      num_requests=40, max_prompt_tokens=768)
    records = [RequestRecord(ttft_s=20.0, e2e_s=30.0, num_output_tokens=11, itls_s=[1.0] * 10, index=i) for i in range(40)]
    path = _ladder_results(tmp_path, spec, records, ("colocated",), 2.0)
    fits = fit_speed(path, EngineProfile(prefill_tokens_per_s=700, step_overhead_s=0.025, decode_s_per_stream=0.001))
    assert sorted(speed for speed, _ in fits) == sorted(SPEEDS)
    assert [error for _, error in fits] == sorted(error for _, error in fits)
    error_at = dict(fits)
    assert error_at[0.5] < error_at[1.0]


def test_the_split_is_measured_under_the_static_split_and_the_policy_restored(monkeypatch):
    """``dpd profile --router``: under the adaptive policy a threshold of 0 does not force a split
    (it may run the prompt whole), so the profile switches to the static split while it measures
    and restores the router's own policy and threshold afterwards."""
    import dpd.sim.profile as profile

    calls = []
    state = {"policy": "adaptive", "threshold_tokens": 512, "split_overhead_samples": 0}

    class Response:
        def __init__(self, body=None):
            self.body = body or {}

        def json(self):
            return self.body

        def raise_for_status(self):
            pass

    def get(url, timeout):
        return Response({"routing": dict(state)})

    def put(url, json, timeout):
        calls.append((url.rsplit("/", 1)[1], json))
        return Response()

    def post(url, timeout, json):
        state["split_overhead_samples"], state["split_overhead_s"] = 4, 0.09
        return Response()

    monkeypatch.setattr(profile.requests, "get", get)
    monkeypatch.setattr(profile.requests, "put", put)
    monkeypatch.setattr(profile.requests, "post", post)
    assert profile.measure_split("http://router", "m", seed=0, progress=lambda *_: None) == 0.09
    assert calls == [("threshold", {"threshold_tokens": 0}), ("policy", {"policy": "threshold"}),
                     ("threshold", {"threshold_tokens": 512}), ("policy", {"policy": "adaptive"})]


def test_the_speed_benchmarks_cluster_load_is_the_trace_replicated_to_fill_the_workers():
    from dpd.sim import speed

    profile = EngineProfile(prefill_tokens_per_s=100.0, step_overhead_s=1e-12, decode_s_per_stream=0.0)
    trace = [(float(t), 100, 1) for t in range(0, 600, 10)]  # 10 minutes, one second of work every 10 s (and 1e-12)
    hour = speed.replicated(trace, 20, profile, hours=1.0, utilization=0.5)
    # an hour is the trace six times (360 requests, 360 s of work); 20 workers at 50% need 36,000 s: 100 copies
    assert len(hour) == 360 * 100
    assert all(b[0] >= a[0] for a, b in zip(hour, hour[1:])) and hour[-1][0] < 3600 + 1
    assert sum(speed.work_s(r, profile) for r in hour) == pytest.approx(0.5 * 20 * 3600)
    with pytest.raises(ValueError):
        speed.replicated([], 1, profile)
