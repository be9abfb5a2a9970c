"""What every benchmark writes beside its figures: where results go, library versions, the machine."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import resource
import sys
from pathlib import Path
from typing import Any, Callable

import torch

RESULTS = Path(__file__).parent / "results"


def environment(**machine: Any) -> dict[str, Any]:
    """Versions and machine facts for a result file; ``machine`` adds run facts (threads, device)."""
    import pyarrow
    import transformers
    import zstandard

    return {
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__, "pyarrow": pyarrow.__version__,
                     "zstandard": zstandard.__version__},
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "load_avg": os.getloadavg(), **machine},
    }


def invocation() -> str:
    """The command line that ran this process, as a user would type it (``python -m benchmarks.X ...``)."""
    main = sys.modules.get("__main__")
    module = getattr(getattr(main, "__spec__", None), "name", None)
    head = f"python -m {module}" if module else f"python {sys.argv[0]}"
    return " ".join([head, *sys.argv[1:]])


def write_result(name: str, doc: dict[str, Any], *, indent: int = 2) -> Path:
    """Write ``doc`` plus the environment to benchmarks/results/NAME and say where (a doc without a
    ``command`` gets the one that ran this process)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    doc = dict(doc)
    doc.setdefault("command", invocation())
    env = environment(**doc.pop("machine_extra", {}))
    path.write_text(json.dumps({**doc, **env}, indent=indent))
    print(f"wrote {path}")
    return path


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measure_child(prepare: Callable[[], Any], run: Callable[[Any], Any], q: Any) -> None:
    torch.set_num_threads(1)
    inputs = prepare()
    before = _rss_bytes()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    run(inputs)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    q.put(max(peak, peak_before) - before)


def peak_memory_growth(prepare: Callable[[], Any], run: Callable[[Any], Any], what: str) -> int:
    """Bytes of peak resident memory ``run(prepare())`` adds over what ``prepare`` left, in a forked child
    (one torch thread), so that one measurement's peak never hides the next one's."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_measure_child, args=(prepare, run, q))
    p.start()
    p.join()
    if p.exitcode != 0:
        raise RuntimeError(f"{what}: the measuring child failed with exit code {p.exitcode}")
    return int(q.get())
