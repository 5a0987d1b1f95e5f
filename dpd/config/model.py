"""The typed, immutable model of an ``InferenceEndpointConfig``.

Field names follow the reference resource (SageMaker HyperPod's ``InferenceEndpointConfig``,
``pdSpec.prefillSpec``, ``pdSpec.decodingSpec``, ``pdSpec.routingThreshold`` …) so an existing
resource is accepted as is; dpd's own additions sit beside them. Every object is frozen: the
config is parsed once at the edge (``dpd.config.load``) and components receive only their part.

Defaults live here and nowhere else; CLI flags read them from these classes.
"""

from __future__ import annotations

import os
import re
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

API_VERSION: Final = "inference.dpd.dev/v1"
# The reference resource's group; accepted so a user's existing resource loads unchanged.
REFERENCE_API_VERSION = "inference.sagemaker.aws.amazon.com/v1"
KIND: Final = "InferenceEndpointConfig"
DEFAULT_ROUTING_THRESHOLD_TOKENS = 2048


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class ResourceRequirements(_Frozen):
    """Kubernetes-style requests/limits (``cpu``, ``memory``, ``nvidia.com/gpu``, EFA …).

    Used as is when rendering for a cluster; locally only the GPU count is read (cores come from a pool's ``cpusPerWorker``).
    """

    requests: dict[str, str | int] = Field(default_factory=dict)
    limits: dict[str, str | int] = Field(default_factory=dict)


GPU_RESOURCE = "nvidia.com/gpu"


