"""What the peer trainers' runners (engines/peers/modelopt_runner.py, engines/peers/speculators_runner.py) share, run INSIDE a
peer's venv (the standard library and torch only): the JSON line protocol, the AdamW both sides of a comparison use,
the timed step and the process's own peak memory. ``python engines/peers/NAME_runner.py`` finds this module beside it.

Protocol: the runner's first line out is its ready document; then one command a line on stdin, one JSON line back
each: ``step`` -> {"s": SECONDS, "loss": L, "dtypes": {...}, ...the runner's counts} (forward + backward + optimizer
step, timed here), ``heldout`` -> {"loss": L, ...counts} (the loss on the held-out batch, no gradient, the RNG seeded
with ``HELDOUT_SEED`` and restored after, so it neither trains nor shifts the training draws), ``load`` ->
{"samples": [...]} (what the peer's own loader read), ``exit`` -> {"peak_rss": BYTES}.
"""

import json
import resource
import sys
import time

HELDOUT_SEED = 1234
"""The RNG seed of every held-out evaluation (its anchors), on both sides of a row."""


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


def dtype_probe(parts):
    """Record the dtype each part computes in: ``parts`` maps a name (head, embedding, draft) to its modules; a
    forward hook on each notes its outputs' dtypes (autocast included). ``read()`` -> {name: dtype} ("a/b" when a
    part computed in two), a part whose hooks never ran (its weight used directly, not called) by its weight's dtype.
    """
    seen = {}

    def hook(name):
        def note(module, args, out):
            if hasattr(out, "dtype"):
                seen.setdefault(name, set()).add(str(out.dtype).removeprefix("torch."))
        return note

    for name, modules in parts.items():
        for m in modules:
            m.register_forward_hook(hook(name))

    def read():
        out = {}
        for name, modules in parts.items():
            got = seen.get(name) or {str(next(m.parameters()).dtype).removeprefix("torch.") for m in modules[:1]}
            out[name] = "/".join(sorted(got))
        return out

    return read


def serve(say, forward, opt, samples, heldout=None):
    """Answer commands until ``exit``. ``forward()`` -> (loss tensor, counts dict read after the forward);
    ``heldout()`` -> the same on the held-out batch (called here without gradient, the RNG seeded); ``samples()`` ->
    the peer loader's samples as lists."""
    import torch

    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "step":
            t0 = time.perf_counter()
            loss, counts = forward()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            say({"s": time.perf_counter() - t0, "loss": float(loss.detach()), **counts})
        elif cmd == "heldout" and heldout is not None:
            with torch.random.fork_rng(), torch.no_grad():
                torch.manual_seed(HELDOUT_SEED)
                loss, counts = heldout()
            say({"loss": float(loss), **counts})
        elif cmd == "load":
            say({"samples": samples()})
        elif cmd == "exit":
            break
        else:
            say({"error": f"unknown command {cmd!r}"})
    say({"peak_rss": peak_rss()})
