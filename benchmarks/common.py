"""What every benchmark writes beside its figures: where results go, library versions, the machine."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

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
