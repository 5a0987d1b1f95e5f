"""Shared fixtures: the bundled model's tokenizer and prompts of (about) exact token counts."""

from __future__ import annotations

import random

import pytest

from dpd.models.bundled import prepare_bundled_model
from tests.integration.helpers import WORDS


@pytest.fixture(scope="session")
def model_dir() -> str:
    return str(prepare_bundled_model())


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def make_prompt(tokenizer):
    """A distinct prompt of about `num_tokens` tokens (distinct so prefix caching does not help)."""

    def make(num_tokens: int, seed: int) -> str:
        rng = random.Random(seed)
        words = [f"{rng.choice(WORDS)}" for _ in range(num_tokens + 50)]
        ids = tokenizer.encode(" ".join(words), add_special_tokens=False)[: num_tokens - 12]
        return f"Request {seed}. " + tokenizer.decode(ids) + "\nSummarize the text above in one sentence:"

    return make
