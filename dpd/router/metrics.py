"""The router's Prometheus metrics, in a registry owned by one router instance.

Latency histograms carry the ``path`` label (disaggregated / direct), so TTFT and ITL of the
two paths can be compared, and the ``class`` label of ``router.slo`` (slo.py) so a chat
request's ITL is not averaged with a document's; ``dpd_slo_requests_total`` says which met the
SLO (goodput). Buckets span a GPU's milliseconds and a CPU's seconds, so a P99 reads either.
The P/D hops have their own histograms so an operator can tell a slow prefill from a slow KV
pull. ``dpd_pd_stalls_total`` counts decode hops whose first token
missed the deadline (the upstream NIXL stall), each one served again on the direct path.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120)
ITL_BUCKETS_S = (0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5, 10)
TOKEN_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 16384, 32768)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "dpd_requests", "Finished requests by path and outcome.", ["path", "outcome"], registry=r
        )
        self.decisions = Counter("dpd_decisions", "Decider outcomes.", ["path", "reason"], registry=r)
        self.fallbacks = Counter(
            "dpd_fallbacks", "Disaggregated requests served on the direct path instead.", ["reason"], registry=r
        )
        self.pd_stalls = Counter(
            "dpd_pd_stalls",
            "Decode hops whose first token missed the deadline, by decoder and prefiller.",
            ["decoder", "prefiller"],
            registry=r,
        )
        self.ttft = Histogram("dpd_ttft_seconds", "Time to first token.", ["path", "class"], buckets=LATENCY_BUCKETS_S,
                              registry=r)
        self.itl = Histogram("dpd_itl_seconds", "Inter-token latency (one gap per streamed chunk).", ["path", "class"],
                             buckets=ITL_BUCKETS_S, registry=r)
        self.slo_requests = Counter(
            "dpd_slo_requests", "Requests judged by router.slo, by path, class, target (ttft, tpot, all = both) and "
            "outcome (met, missed; a failed request missed).", ["path", "class", "slo", "outcome"], registry=r,
        )
        self.e2e = Histogram("dpd_e2e_seconds", "End-to-end request latency.", ["path"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.prefill_hop = Histogram(
            "dpd_prefill_hop_seconds", "Prefill hop latency (request to KV ready).", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.decode_hop_first_token = Histogram(
            "dpd_decode_hop_first_token_seconds",
            "Decode hop: request to first token (includes the KV pull on the disaggregated path).",
            ["path"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.prompt_tokens = Histogram(
            "dpd_request_prompt_tokens", "Prompt tokens per request (router's count).", ["path"], buckets=TOKEN_BUCKETS, registry=r
        )
        self.output_tokens_total = Counter("dpd_output_tokens", "Generated tokens.", ["path"], registry=r)
        self.in_flight = Gauge("dpd_worker_in_flight", "Outstanding requests per worker.", ["pool", "worker"], registry=r)
        self.worker_healthy = Gauge("dpd_worker_healthy", "1 if the worker passes health checks.", ["pool", "worker"], registry=r)
        self.threshold = Gauge("dpd_routing_threshold_tokens", "Current routing threshold.", registry=r)
        self.recommended_threshold = Gauge(
            "dpd_recommended_threshold_tokens", "The static threshold the router's measurements favour (adaptive.py).", registry=r
        )
        self.adaptive_policy = Gauge("dpd_routing_policy_adaptive", "1 while the adaptive policy is in force, 0 threshold.", registry=r)
        self.prefill_rate = Gauge(
            "dpd_worker_prefill_tokens_per_second", "Measured prefill rate per worker (EWMA).", ["pool", "worker"], registry=r
        )
        self.queued_prefill_tokens = Gauge(
            "dpd_worker_queued_prefill_tokens", "Prompt tokens sent to the worker whose prefill has not finished.",
            ["pool", "worker"], registry=r,
        )
        self.queued_prefills = Gauge(
            "dpd_worker_queued_prefills", "Requests sent to the worker whose prefill has not finished.",
            ["pool", "worker"], registry=r,
        )
        self.streams = Gauge("dpd_worker_streams", "Requests decoding on the worker.", ["pool", "worker"], registry=r)
        self.client_disconnects = Counter(
            "dpd_client_disconnects", "Requests aborted because the client went away.", ["path"], registry=r
        )

        self.connection_refusals = Counter(
            "dpd_connection_limit_refusals", "Requests refused with 503 past router.maxConnections (open connections "
            "or requests in progress).", registry=r
        )

        # Admission, per pool.
        self.shed = Counter(
            "dpd_shed_requests", "Requests refused with 429 by admission control.", ["pool", "reason"], registry=r
        )
        self.queue_depth = Gauge("dpd_admission_queue_depth", "Requests waiting for admission.", ["pool"], registry=r)
        self.queue_wait = Histogram(
            "dpd_admission_wait_seconds", "Time admitted requests waited in the queue.", ["pool"],
            buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.admitted_in_flight = Gauge(
            "dpd_admission_in_flight", "Requests holding an admission slot.", ["pool"], registry=r
        )
        # Breakers, retries, drain.
        self.breaker_state = Gauge(
            "dpd_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open (worker \"*\" = the pool's own).",
            ["pool", "worker"], registry=r,
        )
        self.breaker_transitions = Counter(
            "dpd_breaker_transitions", "Circuit breaker state changes, by the state entered.", ["pool", "worker", "state"], registry=r
        )
        self.retries = Counter("dpd_retries", "Requests retried on another worker before any byte was sent.", ["pool"], registry=r)
        self.migrations = Counter(
            "dpd_migrations", "Streams that broke after their first token, by how (outcomes.StreamBreak) and what followed: "
            "migrated (continued on another worker) or not_migrated_<why>.", ["reason", "outcome"], registry=r,
        )
        self.draining = Gauge("dpd_worker_draining", "1 while the worker is being drained.", ["pool", "worker"], registry=r)
        # Tenants.
        self.tenant_requests = Counter(
            "dpd_tenant_requests", "Requests per tenant by outcome (HTTP status or ok).", ["tenant", "outcome"], registry=r
        )
        self.tenant_rate_limited = Counter(
            "dpd_tenant_rate_limited", "Requests refused by a tenant's token bucket.", ["tenant", "limit"], registry=r
        )
        self.tenant_prompt_tokens = Counter(
            "dpd_tenant_prompt_tokens", "Prompt tokens admitted per tenant (router's count).", ["tenant"], registry=r
        )
        self.tenant_output_tokens = Counter(
            "dpd_tenant_output_tokens", "Generated tokens per tenant (the answers' usage), metered against "
            "tenants[].outputTokensPerSecond.", ["tenant"], registry=r,
        )
        # Prefix caching, per worker (vLLM's usage.prompt_tokens_details): hit rate = cached / served.
        self.prompt_tokens_served = Counter(
            "dpd_worker_prompt_tokens", "Prompt tokens of the requests a worker served (its usage).", ["pool", "worker"],
            registry=r,
        )
        self.prompt_tokens_cached = Counter(
            "dpd_worker_prompt_cached_tokens", "Of those, the tokens its prefix cache held (usage.prompt_tokens_details."
            "cached_tokens; on a split, the prefiller's hits).", ["pool", "worker"], registry=r,
        )
        self.auth_failures = Counter("dpd_auth_failures", "Requests refused with 401.", ["reason"], registry=r)
        # KV that no decode hop took, and KV transfers the engine reports lost (kvwatch.py).
        self.kv_abandoned = Counter(
            "dpd_kv_abandoned", "Prefills whose KV no decode hop took, by why; the prefiller holds the blocks until "
            "kvTransferSpec.kvLeaseDurationS ends.", ["prefiller", "reason"], registry=r,
        )
        self.kv_transfer_failures = Counter(
            "dpd_kv_transfer_failures", "KV transfers a worker's engine counted as lost (vLLM's NIXL counters): "
            "failed_pull (recomputed or failed on the decoder), lease_expired, failed_notification.",
            ["pool", "worker", "kind"], registry=r,
        )
        # Shadow traffic (shadow.py): the other endpoint's latency beside ours.
        self.shadow_requests = Counter(
            "dpd_shadow_requests", "Requests mirrored to router.shadow.url, by outcome (ok, error, timeout, dropped, "
            "cancelled).", ["outcome"], registry=r,
        )
        self.shadow_ttft = Histogram("dpd_shadow_ttft_seconds", "The shadow target's time to first token.", ["class"],
                                     buckets=LATENCY_BUCKETS_S, registry=r)
        self.shadow_itl = Histogram("dpd_shadow_itl_seconds", "The shadow target's inter-token latency.", ["class"],
                                    buckets=ITL_BUCKETS_S, registry=r)
        # KV transfers as the engine measured them (vLLM's NIXL histograms' sums and counts, kvwatch.py).
        self.kv_transfers = Counter(
            "dpd_kv_transfers", "KV transfers a worker's engine completed (vllm:nixl_xfer_time_seconds_count).",
            ["pool", "worker"], registry=r,
        )
        self.kv_transfer_seconds = Counter(
            "dpd_kv_transfer_seconds", "Their summed duration (vllm:nixl_xfer_time_seconds_sum): mean = rate of this "
            "÷ rate of dpd_kv_transfers_total.", ["pool", "worker"], registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "dpd_kv_transfer_bytes", "KV bytes they moved (vllm:nixl_bytes_transferred_sum).", ["pool", "worker"],
            registry=r,
        )

    WORKER_LABELS = ("worker", "decoder", "prefiller")  # labels that name a worker

    def forget_worker(self, name: str) -> int:
        """Remove every series that names worker ``name`` (a pod gone for good: its series would
        otherwise stay forever, and pods come and go); returns how many were removed."""
        removed = 0
        for collector in list(self.registry._collector_to_names):  # every metric of this router
            label_names = getattr(collector, "_labelnames", ())
            if not any(label in label_names for label in self.WORKER_LABELS):
                continue
            for family in collector.collect():
                for sample in family.samples:
                    if any(sample.labels.get(label) == name for label in self.WORKER_LABELS):
                        try:
                            collector.remove(*(sample.labels[label] for label in label_names))  # type: ignore[attr-defined]
                            removed += 1
                        except KeyError:  # a counter's _created sample, already removed with its _total
                            pass
        return removed

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
