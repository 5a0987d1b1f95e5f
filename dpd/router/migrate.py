"""Mid-stream migration: a request whose worker fails after its first token continues elsewhere.

Every stream the router opens asks the worker for token ids (vLLM's ``return_token_ids``): the
prompt's ids with the first chunk, each chunk's new ids after. When the stream then breaks
(``outcomes.StreamBreak``: connection lost, worker exit, no chunk within
``streamIdleTimeoutS``, an error event, an end without a finish), the request continues on
another worker as a ``/v1/completions`` request whose prompt is the prompt's ids plus the ids
generated so far — nothing is re-tokenized — with ``max_tokens`` reduced by what was generated
and the same sampling parameters. Its chunks are rewritten into the client's format (a chat
client keeps getting ``chat.completion.chunk`` deltas under the same ``id``), its usage counts
the prompt once and every generated token, and the client sees one stream and one ``[DONE]``.
The ids are stripped from what the client gets (clients cannot ask for them: protocol.py).

Exact for greedy sampling (the continuation is the same computation); with sampling it is a
valid continuation, not the same draw (a seed restarts its generator). Not migrated, so the
client gets today's error event: requests with ``logprobs`` or ``echo`` (already-sent offsets
and logprobs that the continuation cannot extend in the same shape), a stream whose worker
returned no token ids, and more than ``router.migration.maxMigrations`` breaks. Text a worker
held back to match a ``stop`` string when it failed is not re-sent, and a stop string spanning
the break is not matched (the continuation checks only its own text).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from dpd.config.model import RetrySpec
from dpd.router.aggregate import carries_token
from dpd.router.errors import ApiError
from dpd.router.flow import WORKER_ERRORS, RequestContext, UpstreamStream
from dpd.router.metrics import RouterMetrics
from dpd.router.outcomes import STREAM_BREAKS, StreamBreak, tell_worker_breaker

log = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"
# Sampling parameters a continuation carries over unchanged (both endpoints accept them).
CARRIED = (
    "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "seed", "user", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
    "cache_salt",  # a tenant's (set by the router): the continuation stays in its own prefix cache
)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # what /v1/completions generates when max_tokens is unset (OpenAI's and vLLM's default)

# Opens the continuation on a worker not in ``exclude``: (context, body, exclude) → its stream.
Reopen = Callable[[RequestContext, dict[str, Any], frozenset[str]], Awaitable[UpstreamStream]]


class StreamFailed(Exception):
    """A stream broke and the request could not continue: the caller ends it with an error."""

    def __init__(self, stream: UpstreamStream, what: StreamBreak, detail: str):
        super().__init__(f"{what.value}: {detail}")
        self.stream = stream
        self.what = what
        self.detail = detail


def why_not_migratable(body: dict[str, Any]) -> str | None:
    """Why a request cannot continue on another worker, or None if it can."""
    logprobs = body.get("logprobs")  # completions: an int, 0 included (the sampled token's); chat: a bool
    if (logprobs is not None and logprobs is not False) or body.get("top_logprobs"):
        return "logprobs"
    if body.get("echo"):
        return "echo"
    if (body.get("n") or 1) > 1:
        return "n"
    return None


def continuation_body(
    body: dict[str, Any], endpoint: str, prompt_ids: list[int], generated_ids: list[int], max_model_len: int
) -> dict[str, Any]:
    """The ``/v1/completions`` request that continues ``body`` after ``generated_ids``."""
    out: dict[str, Any] = {k: body[k] for k in CARRIED if k in body}
    prompt = [*prompt_ids, *generated_ids]
    num_done = len(generated_ids)
    if endpoint == COMPLETIONS:
        cap = body.get("max_tokens")
        cap = DEFAULT_COMPLETION_MAX_TOKENS if cap is None else cap
    else:
        cap = body.get("max_completion_tokens") or body.get("max_tokens")
    # No cap (chat's default): up to the context's end, as the original request would have gone.
    out["max_tokens"] = max(1, cap - num_done) if cap is not None else max(1, max_model_len - len(prompt))
    if body.get("min_tokens"):
        out["min_tokens"] = max(0, body["min_tokens"] - num_done)
    options = {"include_usage": True}
    if (body.get("stream_options") or {}).get("continuous_usage_stats"):
        options["continuous_usage_stats"] = True
    out.update(model=body["model"], prompt=prompt, stream=True, stream_options=options, return_token_ids=True)
    return out


def merged_usage(usage: dict[str, Any], num_prompt_tokens: int, num_tokens_before: int) -> dict[str, Any]:
    """A continuation's usage as the client's request: the prompt once, every generated token."""
    completion = int(usage.get("completion_tokens") or 0) + num_tokens_before
    return {**usage, "prompt_tokens": num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": num_prompt_tokens + completion}


class ContinuedStream:
    """The events of one request, continued on another worker each time its stream breaks.

    Yields ``(raw, chunk)`` as ``UpstreamStream.events`` does, with the token ids stripped and
    continuation chunks in the client's format; raises ``StreamFailed`` when a break cannot be
    migrated (the caller sends today's error). ``close`` closes the stream in use."""

    def __init__(
        self,
        stream: UpstreamStream,
        ctx: RequestContext,
        *,
        reopen: Reopen,
        max_migrations: int,
        retry: RetrySpec,
        max_model_len: int,
        metrics: RouterMetrics,
        is_chat: bool,
    ):
        self.stream = stream
        self._ctx = ctx
        self._reopen = reopen
        self._max_migrations = max_migrations
        self._retry = retry
        self._max_model_len = max_model_len
        self._metrics = metrics
        self._is_chat = is_chat
        self._prompt_ids: list[int] | None = None
        self._generated_ids: list[int] = []
        self._has_token_ids = True  # every content chunk so far carried its ids
        self._is_finished = False
        self._head: dict[str, Any] | None = None  # id, created, model of the client's stream
        self._num_prompt_tokens: int | None = None
        self._num_tokens_before = 0  # generated before the stream in use began
        self._is_continuation = False
        self._failed: set[str] = set()
        self.migrations: list[dict[str, Any]] = []  # one record per move: from, to, reason, after_tokens

    @property
    def is_enabled(self) -> bool:
        return self._max_migrations > 0

    async def events(self) -> AsyncIterator[tuple[bytes, dict[str, Any]]]:
        while True:
            what, detail = StreamBreak.TRUNCATED, "ended without a finish"
            try:
                async for raw, chunk in self.stream.events():
                    if "error" in chunk and not self._is_finished:
                        what, detail = StreamBreak.ERROR_EVENT, _error_text(chunk)
                        if self._can_migrate(what):
                            break
                        yield raw, chunk  # today's behaviour: the worker's error event, as sent
                        continue
                    if not self.is_enabled:
                        yield raw, chunk
                        continue
                    out = self._rewrite(chunk)
                    if out is chunk:
                        yield raw, chunk  # nothing to strip: the worker's bytes as sent
                    elif out is not None:
                        yield b"data: " + json.dumps(out, separators=(",", ":")).encode(), out
                else:
                    if self.stream.saw_done or self._is_finished or not self.is_enabled:
                        return
            except TimeoutError as exc:
                what, detail = StreamBreak.IDLE, exc.__class__.__name__
            except WORKER_ERRORS as exc:
                what, detail = StreamBreak.BROKEN, exc.__class__.__name__
            if self._is_finished:  # broke after its finish (before usage or [DONE]): the answer is whole
                return
            await self._migrate(what, detail)

    def close(self) -> None:
        self.stream.close()

    # -- chunks ------------------------------------------------------------------------------
    def _rewrite(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """Record the chunk's token ids and return what the client gets: ``chunk`` itself when
        nothing changes, a rewritten copy, or None (nothing to send)."""
        if self._head is None:
            self._head = {k: chunk.get(k) for k in ("id", "created", "model")}
        original = chunk
        chunk = dict(chunk)
        prompt_ids = chunk.pop("prompt_token_ids", None)  # chat: on the first chunk
        choices = []
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                choices.append(choice)
                continue
            choice = dict(choice)
            prompt_ids = choice.pop("prompt_token_ids", None) or prompt_ids  # completions: in the choice
            token_ids = choice.pop("token_ids", None)
            if token_ids:
                self._generated_ids.extend(token_ids)
            elif carries_token(choice):
                self._has_token_ids = False  # text without ids: this worker cannot be continued exactly
            if choice.get("finish_reason") is not None:
                self._is_finished = True
            choices.append(choice)
        if "choices" in chunk:
            chunk["choices"] = choices
        if prompt_ids and self._prompt_ids is None:
            self._prompt_ids = list(prompt_ids)
        usage = chunk.get("usage")
        if isinstance(usage, dict) and self._num_prompt_tokens is None and not self._is_continuation:
            self._num_prompt_tokens = usage.get("prompt_tokens")
        if not self._is_continuation:
            return chunk if _carries_ids(original) else original
        if isinstance(usage, dict):
            chunk["usage"] = merged_usage(usage, self._prompt_tokens(), self._num_tokens_before)
        return self._in_clients_format(chunk)

    def _in_clients_format(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        assert self._head is not None
        out: dict[str, Any] = dict(self._head)
        if self._is_chat:
            out["object"] = "chat.completion.chunk"
            choices = []
            for choice in chunk.get("choices") or ():
                text = choice.get("text") or ""
                if not text and choice.get("finish_reason") is None:
                    continue
                converted = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                             "finish_reason": choice.get("finish_reason")}
                if "stop_reason" in choice:
                    converted["stop_reason"] = choice["stop_reason"]
                choices.append(converted)
            if not choices and "usage" not in chunk:
                return None
            out["choices"] = choices
        else:
            out["object"] = "text_completion"
            out["choices"] = [{**c, "index": 0} for c in chunk.get("choices") or ()]
        if "usage" in chunk:
            out["usage"] = chunk["usage"]
        if self.migrations and any(c.get("finish_reason") is not None for c in out["choices"]):
            out["dpd_migrations"] = self.migrations  # the client's record that its request moved
        return out

    def _prompt_tokens(self) -> int:
        if self._num_prompt_tokens is not None:
            return int(self._num_prompt_tokens)
        return len(self._prompt_ids or ()) or self._ctx.num_prompt_tokens

    # -- moving ------------------------------------------------------------------------------
    def _can_migrate(self, what: StreamBreak) -> bool:
        return (STREAM_BREAKS[what].migrates and self.is_enabled and self._why_not() is None)

    def _why_not(self) -> str | None:
        if len(self.migrations) >= self._max_migrations:
            return "limit"
        if self._prompt_ids is None or not self._has_token_ids:
            return "no_token_ids"
        return why_not_migratable(self._ctx.body)

    async def _migrate(self, what: StreamBreak, detail: str) -> None:
        """Continue on another worker, or raise ``StreamFailed``."""
        failed = self.stream
        tell_worker_breaker(failed.worker.breaker, what, detail)
        why_not = "disabled" if not self.is_enabled else self._why_not()
        if why_not is not None or not STREAM_BREAKS[what].migrates:
            self._metrics.migrations.labels(what.value, f"not_migrated_{why_not or 'rule'}").inc()
            raise StreamFailed(failed, what, detail)
        self._failed.add(failed.worker.name)
        assert self._prompt_ids is not None
        num_generated = len(self._generated_ids)
        log.warning("request %s: %s stream broke after %d tokens (%s: %s); continuing on another worker",
                    self._ctx.request_id, failed.worker.name, num_generated, what.value, detail)
        body = continuation_body(self._ctx.body, self._ctx.endpoint, self._prompt_ids, self._generated_ids,
                                 self._max_model_len)
        # The plan's prefill count was for the original prompt: the continuation's is counted whole.
        decision = replace(self._ctx.decision, computed_tokens=None)
        ctx = RequestContext(self._ctx.request_id, COMPLETIONS, body, decision, len(body["prompt"]),
                             tenant=self._ctx.tenant, max_output_tokens=body["max_tokens"], started_at=self._ctx.started_at,
                             trace=self._ctx.trace)
        release, failed.on_close = failed.on_close, None  # the admission slot moves with the request
        failed.close()
        attempt = len(self.migrations)
        try:  # from here on the slot is ours to give back, a cancellation in the backoff included
            if attempt:
                await asyncio.sleep(random.uniform(0, min(self._retry.backoffMaxS, self._retry.backoffBaseS * 2 ** attempt)))
            stream = await self._reopen(ctx, body, frozenset(self._failed))
        except ApiError as error:
            if release is not None:
                release()
            self._metrics.migrations.labels(what.value, "not_migrated_no_worker").inc()
            log.warning("request %s: no worker could continue it: %s", self._ctx.request_id, error.message)
            raise StreamFailed(failed, what, f"{detail}; no worker could continue it ({error.message})") from None
        except BaseException:
            if release is not None:
                release()
            raise
        stream.on_close = release
        self.migrations.append({"from": failed.worker.name, "to": stream.worker.name, "reason": what.value,
                                "after_tokens": num_generated})
        self._metrics.migrations.labels(what.value, "migrated").inc()
        if self._num_prompt_tokens is None:
            self._num_prompt_tokens = len(self._prompt_ids)
        self._num_tokens_before = num_generated
        self._is_continuation = True
        self.stream = stream


def _carries_ids(chunk: dict[str, Any]) -> bool:
    return "prompt_token_ids" in chunk or any(
        "token_ids" in c or "prompt_token_ids" in c for c in chunk.get("choices") or () if isinstance(c, dict)
    )


def _error_text(chunk: dict[str, Any]) -> str:
    err = chunk.get("error")
    message = err.get("message") if isinstance(err, dict) else err
    return str(message)[:300]
