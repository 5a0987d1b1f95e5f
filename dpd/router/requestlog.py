"""The opt-in request log (``router.requestLog``): one JSON line per finished request, so an
operator can audit what the endpoint really served and replay it (``dpd bench audit --trace
LOG``, ``dpd bench run --trace LOG``).

A line holds what the router measured, never the prompt or the answer unless
``includePrompts`` asks for the prompt: ``time`` (Unix seconds the request arrived),
``request_id``, ``tenant``, ``api`` (completions or chat), ``prompt_tokens`` (the router's
count), ``output_tokens`` and ``cached_tokens`` (the answer's usage), ``path``, ``reason``,
``workers``, ``class`` (router.slo), ``ttft_s``, ``tpot_s``, ``e2e_s``, ``slo_met`` and
``outcome`` (``ok``, an HTTP status, ``worker_error``, ``client_gone``), and under the adaptive
policy ``predicted_ttft_s`` (the TTFT its cost model predicted for the plan it chose, to audit
the model against ``ttft_s``). Requests refused
before their prompt was counted (bad input, authentication) are not logged.

The file is owner-only (it names tenants) and rotated once past ``maxMegabytes`` (``LOG`` →
``LOG.1``; where it cannot be renamed, started again empty: it never grows without bound).
Writes are small appends from the event loop; a write that fails (disk full) is logged once and
the request is unaffected.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class RequestLog:
    def __init__(self, path: str | Path, max_bytes: int):
        self.path = Path(path)
        self.max_bytes = max_bytes
        self._file: Any = None
        self._failed = False

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.fchmod(fd, 0o600)  # a file that existed keeps its mode otherwise, and lines name tenants
        except OSError:
            pass  # not ours to change: written as it is
        self._file = os.fdopen(fd, "a", encoding="utf-8", buffering=1)  # line-buffered: a crash loses no line

    def _rotate(self) -> None:
        """``LOG`` → ``LOG.1``; where it cannot be renamed (a read-only directory, a file mounted
        on its own), it starts again empty rather than grow past ``maxMegabytes``."""
        self._file.close()
        self._file = None
        try:
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        except OSError as exc:
            log.warning("request log %s: cannot rotate it (%s); starting it again empty", self.path, exc)
            os.truncate(self.path, 0)
        self._open()

    def write(self, entry: dict[str, Any]) -> None:
        try:
            if self._file is None:
                self._open()
            elif self._file.tell() >= self.max_bytes:
                self._rotate()
            self._file.write(json.dumps(entry, separators=(",", ":"), ensure_ascii=False) + "\n")
            self._failed = False
        except OSError as exc:
            if not self._failed:
                log.warning("request log %s: %s (requests are served; their lines are lost until it works)", self.path, exc)
            self._failed = True
            self.close()

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
