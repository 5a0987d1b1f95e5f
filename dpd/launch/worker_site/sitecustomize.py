"""Imported by every Python process of a dpd-launched vLLM worker (dpd puts this directory on
the workers' PYTHONPATH). It changes one NIXL setting that vLLM does not expose.

NIXL's Python agent hard-codes ``pthrDelay = 0`` (``nixl._api``): the UCX backend's progress
thread then calls ``poll()`` with a zero timeout in a loop — one thread per worker spinning at
100% of a core, forever, idle or not. With fewer spare cores than workers it starves the
workers' own compute and scheduler threads and the P/D path stalls for seconds at random
(docs/pd-stall.md). With a non-zero delay the same thread sleeps in ``poll()`` on UCX's event
fds and wakes as soon as a transfer or notification arrives (or after the delay at most).

The thread itself must stay: on transports without one-sided reads (TCP on loopback), the
prefiller's progress thread is what serves the decoder's KV reads.

``DPD_NIXL_PROGRESS_DELAY_US`` (set by dpd's launcher) is the delay; unset = NIXL's behaviour.
"""

import os

_delay_us = os.environ.get("DPD_NIXL_PROGRESS_DELAY_US")
if _delay_us:
    _delay_us_set: str = _delay_us  # narrowed from str | None, for the closure below
    try:
        import nixl._api as _nixl_api  # resolves to nixl_cu12/13._api

        _bindings = _nixl_api.nixlBind
        _make_agent = _bindings.nixlAgent

        def _agent_with_progress_delay(name, config, *args, **kwargs):
            if getattr(config, "useProgThread", False) and config.pthrDelay == 0:
                config.pthrDelay = int(_delay_us_set)
            return _make_agent(name, config, *args, **kwargs)

        _bindings.nixlAgent = _agent_with_progress_delay
    except Exception as exc:  # never keep a worker from starting over this
        print(f"dpd worker_site: could not set the NIXL progress delay: {exc!r}", flush=True)


def _parse_cores(text: str) -> set[int]:
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-", 1)
            cores.update(range(int(lo), int(hi) + 1))
        elif part:
            cores.add(int(part))
    return cores


# vLLM's NixlConnector on CPU "reserves" the machine's last core for KV transfer by calling
# os.sched_setaffinity(0, [last core]) from the worker's main thread — the thread that, with
# OpenMP on one core, runs the model. A worker dpd pinned to core 0 then computes on core 1,
# beside the worker pinned there: measured on 2 cores, both P/D workers computed on one core
# (docs/pd-stall.md, "The stolen core"). A dpd worker's threads stay on the cores dpd gave it
# (VLLM_CPU_OMP_THREADS_BIND): a move onto other cores is refused; moves within them stand.
_bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
if _bind and _bind not in ("auto", "nobind") and hasattr(os, "sched_setaffinity"):
    try:
        _worker_cores = _parse_cores(_bind)
        _set_affinity = os.sched_setaffinity

        def _within_worker_cores(pid, mask):  # type: ignore[no-untyped-def]
            wanted = set(mask)
            if pid == 0 and not wanted <= _worker_cores:
                print(f"dpd worker_site: kept this thread on cores {sorted(_worker_cores)} "
                      f"(asked to move to {sorted(wanted)})", flush=True)
                return None
            return _set_affinity(pid, mask)

        os.sched_setaffinity = _within_worker_cores
    except ValueError as exc:
        print(f"dpd worker_site: cannot parse VLLM_CPU_OMP_THREADS_BIND={_bind!r}: {exc!r}", flush=True)