class PoolSpec(_Frozen):
    """One pool of identical vLLM workers (``prefillSpec`` or ``decodingSpec``)."""

    replicas: int = Field(default=1, ge=0, le=64)
    args: tuple[str, ...] = Field(default=(), description="Extra vLLM engine arguments.")
    nodeSelector: dict[str, str] = Field(default_factory=dict)
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    tensorParallelSize: int = Field(default=1, ge=1, le=64)
    cpusPerWorker: int = Field(
        default=1, ge=1, le=256, description="Local launcher: cores each worker is pinned to."
    )
    kvCacheGiB: float = Field(
        default=2.0, gt=0, le=1024, description="KV cache per worker on CPU workers (VLLM_CPU_KVCACHE_SPACE); on GPU "
        "workers vLLM sizes it from gpuMemoryUtilization."
    )
    gpuMemoryUtilization: float | None = Field(
        default=None, gt=0, le=1, description="GPU workers: the share of each GPU's memory vLLM may use (weights, "
        "activations, KV cache); unset = vLLM's default (0.9). Not used on CPU workers."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for workers.")

    @property
    def gpus_requested(self) -> int:
        """GPUs the pool's ``resources`` ask for per worker (``nvidia.com/gpu``), 0 if none."""
        value = self.resources.limits.get(GPU_RESOURCE, self.resources.requests.get(GPU_RESOURCE, 0))
        try:
            return int(value)
        except (TypeError, ValueError):
            return 0

    @property
    def gpus_per_worker(self) -> int:
        """GPUs one worker of this pool runs on: what ``resources`` asks for, else its tensor-parallel size."""
        return self.gpus_requested or self.tensorParallelSize

    @model_validator(mode="after")
    def _gpus_cover_tp(self) -> PoolSpec:
        if self.gpus_requested and self.gpus_requested < self.tensorParallelSize:
            raise ValueError(f"resources ask for {self.gpus_requested} {GPU_RESOURCE} per worker but tensorParallelSize "
                             f"is {self.tensorParallelSize}: each worker needs at least as many GPUs as its TP size")
        return self

    @field_validator("args")
    @classmethod
    def _no_managed_args(cls, args: tuple[str, ...]) -> tuple[str, ...]:
        return no_managed_args(args)


MANAGED_ARGS = frozenset({"--port", "--host", "--kv-transfer-config", "--model", "--served-model-name"})


def no_managed_args(args: tuple[str, ...]) -> tuple[str, ...]:
    """Engine arguments dpd sets itself (the port probes and the router use, the model, the KV
    connector) may not be overridden: ``ValueError`` naming the first."""
    for arg in args:
        if arg.split("=", 1)[0] in MANAGED_ARGS:
            raise ValueError(f"{arg.split('=', 1)[0]} is set by dpd; remove it from args")
    return args


SHA256_PATTERN = r"^[0-9a-f]{64}$"


class PoolAdmissionSpec(_Frozen):
    """Admission control of one pool: requests using it at once, and a bounded FIFO wait queue."""

    maxInFlight: int = Field(ge=1, description="Requests using the pool at once; more wait in the queue.")
    maxQueue: int = Field(default=64, ge=0, description="Requests that may wait; past that, 429.")
    queueTimeoutS: float = Field(default=30.0, gt=0, description="Longest wait in the queue before a 429.")


class AdmissionSpec(_Frozen):
    """Per-pool admission (unset = no limit). Every request uses the decode pool; disaggregated
    requests also use the prefill pool for their prefill hop."""

    prefill: PoolAdmissionSpec | None = None
    decode: PoolAdmissionSpec | None = None


class BreakerSpec(_Frozen):
    """Circuit breakers: per worker (closed / open / half-open) and for the prefill pool."""

    failureThreshold: int = Field(
        default=3, ge=1, description="Consecutive failed requests, or health probes that timed out, "
        "that open a worker's breaker (a refused connection or a failed health probe opens it at once)."
    )
    openS: float = Field(default=5.0, gt=0, description="How long a breaker stays open before a trial (half-open).")
    poolFailureThreshold: int = Field(
        default=5, ge=1, description="Consecutive failed disaggregated attempts (prefill errors, timeouts, "
        "decode stalls) that open the prefill pool's breaker: long prompts then go direct."
    )


class RetrySpec(_Frozen):
    """Retries of a request on another worker: only before any byte reached the client."""

    maxAttempts: int = Field(default=3, ge=1, le=10, description="Attempts on the direct path, the first included.")
    backoffBaseS: float = Field(default=0.05, ge=0, description="First backoff; doubles per attempt, full jitter.")
    backoffMaxS: float = Field(default=1.0, ge=0, description="Cap of one backoff.")


class MigrationSpec(_Frozen):
    """A request whose worker fails mid-stream continues on another worker (``router/migrate.py``)."""

    maxMigrations: int = Field(
        default=2, ge=0, le=10, description="Times one request may move to another worker after its stream broke "
        "(connection lost, worker exit, no chunk within streamIdleTimeoutS, an error event); 0 = never (the client "
        "gets an error event, and workers are not asked for token ids)."
    )


class TenantSpec(_Frozen):
    """A tenant: its API keys (stored hashed), its rate limits and, optionally, workers of its own."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    apiKeySha256: tuple[str, ...] = Field(
        min_length=1, description="SHA-256 (hex) of each API key; `dpd keys new` makes a key and its hash."
    )
    requestsPerSecond: float | None = Field(default=None, gt=0, description="Token bucket rate on requests (unset = none).")
    burstRequests: int | None = Field(default=None, ge=1, description="Bucket size on requests; default max(1, rate).")
    promptTokensPerSecond: float | None = Field(
        default=None, gt=0, description="Token bucket rate on prompt tokens, as the router's tokenizer counts them."
    )
    burstPromptTokens: int | None = Field(default=None, ge=1, description="Bucket size on prompt tokens; default 10 s of rate.")
    outputTokensPerSecond: float | None = Field(
        default=None, gt=0, description="Token bucket rate on generated tokens, metered from each answer's usage after "
        "it ends: a tenant whose bucket is empty is refused (429) until it refills."
    )
    burstOutputTokens: int | None = Field(default=None, ge=1, description="Bucket size on generated tokens; default 10 s of rate.")
    maxConcurrentRequests: int | None = Field(
        default=None, ge=1, description="Requests of this tenant served at once (streams included); past it a 429 at "
        "once, before the body is read (unset = no cap). The admission queues are shared fairly between tenants either way."
    )
    dedicatedWorkers: tuple[str, ...] = Field(
        default=(), description="Workers (e.g. decode-1, prefill-1) only this tenant may use; its requests use "
        "only these in every pool where it has some. On a cluster, their number per pool is a Deployment of the tenant's own."
    )

    @field_validator("apiKeySha256")
    @classmethod
    def _hex_digests(cls, digests: tuple[str, ...]) -> tuple[str, ...]:
        for digest in digests:
            if not re.fullmatch(SHA256_PATTERN, digest):
                raise ValueError(f"{digest[:12]!r}… is not a lowercase hex SHA-256 (64 characters); use `dpd keys hash`")
        return digests


class RequestLogSpec(_Frozen):
    """The opt-in request log (router/requestlog.py): one JSON line per request, for auditing and
    replaying what the endpoint served."""

    path: str | None = Field(
        default=None, description="File the router appends to (created owner-only); unset = no log. On a cluster, a "
        "path on a volume mounted into the router."
    )
    includePrompts: bool = Field(default=False, description="Also log each prompt's text (off: token counts only).")
    maxMegabytes: int = Field(default=100, ge=1, description="Past this size the log is rotated once (LOG -> LOG.1).")


class TracingSpec(_Frozen):
    """OpenTelemetry traces of each request across the router and its workers (router/tracing.py)."""

    otlpEndpoint: str | None = Field(
        default=None, pattern=r"^https?://", description="OTLP/HTTP traces URL of a collector (e.g. "
        "`http://otel-collector:4318/v1/traces`); the router and every worker export spans there. Unset = off (no cost)."
    )
    sampleRatio: float = Field(
        default=1.0, ge=0, le=1, description="Share of requests traced when the client sent no `traceparent` (one "
        "that did keeps its own sampling decision)."
    )


class ShadowSpec(_Frozen):
    """Mirror a share of requests to another endpoint and record its latency (router/shadow.py)."""

    url: str | None = Field(
        default=None, pattern=r"^https?://", description="Base URL of an OpenAI-compatible endpoint (e.g. the "
        "colocated deployment's router); unset = no shadow traffic."
    )
    share: float = Field(default=0.1, ge=0, le=1, description="Share of the eligible requests mirrored, at random.")
    minPromptTokens: int = Field(default=0, ge=0, description="Only prompts at least this long are mirrored.")
    maxConcurrent: int = Field(default=4, ge=1, description="Mirrors open at once; past it a mirror is dropped.")
    timeoutS: float = Field(default=300.0, gt=0, description="A mirror is abandoned after this long.")
    model: str | None = Field(default=None, description="The model name to ask the target for (default: the request's).")
    apiKeyEnv: str | None = Field(
        default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="Environment variable holding the target's API "
        "key (sent as a bearer token; the workers' key never is)."
    )


class PrefixAwareSpec(_Frozen):
    """Prefix-cache-aware routing (``dpd/router/prefix.py``): requests go where their prompt's
    leading KV blocks are cached, and the P/D decision counts only the uncached tokens."""

    enabled: bool = Field(default=False, description="Route by where prompt prefixes are cached (an index of KV "
                          "block hashes per worker, kept by the router from what it routed).")
    blockSize: int | None = Field(default=None, ge=1, le=4096, description="vLLM's KV block size on the workers; "
                                  "unset: a pool's --block-size, else vLLM's default (128 on CPU workers, 16 on GPU).")
    loadWeightTokens: int = Field(default=256, ge=0, description="A worker's score is its cached tokens of the "
                                  "prompt minus this many per request it has in flight: prefix against load.")
    minCachedTokens: int = Field(default=256, ge=1, description="The least cached tokens for a hit to choose the worker.")
    maxBlocksPerWorker: int = Field(default=65536, ge=1, description="Block hashes remembered per worker; the least "
                                    "recently used go first, as in vLLM's cache.")
    kvEvents: bool = Field(default=True, description="Workers publish vLLM's KV-cache events (ZMQ) and the index "
                           "follows them (stores, evictions, restarts); a worker without events keeps the router's "
                           "approximate record of what it routed there.")
    kvEventsPortOffset: int = Field(default=1000, ge=1, le=30000, description="On a cluster a worker publishes its "
                                    "events on its HTTP port plus this; on one machine on a Unix socket in the run "
                                    "directory.")


SLO_CLASS_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,31}$"


class SloClassSpec(_Frozen):
    """A request class by prompt length, with its own targets where they differ."""

    name: str = Field(pattern=SLO_CLASS_NAME_PATTERN, description="The `class` label of the SLO and latency metrics.")
    maxPromptTokens: int | None = Field(
        default=None, ge=1, description="The class holds prompts up to this many tokens (the router's count) that no "
        "earlier class holds; unset on the last class only (every longer prompt)."
    )
    ttftS: float | None = Field(default=None, gt=0, description="This class's TTFT target; unset: `slo.ttftS`.")
    tpotS: float | None = Field(default=None, gt=0, description="This class's TPOT target; unset: `slo.tpotS`.")


DEFAULT_SLO_CLASSES: Final = (
    SloClassSpec(name="chat", maxPromptTokens=1024),
    SloClassSpec(name="retrieval", maxPromptTokens=8192),
    SloClassSpec(name="document"),
)


class SloSpec(_Frozen):
    """The latency targets a request is judged by (goodput: requests meeting both), per class.
    The defaults suit this project's CPU workers; a GPU deployment sets its own."""

    ttftS: float = Field(default=10.0, gt=0, description="Time-to-first-token target, seconds.")
    tpotS: float = Field(
        default=0.2, gt=0, description="Time-per-output-token target after the first, seconds: (last token − first) "
        "÷ (tokens − 1), as `vllm bench serve` computes it."
    )
    classes: tuple[SloClassSpec, ...] = Field(
        default=DEFAULT_SLO_CLASSES, min_length=1, description="Request classes by prompt length, shortest first "
        "(default chat ≤ 1,024, retrieval ≤ 8,192, document above)."
    )

    @model_validator(mode="after")
    def _classes_partition(self) -> SloSpec:
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"slo.classes: names must be unique, got {names}")
        bounds = [c.maxPromptTokens for c in self.classes]
        if bounds[-1] is not None or any(b is None for b in bounds[:-1]):
            raise ValueError("slo.classes: every class but the last sets maxPromptTokens; the last holds every longer "
                             "prompt and sets none")
        if any(b is not None and a is not None and b <= a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"slo.classes: maxPromptTokens must increase, got {bounds[:-1]}")
        return self


