"""Turn a worker's stream of chunks into the non-streaming response a client asked for.

The router streams from workers even for non-streaming clients (so TTFT and ITL are measured
for every request and a stalled decode hop is noticed by its first token). This module folds
the chunks back into one ``text_completion`` or ``chat.completion`` object, as vLLM would have
returned it: concatenated text, merged logprobs, the last finish reason, and the usage block.
"""

from __future__ import annotations

from typing import Any


class StreamAggregator:
    def __init__(self, is_chat: bool):
        self.is_chat = is_chat
        self._head: dict[str, Any] | None = None
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._finish_reason: str | None = None
        self._stop_reason: Any = None
        self._logprobs: dict[str, list[Any]] | None = None
        self.usage: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        if self._head is None:
            self._head = {k: chunk.get(k) for k in ("id", "created", "model")}
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if self.is_chat:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    self._text.append(delta["content"])
                reasoning = _reasoning(delta)
                if reasoning:
                    self._reasoning.append(reasoning)
            elif choice.get("text"):
                self._text.append(choice["text"])
            self._merge_logprobs(choice.get("logprobs"))
            if choice.get("finish_reason") is not None:
                self._finish_reason = choice["finish_reason"]
                self._stop_reason = choice.get("stop_reason")

    def _merge_logprobs(self, logprobs: dict[str, Any] | None) -> None:
        if not logprobs:
            return
        if self._logprobs is None:
            self._logprobs = {}
        for key, values in logprobs.items():
            if isinstance(values, list):
                self._logprobs.setdefault(key, []).extend(values)

    def result(self) -> dict[str, Any]:
        head = self._head or {}
        text = "".join(self._text)
        if self.is_chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self._reasoning:
                # vLLM 0.32's field, and the older one that many clients still read
                message["reasoning"] = message["reasoning_content"] = "".join(self._reasoning)
            choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": self._logprobs}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": self._logprobs}
            obj = "text_completion"
        choice["finish_reason"] = self._finish_reason
        choice["stop_reason"] = self._stop_reason
        return {**head, "object": obj, "choices": [choice], "usage": self.usage}


def is_usage_only(chunk: dict[str, Any]) -> bool:
    return not chunk.get("choices") and bool(chunk.get("usage"))


def has_finish(chunk: dict[str, Any]) -> bool:
    return any(choice.get("finish_reason") is not None for choice in chunk.get("choices") or ())


def num_content_tokens(chunk: dict[str, Any]) -> int:
    """1 if the chunk carries generated text, content or reasoning, else 0 (finish-only chunks
    carry none): the first such chunk is the first token, for TTFT."""
    return int(any(carries_token(choice) for choice in chunk.get("choices") or ()))


def carries_token(choice: Any) -> bool:
    """A stream's choice with generated text, content or reasoning: a token (the router's TTFT,
    the shadow's, a migration's check for text without token ids all count alike)."""
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    return bool(choice.get("text") or (isinstance(delta, dict) and (delta.get("content") or _reasoning(delta))))


def _reasoning(delta: dict[str, Any]) -> Any:
    # vLLM 0.32 streams a reasoning parser's output as ``reasoning`` (earlier releases, and other
    # engines, as ``reasoning_content``)
    return delta.get("reasoning") or delta.get("reasoning_content")
