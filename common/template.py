"""Chat-template settings: the template text and kwargs a dataset was captured with, and the one check
that refuses a mismatch.

A conversation becomes tokens through the chat template and its kwargs (``enable_thinking``, a
system prompt, a date string...). Change either and the target sees other tokens: template drift is
reported to halve acceptance, so a drafter must be trained, evaluated and served with the settings
its dataset was captured with. The settings live in the target bundle (``chat_template``,
``template_kwargs``) and in the fingerprint; :func:`check_template` is what the trainer, eval and
live decoding call with what they were given.

Kwargs are plain JSON values under identifier keys; a key that ``apply_chat_template`` itself takes
(``messages``, ``add_generation_prompt``, ...) is refused, because it would not reach the template.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable, Mapping

RESERVED_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
})
"""Names ``apply_chat_template`` consumes itself (or that the capture sets): not template kwargs."""


def template_kwargs(kwargs: Mapping[str, Any] | Iterable[tuple[str, Any]] | None) -> dict[str, Any]:
    """Validated template kwargs as a new dict with sorted keys (the canonical form stored and compared)."""
    items = dict(kwargs or {})
    for key, value in items.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"template kwarg name {key!r} must be a Python identifier (e.g. enable_thinking)")
        if key in RESERVED_KWARGS:
            raise ValueError(f"template kwarg {key!r} is set by tapdraft itself, not by the template; drop it")
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"template kwarg {key}={value!r} is not a JSON value ({e})") from None
    return {k: items[k] for k in sorted(items)}


def parse_template_kwargs(pairs: Iterable[str]) -> dict[str, Any]:
    """``key=value`` strings (as the CLI takes them) -> kwargs. A value is read as JSON when it parses
    (``false``, ``3``, ``"text"``, ``[1, 2]``), otherwise it is the literal string."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--template-kwarg {pair!r} must look like key=value (e.g. enable_thinking=false)")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out[key.strip()] = value
    return template_kwargs(out)


def read_template_file(path: str | Path) -> str:
    """The Jinja text of a ``--chat-template`` file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"chat template file {p} does not exist; pass a Jinja file to --chat-template")
    text = p.read_text()
    if not text.strip():
        raise ValueError(f"chat template file {p} is empty")
    return text


def template_sha(text: str | None) -> str | None:
    """sha256 of a template's text (None for no template)."""
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


def describe_template(text: str | None, kwargs: Mapping[str, Any]) -> str:
    """One phrase naming a template setting: its hash and kwargs."""
    sha = template_sha(text)
    kw = json.dumps(dict(kwargs), sort_keys=True)
    return f"chat template {sha[:12] if sha else '(none)'} with kwargs {kw}"


def check_template(
    dataset: tuple[str | None, Mapping[str, Any]],
    *,
    template: str | None = None,
    kwargs: Mapping[str, Any] | None = None,
    where: str,
    given_by: str,
    hint: str = "use the capture's --chat-template/--template-kwarg settings (tapdraft inspect shows them) or a "
                "dataset captured with yours",
) -> None:
    """Refuse (one-line ValueError) when the given template text or kwargs differ from the dataset's.

    ``dataset`` is the (template text, kwargs) the dataset was captured with. ``template``/``kwargs``
    are what the caller was given; None for either means "no expectation" for that part.
    """
    d_text, d_kw = dataset[0], template_kwargs(dataset[1])
    diffs = []
    if template is not None and template != d_text:
        diffs.append(f"chat template {_short(template)} (the dataset's is {_short(d_text)})")
    if kwargs is not None and template_kwargs(kwargs) != d_kw:
        diffs.append(f"template kwargs {json.dumps(template_kwargs(kwargs), sort_keys=True)} (the dataset's are "
                     f"{json.dumps(d_kw, sort_keys=True)})")
    if diffs:
        raise ValueError(f"{where} was captured with other chat-template settings: {given_by} has "
                         + " and ".join(diffs) + f"; {hint}")


def _short(text: str | None) -> str:
    sha = template_sha(text)
    return "(none)" if sha is None else f"sha256 {sha[:12]}"