class AdaptiveSpec(_Frozen):
    """The adaptive policy's cost model (``pdSpec.routingPolicy: adaptive``). Rates are measured
    online per worker; these priors only stand in until a worker's first measurement."""

    stallWeight: float = Field(
        default=1.0, ge=0, le=100, description="Below a predicted SLO miss, the weight of the stall a plan inflicts on "
        "running streams (each as a share of its TPOT slack) against the request's own budgets: 0 = only misses "
        "protect them, higher = protect them more (static-split-like)."
    )
    ttftSloS: float | None = Field(
        default=None, gt=0, description="The TTFT target the policy serves: a plan predicted to take longer counts a "
        "miss. Unset: `router.slo.ttftS`."
    )
    tpotSloS: float | None = Field(
        default=None, gt=0, description="The TPOT target: a plan that would push the new stream, or a running one, past "
        "it counts a miss. The policy minimises predicted misses first, then latency. Unset: `router.slo.tpotS`."
    )

    maxStallS: float | None = Field(
        default=None, gt=0, description="The longest pause a plan's prefill may impose on the streams decoding on the "
        "worker that runs it (one inter-token gap: the ITL tail to protect). A plan whose prefill is predicted to take "
        "longer counts a miss for each such stream, so a large prompt goes to a worker with no streams (a split) while "
        "one can meet the TTFT target. Unset: only the TPOT target bounds stalls, and a stall within a stream's TPOT "
        "slack costs it little."
    )

    def targets(self, slo: SloSpec) -> tuple[float, float]:
        """(TTFT, TPOT) the policy serves: its own where set, else the router's SLO."""
        return (self.ttftSloS if self.ttftSloS is not None else slo.ttftS,
                self.tpotSloS if self.tpotSloS is not None else slo.tpotS)
    priorPrefillTokensPerS: float = Field(default=500.0, gt=0, description="A worker's prefill rate before it is measured.")
    priorDecodeTokensPerS: float = Field(default=30.0, gt=0, description="One stream's decode rate before it is measured.")
    priorSplitOverheadS: float = Field(
        default=0.3, ge=0, description="The disaggregated path's own cost (KV pull + hop) before it is measured."
    )


