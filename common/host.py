"""What this host gives the process."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the platform has one, a container's cpuset
    included), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def default_threads() -> int:
    """torch's threads when a command is given 0 (auto): half the usable cores, 1 to 8. torch's own default (every
    core) oversubscribes a machine with anything else running: on 2 shared cores one thread ran ``speculate`` in
    10.6 s where torch's default took 1m45s, and per-kind scoring beside one vLLM engine at 2 threads scored no kind
    in 21 minutes where 1 thread scored one every 3.5 (docs/LOG.md, twentieth stop)."""
    return max(1, min(8, usable_cores() // 2))
