"""Prompt token counting with the served model's own tokenizer.

Counts match what vLLM will see: completions are tokenized with special tokens added (vLLM's
default), chat requests are rendered with the model's chat template and the generation prompt,
then tokenized without adding special tokens again. Token-id prompts are counted as given.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any, Protocol, cast

from dpd.router.protocol import ChatCompletionRequest, CompletionRequest


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any: ...


def load_tokenizer(path: str) -> Tokenizer:
    # AutoTokenizer, as vLLM loads it (the same class, so the same ids). It imports torch where that
    # is installed (transformers' generation config does): ~440 MB of the router's memory here.
    from transformers import AutoTokenizer

    return cast(Tokenizer, AutoTokenizer.from_pretrained(path))


class TokenCounter:
    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        # Ids the model knows (added tokens included); None when the tokenizer cannot say.
        self._num_ids: int | None = len(cast(Sized, tokenizer)) if hasattr(tokenizer, "__len__") else None

    def count(self, parsed: CompletionRequest | ChatCompletionRequest) -> int:
        return len(self.token_ids(parsed))

    def token_ids(self, parsed: CompletionRequest | ChatCompletionRequest) -> list[int]:
        """The prompt's token ids as vLLM will see them."""
        if isinstance(parsed, ChatCompletionRequest):
            return self.tokenize_chat([m.model_dump(exclude_none=True) for m in parsed.messages])
        if isinstance(parsed.prompt, list):
            bad = [t for t in parsed.prompt if t < 0 or (self._num_ids is not None and t >= self._num_ids)]
            if bad:
                raise ValueError(f"token id {bad[0]} is out of the vocabulary (0..{(self._num_ids or 1) - 1})")
            return list(parsed.prompt)
        return list(self._tokenizer.encode(parsed.prompt, add_special_tokens=True))

    def count_chat(self, messages: list[dict[str, Any]]) -> int:
        return len(self.tokenize_chat(messages))

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def tokenize_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                      add_special_tokens: bool = False) -> list[int]:
        rendered = self._tokenizer.apply_chat_template(
            [_flatten(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=False)
        return list(self._tokenizer.encode(rendered, add_special_tokens=add_special_tokens))

    def detokenize(self, ids: list[int]) -> str:
        bad = [t for t in ids if self._num_ids is not None and t >= self._num_ids]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of the vocabulary (0..{(self._num_ids or 1) - 1})")
        return self._tokenizer.decode(ids)


def _flatten(message: dict[str, Any]) -> dict[str, Any]:
    """The message as vLLM (0.32) hands it to the chat template: text-part lists joined into one
    string; an earlier turn's reasoning, sent as ``reasoning`` or ``reasoning_content`` (vLLM's
    request validation renames the latter to the former unless both are set: then ``reasoning``
    wins), given to the template in both fields on an assistant turn and dropped on any other (so
    the router counts, and hashes for the prefix cache, what the worker renders)."""
    content = message.get("content")
    if isinstance(content, list):
        message = {**message, "content": "\n".join(part["text"] for part in content)}
    if "reasoning" in message or "reasoning_content" in message:
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")
        message = {k: v for k, v in message.items() if k not in ("reasoning", "reasoning_content")}
        if message.get("role") == "assistant" and reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning
    return message