class RouterSpec(_Frozen):
    """The router's listen address and the knobs of its P/D flow."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    picker: Literal["least-outstanding", "power-of-two", "round-robin"] = "least-outstanding"
    prefillTimeoutS: float = Field(
        default=120.0, gt=0, description="Deadline of the prefill hop (an 8k-token CPU prefill takes ~45 s)."
    )
    decodeFirstTokenTimeoutS: float = Field(
        default=5.0,
        gt=0,
        description="Deadline for the decoder's first token on the disaggregated path; past it "
        "the request is cancelled on the decoder and served on the direct path. A worker pair's "
        "first transfer (NIXL's handshake) gets 4x this, within half the KV lease and never less than this.",
    )
    directFirstTokenTimeoutS: float = Field(
        default=300.0, gt=0, description="Deadline for the first token on the direct path."
    )
    streamIdleTimeoutS: float = Field(
        default=300.0, gt=0, description="Longest silence between two chunks of a worker's stream before it is failed."
    )
    healthIntervalS: float = Field(default=2.0, gt=0, description="Active health probe period.")
    bodyReadTimeoutS: float = Field(
        default=30.0, gt=0, description="Longest a client may take to send a request body's first 4 MiB, and each "
        "4 MiB after it (408 past it), and a request's head from connecting or from the response before (closed past "
        "it): a slow or silent client cannot hold a connection open."
    )
    maxConnections: int = Field(
        default=1024, ge=1, description="Concurrent connections and requests the router serves; past it new ones get "
        "a 503 at once (bounds what slow or flooding clients can hold)."
    )
    metricsPort: int | None = Field(
        default=None, ge=1, le=65535, description="Serve /metrics (it names tenants and workers) on this port only, "
        "apart from the API. Unset: on the API port, and only while the router listens on loopback; bound to any other "
        "address the router refuses it there (403). On a cluster the router uses 9090 when unset, open to Prometheus only."
    )
    admission: AdmissionSpec = Field(default_factory=AdmissionSpec)
    overflowStatusCode: Literal[429, 503] = Field(
        default=429, description="The status of a request shed by admission control (a full queue or a wait past "
        "queueTimeoutS), with Retry-After."
    )
    breaker: BreakerSpec = Field(default_factory=BreakerSpec)
    retry: RetrySpec = Field(default_factory=RetrySpec)
    migration: MigrationSpec = Field(default_factory=MigrationSpec)
    slo: SloSpec = Field(default_factory=SloSpec)
    requestLog: RequestLogSpec = Field(default_factory=RequestLogSpec)
    tracing: TracingSpec = Field(default_factory=TracingSpec)
    shadow: ShadowSpec = Field(default_factory=ShadowSpec)
    adaptive: AdaptiveSpec = Field(default_factory=AdaptiveSpec)
    prefixAware: PrefixAwareSpec = Field(default_factory=PrefixAwareSpec)
    drainTimeoutS: float = Field(
        default=120.0, gt=0, description="Longest wait for a draining worker's in-flight requests to finish: the router's "
        "drain locally; on a cluster the workers' `--shutdown-timeout` (vLLM drains on SIGTERM)."
    )
    resources: ResourceRequirements | None = Field(
        default=None, description="The router pod's requests and limits on a cluster, each over the defaults (1 CPU and "
        "1Gi requested, a 4Gi memory limit): what it sets replaces a default, what it leaves out keeps it; not used locally."
    )
    adminKeySha256: str | None = Field(
        default=None,
        pattern=SHA256_PATTERN,
        description="SHA-256 (hex) of the bearer key for /admin/*; `dpd keys hash` makes one. "
        "Unset = the admin API is served to loopback peers only, and only while the router listens on loopback "
        "(bound to any other address it needs the key).",
    )


class KvTransferSpec(_Frozen):
    connector: Literal["NixlConnector"] = "NixlConnector"
    backends: tuple[Literal["UCX", "LIBFABRIC", "GDS", "POSIX"], ...] = ("UCX",)
    bufferDevice: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Where KV blocks are registered for transfer: auto = cuda on GPU workers, cpu on "
        "CPU workers; cuda forces GPU workers (GPU-to-GPU transfer)."
    )
    kvLeaseDurationS: int = Field(
        default=30, ge=1, le=3600, description="How long a prefiller holds KV blocks no decoder has pulled."
    )
    numThreads: int = Field(default=1, ge=1, le=64, description="NIXL/UCX backend threads per worker.")
    nixlProgressDelayUs: int = Field(
        default=2000,
        ge=0,
        le=1_000_000,
        description="Longest sleep of NIXL's progress thread between polls. NIXL's own value, 0, makes "
        "it spin a core per worker and stalls the P/D path on machines without spare cores "
        "(docs/pd-stall.md); it wakes early for every transfer or notification.",
    )
    kvLoadFailurePolicy: Literal["fail", "recompute"] = Field(
        default="recompute", description="What a decoder does when a KV pull fails: error out or recompute the prefill."
    )

    @field_validator("backends")
    @classmethod
    def _non_empty(cls, backends: tuple[str, ...]) -> tuple[str, ...]:
        if not backends:
            raise ValueError("at least one backend is required")
        return backends


class DiskOffloadSpec(_Frozen):
    path: str
    sizeGiB: float = Field(gt=0)

    @field_validator("path")
    @classmethod
    def _absolute(cls, path: str) -> str:
        if not os.path.isabs(path):
            raise ValueError(f"must be an absolute path, got {path!r}")
        return path


class KvCacheOffloadingSpec(_Frozen):
    """Tiers below the worker's own KV cache: CPU memory, then disk."""

    cpuGiB: float = Field(default=0.0, ge=0)
    disk: DiskOffloadSpec | None = None

    @property
    def is_enabled(self) -> bool:
        return self.cpuGiB > 0 or self.disk is not None


