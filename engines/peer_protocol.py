"""What the peer trainers' runners (engines/modelopt_runner.py, engines/speculators_runner.py) share, run INSIDE a
peer's venv (the standard library and torch only): the JSON line protocol, the AdamW both sides of a comparison use,
the timed step and the process's own peak memory. ``python engines/NAME_runner.py`` finds this module beside it.

Protocol: the runner's first line out is its ready document; then one command a line on stdin, one JSON line back
each: ``step`` -> {"s": SECONDS, "loss": L, ...the runner's counts} (forward + backward + optimizer step, timed
here), ``load`` -> {"samples": [...]} (what the peer's own loader read), ``exit`` -> {"peak_rss": BYTES}.
"""

import json
import resource
import sys
import time


def channel():
    """``say(doc)``: one JSON line on the protocol's channel. The real stdout is kept for it and ``sys.stdout`` sent
    to stderr (the runner's log), so a library that prints cannot break the protocol."""
    out = sys.stdout
    sys.stdout = sys.stderr

    def say(doc):
        out.write(json.dumps(doc) + "\n")
        out.flush()

    return say


def adamw(params, job):
    """AdamW over the trainable ``params`` as tapdraft's side builds it: weight decay on matrices only, the job's
    lr, betas and decay, no schedule."""
    import torch

    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": job["weight_decay"]},
                              {"params": no_decay, "weight_decay": 0.0}], lr=job["lr"], betas=tuple(job["betas"]))


def peak_rss():
    """This process's peak RSS in bytes: VmHWM, its own address space's since exec (``ru_maxrss`` would be at least
    the parent's RSS when it forked this runner, so a large tapdraft process would show as the peer's peak)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def serve(say, forward, opt, samples):
    """Answer commands until ``exit``. ``forward()`` -> (loss tensor, counts dict read after the forward);
    ``samples()`` -> the peer loader's samples as lists."""
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "step":
            t0 = time.perf_counter()
            loss, counts = forward()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            say({"s": time.perf_counter() - t0, "loss": float(loss.detach()), **counts})
        elif cmd == "load":
            say({"samples": samples()})
        elif cmd == "exit":
            break
        else:
            say({"error": f"unknown command {cmd!r}"})
    say({"peak_rss": peak_rss()})
