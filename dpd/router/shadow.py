"""Shadow traffic (``router.shadow``): a share of requests mirrored to another OpenAI-compatible
endpoint — the colocated deployment before a rollout, say — whose answers are discarded and
whose TTFT and ITL are recorded beside dpd's, per SLO class.

A mirror never touches the request it copies: it is a background task started after the
request is routed, on its own HTTP session (the workers' key is never sent to it; the target's
own key comes from the environment variable ``apiKeyEnv`` names), bounded in number
(``maxConcurrent``: past it a mirror is dropped and counted, not queued) and in time
(``timeoutS``). A target that is down, slow or wrong costs the primary request nothing but a
counter. Which requests: prompts of at least ``minPromptTokens`` tokens (the long ones the
rollout question is about), then a ``share`` of those, drawn at random.

Metrics: ``dpd_shadow_requests_total{outcome}`` (ok, error, timeout, dropped),
``dpd_shadow_ttft_seconds{class}`` and ``dpd_shadow_itl_seconds{class}`` next to
``dpd_ttft_seconds{path,class}``; the request log (if on) gets a ``"shadow": true`` line with the
same ``request_id``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from dpd.config.model import ShadowSpec
from dpd.router.aggregate import carries_token
from dpd.router.metrics import RouterMetrics

log = logging.getLogger(__name__)


class Shadow:
    def __init__(self, spec: ShadowSpec, metrics: RouterMetrics, rng: random.Random | None = None):
        self.spec = spec
        self._metrics = metrics
        self._rng = rng or random.Random()
        self._tasks: set[asyncio.Task] = set()
        self._session: aiohttp.ClientSession | None = None
        key = os.environ.get(spec.apiKeyEnv) if spec.apiKeyEnv else None
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}

    @property
    def num_in_flight(self) -> int:
        return len(self._tasks)

    def wants(self, num_prompt_tokens: int) -> bool:
        return num_prompt_tokens >= self.spec.minPromptTokens and self._rng.random() < self.spec.share

    def mirror(self, endpoint: str, body: dict[str, Any], slo_class: str,
               on_done: Callable[[dict[str, Any]], None] | None = None) -> bool:
        """Start a mirror of one request in the background; False if dropped (too many open)."""
        if len(self._tasks) >= self.spec.maxConcurrent:
            self._metrics.shadow_requests.labels("dropped").inc()
            return False
        task = asyncio.create_task(self._run(endpoint, body, slo_class, on_done), name="shadow")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def _body(self, body: dict[str, Any]) -> dict[str, Any]:
        mirrored = {**body, "stream": True, "stream_options": {"include_usage": True}}
        if self.spec.model:
            mirrored["model"] = self.spec.model
        return mirrored

    async def _run(self, endpoint: str, body: dict[str, Any], slo_class: str,
                   on_done: Callable[[dict[str, Any]], None] | None) -> None:
        assert self.spec.url is not None
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        started = time.monotonic()
        first: float | None = None
        last: float | None = None
        num_tokens = 0
        outcome = "error"
        try:
            async with asyncio.timeout(self.spec.timeoutS):
                async with self._session.post(self.spec.url.rstrip("/") + endpoint, json=self._body(body),
                                              headers=self._headers) as resp:
                    if resp.status == 200:
                        async for line in resp.content:
                            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                                continue
                            chunk = json.loads(line[6:])
                            usage = chunk.get("usage")
                            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                                num_tokens = usage["completion_tokens"]
                            if not any(carries_token(c) for c in chunk.get("choices") or ()):  # as the router counts
                                continue
                            now = time.monotonic()
                            if first is None:
                                first = now
                                self._metrics.shadow_ttft.labels(slo_class).observe(now - started)
                            elif last is not None:
                                self._metrics.shadow_itl.labels(slo_class).observe(now - last)
                            last = now
                        outcome = "ok" if first is not None else "error"
        except TimeoutError:
            outcome = "timeout"
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            log.debug("shadow %s: %s", self.spec.url, exc)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self._metrics.shadow_requests.labels(outcome).inc()
            if on_done is not None:
                n = max(num_tokens, 1)
                on_done({"outcome": outcome, "ttft_s": None if first is None else round(first - started, 4),
                         "tpot_s": None if first is None or last is None or n < 2 else round((last - first) / (n - 1), 4),
                         "output_tokens": num_tokens or None})

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