class LocalSpec(_Frozen):
    """Where the local launcher puts workers: ports and the run directory."""

    device: Literal["auto", "cpu", "gpu"] = Field(
        default="auto", description="What the workers compute on: auto = the node's NVIDIA GPUs when it has some and "
        "the CUDA engine (vllm) is installed, else CPU cores; gpu / cpu force one (an error if impossible)."
    )
    workerBasePort: int = Field(default=8100, ge=1024, le=65000)
    sideChannelBasePort: int = Field(default=5600, ge=1024, le=65000)
    runDir: str | None = Field(default=None, description="Worker logs; default ~/.cache/dpd/runs/<time>.")
    startupTimeoutS: float = Field(default=900.0, gt=0)
    restartBackoffS: float = Field(default=2.0, ge=0)


class PdSpec(_Frozen):
    prefillSpec: PoolSpec = Field(default_factory=PoolSpec)
    decodingSpec: PoolSpec = Field(default_factory=PoolSpec)
    routingThreshold: int = Field(
        default=DEFAULT_ROUTING_THRESHOLD_TOKENS,
        ge=0,
        le=10**9,
        description="threshold policy: prompts with at least this many tokens take the disaggregated path; 0 = always. "
        "adaptive policy: the floor below which a prompt is never disaggregated.",
    )
    routingPolicy: Literal["adaptive", "threshold"] = Field(
        default="adaptive",
        description="adaptive: every worker may run a whole request, and a cost model measured online picks between "
        "running it whole and splitting it, per request. threshold: the static split (HyperPod's semantics).",
    )
    router: RouterSpec = Field(default_factory=RouterSpec)
    kvTransferSpec: KvTransferSpec = Field(default_factory=KvTransferSpec)
    kvCacheOffloadingSpec: KvCacheOffloadingSpec = Field(default_factory=KvCacheOffloadingSpec)
    local: LocalSpec = Field(default_factory=LocalSpec)
    # Accepted from the reference resource; used when rendering for a cluster, not locally.
    topologySpec: dict[str, Any] | None = None
    autoScalingSpec: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _has_decoders(self) -> PdSpec:
        if self.decodingSpec.replicas < 1:
            raise ValueError("decodingSpec.replicas must be at least 1: every request is decoded")
        return self

    @model_validator(mode="after")
    def _decode_deadline_within_lease(self) -> PdSpec:
        first_token_s, lease_s = self.router.decodeFirstTokenTimeoutS, self.kvTransferSpec.kvLeaseDurationS
        if self.router.metricsPort is not None and self.router.metricsPort == self.router.port:
            raise ValueError(f"router.metricsPort ({self.router.metricsPort}) must differ from router.port")
        if first_token_s >= lease_s:
            raise ValueError(
                f"router.decodeFirstTokenTimeoutS ({first_token_s:g}s) must be shorter than "
                f"kvTransferSpec.kvLeaseDurationS ({lease_s}s): a decoder still waiting for the KV when the "
                "prefiller's lease ends would recompute the prompt unseen")
        return self


