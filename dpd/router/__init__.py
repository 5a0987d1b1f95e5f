"""The router: OpenAI-compatible front door, decider, pickers and the P/D flow.

Depends on no other dpd package but ``dpd.config``'s types; never imports torch or vLLM itself
(transformers' tokenizer, loaded as vLLM loads it, brings torch in where it is installed).
"""

from dpd.router.app import WORKER_KEY_ENV, Router, RouterSettings, build_app
from dpd.router.server import make_server

__all__ = ["WORKER_KEY_ENV", "Router", "RouterSettings", "build_app", "make_server"]
