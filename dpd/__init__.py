"""dpd: disaggregated prefill/decode serving on vLLM + NIXL."""

__version__ = "0.1.0"