class S3Storage(_Frozen):
    bucketName: str = Field(min_length=3)
    region: str | None = None


class FsxStorage(_Frozen):
    fileSystemId: str = Field(min_length=1)
    dnsName: str | None = None
    mountName: str | None = None


class SecretKeyRef(_Frozen):
    name: str = Field(min_length=1)
    key: str = "token"
    optional: bool | None = None


class HuggingFaceModel(_Frozen):
    modelId: str | None = None
    commitSHA: str | None = None
    tokenSecretRef: SecretKeyRef | None = None


# The reference resource's sources (s3, fsx, huggingface, kubernetesVolume) and dpd's own.
ModelSourceType = Literal["bundled", "local", "hub", "huggingface", "s3", "fsx", "kubernetesVolume"]
CLUSTER_ONLY_SOURCES = ("s3", "fsx", "kubernetesVolume")


class ModelSourceConfig(_Frozen):
    """Where the weights come from: the bundled SmolLM2, a local directory, the Hugging Face hub
    (``hub``, or the reference's ``huggingface``), an S3 prefix, an FSx for Lustre file system or a
    Kubernetes volume (the last three on a cluster)."""

    modelSourceType: ModelSourceType = "bundled"
    modelLocation: str | None = Field(default=None, description="Hub id, absolute path, or the path inside the S3 "
                                      "prefix / file system / volume.")
    s3Storage: S3Storage | None = None
    fsxStorage: FsxStorage | None = None
    huggingFaceModel: HuggingFaceModel | None = None
    prefetchEnabled: bool = Field(default=False, description="Accepted from the reference resource; dpd fetches the "
                                  "model before the worker starts either way (an init container on a cluster).")

    @model_validator(mode="after")
    def _location_matches_type(self) -> ModelSourceConfig:
        kind = self.modelSourceType
        if kind == "bundled" and self.modelLocation:
            raise ValueError("modelLocation must be empty when modelSourceType is 'bundled'")
        if kind == "s3" and self.s3Storage is None:
            raise ValueError("s3Storage (bucketName, region) is required when modelSourceType is 's3'")
        if kind == "fsx" and self.fsxStorage is None:
            raise ValueError("fsxStorage (fileSystemId, dnsName, mountName) is required when modelSourceType is 'fsx'")
        if kind == "huggingface" and not (self.modelLocation or (self.huggingFaceModel and self.huggingFaceModel.modelId)):
            raise ValueError("huggingFaceModel.modelId (or modelLocation) is required when modelSourceType is 'huggingface'")
        if kind in ("local", "hub") and not self.modelLocation:
            raise ValueError(f"modelLocation is required when modelSourceType is {kind!r}")
        return self

    @property
    def hub_id(self) -> str | None:
        """The hub id for ``hub`` and ``huggingface`` sources."""
        if self.modelSourceType == "hub":
            return self.modelLocation
        if self.modelSourceType == "huggingface":
            return (self.huggingFaceModel.modelId if self.huggingFaceModel and self.huggingFaceModel.modelId
                    else self.modelLocation)
        return None

    @property
    def revision(self) -> str | None:
        return self.huggingFaceModel.commitSHA if self.huggingFaceModel else None


class RequestLimits(_Frozen):
    """The reference's per-worker request limits, applied as dpd's admission control."""

    maxConcurrentRequests: int | None = Field(default=None, ge=1)
    maxQueueSize: int | None = Field(default=None, ge=0)
    overflowStatusCode: Literal[429, 503] | None = None


