"""The pure parts of ``dpd bench correctness``: prompts, output comparison, stall accounting."""

from __future__ import annotations

import pytest

from dpd.bench.correctness import (
    CorrectnessSpec,
    ProbeResult,
    account_stalls,
    compare_outputs,
    first_difference,
    make_probes,
    make_prompt,
    router_snapshot,
)


class WordTokenizer:
    """One token per word: enough to check lengths and determinism without the model."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.vocab = getattr(self, "vocab", {})
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        words = {i: w for w, i in self.vocab.items()}
        return " ".join(words[i] for i in ids)


def test_prompts_are_deterministic_distinct_and_sized():
    tok = WordTokenizer()
    assert make_prompt(tok, 100, seed=1) == make_prompt(WordTokenizer(), 100, seed=1)
    assert make_prompt(tok, 100, seed=1) != make_prompt(tok, 100, seed=2)
    # 100 - 12 words of text plus the fixed head ("Request 1.") and tail (7 words).
    assert len(make_prompt(tok, 100, seed=1).split()) == 88 + 2 + 7


def test_probes_same_list_every_time_with_both_sizes():
    spec = CorrectnessSpec(trace_dir="", num_short=3, num_long=2, short_tokens=20, long_tokens=60)
    a, b = make_probes(WordTokenizer(), spec), make_probes(WordTokenizer(), spec)
    assert a == b
    assert sorted(p.size for p in a) == ["long", "long", "short", "short", "short"]
    assert [p.probe_id for p in a] == list(range(5))
    assert len({p.prompt for p in a}) == 5


def _probe(i, text, path="direct", reason="", ttft=0.5, error=""):
    return ProbeResult(i, "long" if path != "direct" else "short", text=text, path=path, fallback_reason=reason,
                       ttft_s=ttft, error=error)


@pytest.mark.parametrize("a, b, at", [("abc", "abc", 3), ("abc", "abd", 2), ("ab", "abc", 2), ("", "x", 0)])
def test_first_difference(a, b, at):
    assert first_difference(a, b) == at


def test_compare_outputs_counts_per_path_and_reports_diffs():
    served = [_probe(0, "same"), _probe(1, "same", "disaggregated"), _probe(2, "one two", "disaggregated"),
              _probe(3, "x", "fallback", "decode_stall"), _probe(4, "", error="HTTP 503")]
    reference = [_probe(0, "same"), _probe(1, "same"), _probe(2, "one too"), _probe(3, "x"), _probe(4, "")]
    out = compare_outputs(served, reference)
    assert out["by_path"] == {"direct": {"n": 2, "identical": 1}, "disaggregated": {"n": 2, "identical": 1},
                              "fallback": {"n": 1, "identical": 1}}
    assert [d["probe_id"] for d in out["diffs"]] == [2, 4]
    assert out["diffs"][0]["at_char"] == 5 and out["diffs"][0]["served"] == "wo"
    assert out["diffs"][1]["errors"] == ["HTTP 503"]  # an error is never "identical", even to ""
    assert not out["is_ok"] and out["num_identical"] == 3


def test_compare_outputs_missing_reference_is_a_diff():
    out = compare_outputs([_probe(0, "a")], [])
    assert not out["is_ok"] and out["diffs"][0]["errors"] == ["missing"]


METRICS = """\
# TYPE dpd_pd_stalls_total counter
dpd_pd_stalls_total{{decoder="decode-0",prefiller="prefill-0"}} {stalls}
# TYPE dpd_fallbacks_total counter
dpd_fallbacks_total{{reason="decode_stall"}} {stall_fallbacks}
dpd_fallbacks_total{{reason="prefill_error"}} {other_fallbacks}
# TYPE dpd_decode_hop_first_token_seconds histogram
dpd_decode_hop_first_token_seconds_bucket{{le="3.0",path="disaggregated"}} {within}
dpd_decode_hop_first_token_seconds_bucket{{le="5.0",path="disaggregated"}} {within}
dpd_decode_hop_first_token_seconds_bucket{{le="7.5",path="disaggregated"}} {hops}
dpd_decode_hop_first_token_seconds_bucket{{le="+Inf",path="disaggregated"}} {hops}
dpd_decode_hop_first_token_seconds_count{{path="disaggregated"}} {hops}
dpd_decode_hop_first_token_seconds_sum{{path="disaggregated"}} 1.0
dpd_decode_hop_first_token_seconds_bucket{{le="5.0",path="direct"}} 1.0
dpd_decode_hop_first_token_seconds_bucket{{le="+Inf",path="direct"}} 9.0
dpd_decode_hop_first_token_seconds_count{{path="direct"}} 9.0
"""


def _snapshot(stalls=0, stall_fallbacks=None, other_fallbacks=0, hops=0, late=0):
    text = METRICS.format(stalls=stalls, stall_fallbacks=stalls if stall_fallbacks is None else stall_fallbacks,
                          other_fallbacks=other_fallbacks, within=hops - late, hops=hops)
    return router_snapshot(text, deadline_s=5.0)


def test_router_snapshot_reads_counters_and_late_disaggregated_hops_only():
    snap = _snapshot(stalls=2, other_fallbacks=1, hops=10, late=3)
    assert snap == {"pd_stalls": 2, "fallbacks": 3, "fallbacks_decode_stall": 2,
                    "disagg_decode_hops": 10, "disagg_decode_hops_over_deadline": 3}  # direct's 8 late hops ignored


# (client-seen probes, load paths, counters after; before is all zero) -> unrecorded, failed checks
STALL_CASES = [
    ("quiet run", [_probe(0, "", "disaggregated")], ["direct"], dict(hops=1), 0, []),
    ("stall seen and counted", [_probe(0, "", "fallback", "decode_stall", ttft=9)], [], dict(stalls=1, hops=0), 0, []),
    ("more counted than seen (load's stalls)", [_probe(0, "", "fallback", "decode_stall")], ["fallback"],
     dict(stalls=2, hops=3), 0, []),
    ("stall seen, not counted", [_probe(0, "", "fallback", "decode_stall")], [], dict(stalls=0, stall_fallbacks=1), 1,
     ["stalls_counted_ge_client_seen", "every_stall_served_direct"]),
    ("load fallback not counted", [], ["fallback", "direct"], dict(), 1, ["fallbacks_counted_ge_client_seen"]),
    ("late hop never cut", [_probe(0, "", "disaggregated", ttft=8)], [], dict(hops=4, late=1), 1,
     ["no_uncut_decode_hop_over_deadline"]),
]


@pytest.mark.parametrize("name, probes, load_paths, after, unrecorded, failed", STALL_CASES, ids=[c[0] for c in STALL_CASES])
def test_account_stalls(name, probes, load_paths, after, unrecorded, failed):
    out = account_stalls(probes, load_paths, _snapshot(), _snapshot(**after), deadline_s=5.0)
    assert out["num_unrecorded"] == unrecorded
    assert sorted(k for k, ok in out["checks"].items() if not ok) == sorted(failed)
    assert out["is_ok"] == (not failed)


def test_account_stalls_uses_deltas_and_flags_suspects():
    before = _snapshot(stalls=5, hops=20, late=2)  # earlier history, not this window's
    probes = [_probe(0, "", "disaggregated", ttft=6.0), _probe(1, "", "disaggregated", ttft=1.0)]
    out = account_stalls(probes, [], before, _snapshot(stalls=5, hops=22, late=2), deadline_s=5.0)
    assert out["is_ok"] and out["counter_deltas"]["disagg_decode_hops"] == 2
    assert out["suspect_probe_ids"] == [0]  # TTFT includes the prefill hop: reported, not failed
