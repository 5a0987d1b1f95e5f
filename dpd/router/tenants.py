"""Tenants: who is calling (API key → tenant) and how much they may send (token buckets).

Keys are never stored: the config lists each key's SHA-256, and a request's bearer key is
hashed and looked up. With no tenants configured the endpoint is open (one machine, one user);
with any, every inference request needs a valid key, else a 401.

Each tenant may have two token buckets, checked after the prompt is tokenized: requests per
second and prompt tokens per second (counted by the router's tokenizer, the same count the
routing decision uses). A bucket refills continuously at its rate up to its burst. A request
is admitted when the bucket holds its cost — or, for a prompt larger than the whole burst,
when the bucket is full — and the cost is then taken, possibly driving the level below zero
(debt the tenant pays back before its next request). A refusal is a 429 whose Retry-After is
the time until the bucket holds enough again.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from dpd.config.model import TenantSpec
from dpd.router.errors import ApiError


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def unauthorized(message: str, label: str = "invalid") -> ApiError:
    return ApiError(401, message, type="authentication_error", code="invalid_api_key", metric_label=label)


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header; None when absent; 401 when malformed."""
    if authorization is None:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise unauthorized("The Authorization header must be 'Bearer <API key>'.")
    return key.strip()


class TokenBucket:
    def __init__(self, rate_per_s: float, burst: float, clock: Callable[[], float] = time.monotonic):
        if rate_per_s <= 0 or burst <= 0:
            raise ValueError("rate and burst must be positive")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._level = burst
        self._updated_at = clock()

    @property
    def level(self) -> float:
        self._refill()
        return self._level

    def _refill(self) -> None:
        now = self._clock()
        self._level = min(self.burst, self._level + (now - self._updated_at) * self.rate_per_s)
        self._updated_at = now

    def wait_s(self, cost: float) -> float:
        """Seconds until ``cost`` could be taken (0 = now)."""
        self._refill()
        needed = min(cost, self.burst)
        return 0.0 if self._level >= needed else (needed - self._level) / self.rate_per_s

    def take(self, cost: float) -> None:
        self._refill()
        self._level -= cost


@dataclass
class Tenant:
    name: str
    requests: TokenBucket | None
    prompt_tokens: TokenBucket | None
    dedicated_workers: tuple[str, ...]
    output_tokens: TokenBucket | None = None
    max_concurrent: int | None = None
    num_in_flight: int = 0  # requests of this tenant being served now

    @classmethod
    def from_spec(cls, spec: TenantSpec, clock: Callable[[], float] = time.monotonic) -> Tenant:
        requests = prompt_tokens = None
        if spec.requestsPerSecond:
            burst = spec.burstRequests or max(1, math.ceil(spec.requestsPerSecond))
            requests = TokenBucket(spec.requestsPerSecond, burst, clock)
        if spec.promptTokensPerSecond:
            burst = spec.burstPromptTokens or math.ceil(10 * spec.promptTokensPerSecond)
            prompt_tokens = TokenBucket(spec.promptTokensPerSecond, burst, clock)
        output_tokens = None
        if spec.outputTokensPerSecond:
            burst = spec.burstOutputTokens or math.ceil(10 * spec.outputTokensPerSecond)
            output_tokens = TokenBucket(spec.outputTokensPerSecond, burst, clock)
        return cls(spec.name, requests, prompt_tokens, spec.dedicatedWorkers, output_tokens, spec.maxConcurrentRequests)

    def enter(self) -> Callable[[], None]:
        """Count one request of this tenant until the returned (idempotent) callable runs; a 429
        at once when the tenant already has ``maxConcurrentRequests`` being served."""
        if self.max_concurrent is not None and self.num_in_flight >= self.max_concurrent:
            raise ApiError(
                429, f"Tenant {self.name!r} already has {self.num_in_flight} requests in flight (its limit is "
                f"{self.max_concurrent}); retry when one finishes.",
                type="rate_limit_error", code="rate_limit_exceeded", param="max_concurrent_requests", retry_after_s=1.0,
            )
        self.num_in_flight += 1
        done = False

        def leave() -> None:
            nonlocal done
            if not done:
                done = True
                self.num_in_flight -= 1

        return leave

    def meter_output(self, num_tokens: int) -> None:
        """Take an answer's generated tokens from the output bucket (it may go below zero: the
        tenant is refused until it refills)."""
        if self.output_tokens is not None and num_tokens > 0:
            self.output_tokens.take(num_tokens)

    def check_before_work(self) -> None:
        """Refuse (429) before the router reads and tokenizes the prompt when a bucket could not
        take even the smallest request now; takes nothing (``check_limits`` takes the cost)."""
        self._refuse_if_waiting(num_prompt_tokens=1)

    def check_limits(self, num_prompt_tokens: int) -> None:
        """Take this request's cost from the buckets, or leave them untouched and raise a 429
        (``ApiError`` naming the limit that refused it)."""
        self._refuse_if_waiting(num_prompt_tokens)
        if self.requests is not None:
            self.requests.take(1)
        if self.prompt_tokens is not None:
            self.prompt_tokens.take(num_prompt_tokens)

    def _refuse_if_waiting(self, num_prompt_tokens: int) -> None:
        waits = {}
        if self.requests is not None:
            waits["requests_per_second"] = self.requests.wait_s(1)
        if self.prompt_tokens is not None:
            waits["prompt_tokens_per_second"] = self.prompt_tokens.wait_s(num_prompt_tokens)
        if self.output_tokens is not None:
            waits["output_tokens_per_second"] = self.output_tokens.wait_s(0)  # in debt: wait for the refill
        refused = {limit: s for limit, s in waits.items() if s > 0}
        if refused:
            limit = max(refused, key=refused.__getitem__)
            raise ApiError(
                429,
                f"Tenant {self.name!r} is over its {limit.replace('_', ' ')} limit; retry in {refused[limit]:.1f}s.",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                param=limit,
                retry_after_s=max(1.0, math.ceil(refused[limit])),
            )


class TenantRegistry:
    """API key hashes → tenants."""

    def __init__(self, specs: tuple[TenantSpec, ...], clock: Callable[[], float] = time.monotonic):
        self.tenants = {spec.name: Tenant.from_spec(spec, clock) for spec in specs}
        self._by_digest = {digest: self.tenants[spec.name] for spec in specs for digest in spec.apiKeySha256}

    @property
    def is_enabled(self) -> bool:
        return bool(self.tenants)

    def owners(self) -> dict[str, str]:
        """Worker name → the tenant it is dedicated to."""
        return {w: t.name for t in self.tenants.values() for w in t.dedicated_workers}

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The caller's tenant (None when tenants are off); a 401 for a missing or unknown key."""
        if not self.is_enabled:
            return None
        key = bearer_key(authorization)
        if key is None:
            raise unauthorized("An API key is required: send 'Authorization: Bearer <API key>'.", "missing")
        digest = hash_key(key)
        for known, tenant in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                return tenant
        raise unauthorized("Incorrect API key provided.")