class ModelVolumeMount(_Frozen):
    name: str = Field(min_length=1)
    mountPath: str = Field(min_length=1)


class WorkerSpec(_Frozen):
    """The reference's ``worker`` section: the inference container."""

    image: str | None = Field(default=None, description="The worker image (cluster); default: dpd's for CPU, vLLM's for GPU.")
    args: tuple[str, ...] = ()
    command: tuple[str, ...] = ()
    environmentVariables: tuple[dict[str, Any], ...] = ()
    modelInvocationPort: dict[str, Any] | None = None
    modelVolumeMount: ModelVolumeMount | None = None
    probes: dict[str, Any] | None = None
    requestLimits: RequestLimits | None = None
    resources: ResourceRequirements | None = None
    workingDir: str | None = None

    @field_validator("args")
    @classmethod
    def _no_managed_args(cls, args: tuple[str, ...]) -> tuple[str, ...]:
        return no_managed_args(args)


class TlsConfig(_Frozen):
    """HTTPS on the router. dpd's own: ``certFile``/``keyFile`` (local) or ``secretName`` (a
    ``kubernetes.io/tls`` Secret, e.g. cert-manager's, on a cluster). The reference's ACM and S3
    fields are accepted and reported as not applied."""

    certFile: str | None = None
    keyFile: str | None = None
    secretName: str | None = None
    customCertificateConfig: dict[str, Any] | None = None
    tlsCertificateOutputS3Uri: str | None = None

    @model_validator(mode="after")
    def _pair(self) -> TlsConfig:
        if bool(self.certFile) != bool(self.keyFile):
            raise ValueError("certFile and keyFile go together")
        return self


# Where the router pod mounts a tlsConfig.secretName Secret (kubernetes.io/tls: tls.crt, tls.key).
CLUSTER_TLS_DIR = "/etc/dpd/tls"


def tls_files(spec: EndpointSpec, *, on_cluster: bool = False) -> tuple[str, str] | None:
    """The router's (certificate, key) files, or None to serve plain HTTP."""
    tls = spec.tlsConfig
    if tls is None:
        return None
    if on_cluster:
        return (f"{CLUSTER_TLS_DIR}/tls.crt", f"{CLUSTER_TLS_DIR}/tls.key") if tls.secretName else None
    return (tls.certFile, tls.keyFile) if tls.certFile and tls.keyFile else None


class MetricsSpec(_Frozen):
    enabled: bool = Field(default=True, description="Render the monitoring objects (cluster): a ServiceMonitor, the "
                          "dashboard's ConfigMap (Grafana sidecar) and a PrometheusRule (`dpd render` only).")
    metricsScrapeIntervalSeconds: int = Field(default=15, ge=1, le=3600)
    modelMetrics: dict[str, Any] | None = None


class KvCacheSpec(_Frozen):
    """The reference's KV cache tiers: L1 = CPU memory on the node, L2 = a remote or local store."""

    enableL1Cache: bool = True
    enableL2Cache: bool = False
    l2CacheSpec: dict[str, Any] | None = None
    cacheConfigFile: str | None = None


class IntelligentRoutingSpec(_Frozen):
    enabled: bool = False
    routingStrategy: Literal["prefixaware", "kvaware", "session", "roundrobin"] | None = None
    autoScalingSpec: dict[str, Any] | None = None


class LoadBalancerSpec(_Frozen):
    healthCheckPath: str | None = None
    routingAlgorithm: Literal["least_outstanding_requests", "round_robin"] | None = None


