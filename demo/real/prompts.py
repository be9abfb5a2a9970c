"""Prompts for the real text target, made from the Python standard library on this machine.

A drafter for a real model should be trained and judged on the kind of requests it will serve. With no
dataset to download, the interpreter ships thousands of documented functions: each gives a few plain
requests (what it does, an example, its docstring explained). Held-out prompts come from MODULES the
training prompts never mention, so a drafter is judged on topics it did not see, not on paraphrases.

    from tapdraft.demo.real.prompts import prompt_splits
    splits = prompt_splits(train=2000, validation=64, held_out=64)   # {"train": [...], ...}: conversations
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import random
import re
import sys
import warnings

from tapdraft.capture.replies.requests import PENDING

TEMPLATES = (
    "What does `{qual}` do in Python?",
    "Write a short Python example that uses `{qual}`.",
    "Explain this Python documentation in simple words:\n\n{doc}",
    "When should I use `{qual}`, and what are its arguments?",
)

SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "pydoc_data",
        "ensurepip", "venv", "msilib", "winreg", "winsound", "_winapi", "nt", "msvcrt", "ctypes"}


def _modules() -> list[str]:
    names = sorted(m for m in getattr(sys, "stdlib_module_names", ()) if not m.startswith("_") and m not in SKIP)
    return names


def _first_paragraph(doc: str, limit: int = 400) -> str:
    para = re.split(r"\n\s*\n", inspect.cleandoc(doc).strip())[0]
    return " ".join(para.split())[:limit]


def documented(module_names=None) -> list[tuple[str, str, str]]:
    """(module, qualified name, first docstring paragraph) of every public documented function and class,
    in a fixed order."""
    out = []
    for name in module_names or _modules():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(name)
        except Exception:  # a module this platform lacks (or that needs a display): not a prompt source
            continue
        for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            if getattr(obj, "__module__", name) not in (name, None) and not name.startswith(
                    str(getattr(obj, "__module__", "")).split(".")[0]):
                continue  # re-exported from elsewhere: counted where it lives
            doc = inspect.getdoc(obj) or ""
            para = _first_paragraph(doc) if doc else ""
            if len(para) < 40:
                continue
            out.append((name, f"{name}.{attr}", para))
    return out


def _held_out(module: str) -> bool:
    """One module in eight, by a hash of its name: stable across Python versions and machines."""
    return hashlib.sha256(module.encode()).digest()[0] % 8 == 0




def conversation(sample_id: str, prompt: str) -> dict:
    """One JSONL record for ``tapdraft regenerate`` (the reply is the target's to write)."""
    return {"id": sample_id, "conversations": [{"from": "User", "type": "text", "value": prompt},
                                               {"from": "Assistant", "type": "text", "value": PENDING}]}


def prompt_splits(train: int, validation: int, held_out: int, seed: int = 0) -> dict[str, list[dict]]:
    """Conversations: ``train`` and ``validation`` from the same modules (disjoint prompts), ``held_out``
    from modules neither mentions. Raises ValueError when this interpreter documents too few."""
    seen, known, unseen = set(), [], []
    for module, qual, doc in documented():
        for t, template in enumerate(TEMPLATES):
            text = template.format(qual=qual, doc=doc)
            if text in seen:
                continue
            seen.add(text)
            (unseen if _held_out(module) else known).append((f"{qual}#{t}", text))
    rng = random.Random(seed)
    rng.shuffle(known)
    rng.shuffle(unseen)
    if len(known) < train + validation or len(unseen) < held_out:
        raise ValueError(f"this Python documents {len(known)} training and {len(unseen)} held-out prompts; asked "
                         f"for {train + validation} and {held_out}: ask for fewer")
    pick = {"train": known[:train], "validation": known[train:train + validation], "held_out": unseen[:held_out]}
    return {split: [conversation(i, p) for i, p in items] for split, items in pick.items()}


OTHER_TEMPLATES = (
    "Write a short story about {subject}.",
    "Give me three tips for {activity}.",
    "Explain to a child how {thing} works.",
    "Write a friendly email inviting a colleague to {event}.",
)
SUBJECTS = ("a lighthouse keeper", "a lost umbrella", "a robot who learns to paint", "two rival bakers",
            "a dragon afraid of the dark", "a girl who collects maps", "the last train of the night",
            "a talking garden gnome", "a storm at sea", "an old violin")
ACTIVITIES = ("sleeping better", "learning to cook", "running a first marathon", "saving money", "growing tomatoes",
              "speaking in public", "travelling on a budget", "keeping a plant alive", "studying for exams",
              "training a puppy")
THINGS = ("a rainbow", "a bicycle", "the moon's phases", "a fridge", "an airplane", "a volcano", "a compass",
          "a microwave oven", "the heart", "a telescope")
EVENTS = ("a team lunch", "a board game night", "a charity run", "a book club", "a farewell party",
          "a picnic in the park", "a cooking class", "a hiking trip", "a movie night", "a chess tournament")


def other_prompts(n: int, seed: int = 0) -> list[dict]:
    """Requests of another kind than ``prompt_splits``'s: everyday writing and explaining, no Python, so that a
    drafter trained on the library's requests is also judged off its own distribution."""
    fill = {"subject": SUBJECTS, "activity": ACTIVITIES, "thing": THINGS, "event": EVENTS}
    texts = [template.format(**{k: v}) for template in OTHER_TEMPLATES for k, vs in fill.items()
             if "{" + k + "}" in template for v in vs]
    if n > len(texts):
        raise ValueError(f"there are {len(texts)} requests of the other kind; asked for {n}: ask for fewer")
    random.Random(seed).shuffle(texts)
    return [conversation(f"other-{i:05d}", t) for i, t in enumerate(texts[:n])]