class EndpointSpec(_Frozen):
    modelName: str = Field(default="smollm2-135m", min_length=1, description="The served model name.")
    modelSourceConfig: ModelSourceConfig = Field(default_factory=ModelSourceConfig)
    maxModelLen: int = Field(default=8192, ge=16, le=1_048_576)
    pdSpec: PdSpec = Field(default_factory=PdSpec)
    # The reference resource's other fields: each applied, or reported by ``reference.not_applied``.
    instanceType: str | None = None
    instanceTypes: tuple[str, ...] = ()
    endpointName: str | None = None
    modelVersion: str | None = None
    worker: WorkerSpec | None = None
    tlsConfig: TlsConfig | None = None
    metrics: MetricsSpec | None = None
    kvCacheSpec: KvCacheSpec | None = None
    intelligentRoutingSpec: IntelligentRoutingSpec | None = None
    loadBalancer: LoadBalancerSpec | None = None
    replicas: int | None = Field(default=None, ge=0)
    InitialReplicaCount: int | None = Field(default=None, ge=0)
    maxDeployTimeInSeconds: int | None = Field(default=None, ge=1)
    invocationEndpoint: str | None = None
    autoScalingSpec: dict[str, Any] | None = None
    dataCapture: dict[str, Any] | None = None
    dnsConfig: dict[str, Any] | None = None
    kubernetes: dict[str, Any] | None = None
    nodeAffinity: dict[str, Any] | None = None
    tags: tuple[dict[str, Any], ...] = ()
    tenants: tuple[TenantSpec, ...] = Field(
        default=(), description="API tenants; when set, every inference request, and the model list, needs a tenant's key (401 otherwise)."
    )

    @model_validator(mode="after")
    def _apply_reference_fields(self) -> EndpointSpec:
        """The reference resource's routing and request-limit fields, as dpd's own settings where
        the config does not set those itself (``dpd.config.reference`` lists what is not applied)."""
        router = self.pdSpec.router
        update: dict[str, Any] = {}
        if "picker" not in router.model_fields_set and (picker := reference_picker(self)):
            update["picker"] = picker
        limits = self.worker.requestLimits if self.worker else None
        if limits and limits.maxConcurrentRequests and not (router.admission.prefill or router.admission.decode):
            per_worker, queue = limits.maxConcurrentRequests, limits.maxQueueSize

            def pool_gate(pool: PoolSpec) -> PoolAdmissionSpec | None:
                if pool.replicas < 1:
                    return None
                return PoolAdmissionSpec(maxInFlight=per_worker * pool.replicas,
                                         **({"maxQueue": queue} if queue is not None else {}))
            update["admission"] = AdmissionSpec(prefill=pool_gate(self.pdSpec.prefillSpec), decode=pool_gate(self.pdSpec.decodingSpec))
        if limits and limits.overflowStatusCode and "overflowStatusCode" not in router.model_fields_set:
            update["overflowStatusCode"] = limits.overflowStatusCode
        routing = self.intelligentRoutingSpec
        if (routing and routing.enabled and routing.routingStrategy in PREFIX_STRATEGIES
                and "prefixAware" not in router.model_fields_set):
            update["prefixAware"] = router.prefixAware.model_copy(update={"enabled": True})
        if not update:
            return self
        new_router = router.model_copy(update=update)
        return self.model_copy(update={"pdSpec": self.pdSpec.model_copy(update={"router": new_router})})

    @model_validator(mode="after")
    def _tenants_consistent(self) -> EndpointSpec:
        names = [t.name for t in self.tenants]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"tenants: duplicate name(s) {', '.join(dup)}")
        digests = [d for t in self.tenants for d in t.apiKeySha256]
        if len(set(digests)) != len(digests):
            raise ValueError("tenants: the same API key hash is listed twice")
        pd = self.pdSpec
        workers = {f"prefill-{i}" for i in range(pd.prefillSpec.replicas)} | {
            f"decode-{i}" for i in range(pd.decodingSpec.replicas)
        }
        owner: dict[str, str] = {}
        for tenant in self.tenants:
            for worker in tenant.dedicatedWorkers:
                if worker not in workers:
                    raise ValueError(
                        f"tenants[{tenant.name}].dedicatedWorkers: no worker {worker!r}; the pools have {', '.join(sorted(workers))}"
                    )
                if worker in owner:
                    raise ValueError(f"tenants: {worker} is dedicated to both {owner[worker]} and {tenant.name}")
                owner[worker] = tenant.name
        shared_decoders = [w for w in workers if w.startswith("decode-") and w not in owner]
        if not shared_decoders and any(not any(w.startswith("decode-") for w in t.dedicatedWorkers) for t in self.tenants):
            raise ValueError("tenants: every decoder is dedicated, so a tenant without dedicated decoders could not be served")
        return self


# The reference's routing fields → dpd's pickers; prefixaware / kvaware / session turn on
# prefix-aware routing (router.prefixAware) over least-outstanding picking.
PREFIX_STRATEGIES = ("prefixaware", "kvaware", "session")
REFERENCE_PICKERS = {"roundrobin": "round-robin", "round_robin": "round-robin",
                     "least_outstanding_requests": "least-outstanding"}


def reference_picker(spec: EndpointSpec) -> str | None:
    routing = spec.intelligentRoutingSpec
    if routing and routing.enabled and routing.routingStrategy:
        return REFERENCE_PICKERS.get(routing.routingStrategy, "least-outstanding")
    if spec.loadBalancer and spec.loadBalancer.routingAlgorithm:
        return REFERENCE_PICKERS[spec.loadBalancer.routingAlgorithm]
    return None


class Metadata(_Frozen):
    model_config = ConfigDict(frozen=True, extra="allow")
    name: str = Field(default="dpd", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    namespace: str | None = None


class InferenceEndpointConfig(_Frozen):
    apiVersion: Literal["inference.dpd.dev/v1", "inference.sagemaker.aws.amazon.com/v1"] = API_VERSION
    kind: Literal["InferenceEndpointConfig"] = KIND
    metadata: Metadata = Field(default_factory=Metadata)
    spec: EndpointSpec = Field(default_factory=EndpointSpec)
