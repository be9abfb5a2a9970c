"""Chat templates as they are: render a conversation, tokenize it, and derive which tokens are supervised.

Most HF chat templates carry no ``{% generation %}`` markers, so the assistant mask is derived from
the template itself by prefix rendering. For the assistant message at index i:

    P_i = tokens of render(messages[:i], add_generation_prompt=True)    what the model is prompted with
    Q_i = tokens of render(messages[:i + 1])                           the conversation through the turn
    F   = tokens of render(messages)                                   the sample

The turn is supervised on F[len(P_i):len(Q_i)] when P_i and Q_i are both token prefixes of F: those
are the tokens the model produces after its prompt, as the sample holds them. Tokens after the last
end-of-turn token of that span (the newline a template writes between turns) stay unsupervised:
decoding stops at the end-of-turn token and never emits them.

When a check fails, the turn is left unsupervised and the reason kept (capture counts such turns):
- Q_i is not a prefix of F: the template renders the turn differently once later turns follow (Qwen3
  drops the reasoning block of turns before the last user message), so the tokens the model produced
  are not in the sample; supervising what is there would teach the drafter text the target never wrote.
- P_i is not a prefix of F: the sample does not hold the generation prompt (Qwen3 with thinking off
  prompts with an empty think block that earlier turns lack), or the tokenizer merges text across the
  turn boundary (the prompt's last tokens differ from the sample's at that place).
A conversation left with no supervised token is refused with the first reason (capture's on_error).

A template with ``{% generation %}`` markers keeps them: the mask is HF's ``return_assistant_tokens_mask``,
and wherever prefix rendering knows the answer (the turns it could check, up to their end-of-turn
token, and the prompts between them) both must agree; a disagreement refuses the sample (the markers
and the template say different things). Turns it cannot check, and whether the newline after an
end-of-turn token is supervised, follow the markers.

A reply that carries the ids the target generated (``token_ids`` on the turn, written by ``tapdraft
regenerate``) keeps them: decoding and re-encoding its text can give other ids (a BPE tokenizer merges
the text differently from how it was sampled), which would store a reply the target never produced. The
rendered text is cut at each carried reply's content (written verbatim after its generation prompt, and
its ids must decode to it), the pieces between are encoded separately and the ids go in between: the
first piece is exactly the prompt the target saw, and ``regenerate`` prompts later turns through the same
splice (:meth:`ChatTemplate.encode_prompt`). A carried reply is supervised on its ids plus the end of turn
the template writes, unless it is marked ``truncated`` (cut at max_new_tokens: no end of turn was
generated, so none is supervised). Text replies beside carried ones use prefix rendering within their
piece; generation markers are not consulted. Conversations without carried ids are tokenized as before.

Template text and kwargs (``enable_thinking``, a system prompt...) are fixed per capture and recorded
in the target bundle; ``common.template`` holds their canonical form and the drift check.

Text is bounded before it is tokenized (:meth:`ChatTemplate.check_text_size`): a 50 MB text turn made the Rust
tokenizer abort the whole process (SIGABRT, exit 134) failing to allocate (it needs ~110 bytes a character: 440 MB
for 4 M characters). A conversation whose text is longer than the target's positions can hold at its tokenizer's
longest token (81 characters for SmolLM2's BPE: a text past it has more tokens than positions whatever it
says) is a bad input, never tokenized; so is any text past ``MAX_TEXT_CHARS``, the bound of a target whose
positions are unknown. (A word-level vocabulary can map a longer unknown word to one token: there the bound is a
size limit, not a proof.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch

from tapdraft.common.template import template_kwargs

MAX_TEXT_CHARS = 1 << 24
"""Characters of text a conversation may have at most, whatever the target (16 Mi: ~1.8 GB inside the tokenizer;
4 M tokens at 4 characters a token, past any speech target's context). Lower for a target whose positions at its
tokenizer's longest token hold less (:meth:`ChatTemplate.text_bound`)."""

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
MASK_BY_MARKERS = "generation markers"
MASK_BY_PREFIX = "prefix rendering"


@dataclass
class Tokenized:
    """A conversation as tokens: ids int64 [L], supervised mask bool [L], and the turns left unsupervised."""

    ids: torch.Tensor
    mask: torch.Tensor
    unsupervised: list[str] = field(default_factory=list)
    """One reason per assistant turn that is not supervised."""


class ChatTemplate:
    """A tokenizer's chat template (or an override) rendered with fixed kwargs."""

    def __init__(self, tokenizer: Any, text: str | None = None, kwargs: Mapping[str, Any] | None = None, *,
                 end_ids: Iterable[int] = ()):
        text = text if text is not None else tokenizer.chat_template
        if isinstance(text, dict):  # named templates: the default one is the chat template
            text = text.get("default")
        if not text:
            raise ValueError("the tokenizer has no chat template; give one with --chat-template FILE")
        self.tokenizer = tokenizer
        self.text: str = text
        self.kwargs: dict[str, Any] = template_kwargs(kwargs)
        self.end_ids = frozenset(int(i) for i in end_ids)
        self.has_markers = GENERATION_MARKER.search(text) is not None
        self._longest: int | None = None

    def longest_token(self) -> int | None:
        """Characters of the tokenizer's longest token (added tokens included; a byte-level BPE token's string has a
        character per byte, so never fewer than the text it stands for); None when the tokenizer lists no vocabulary."""
        if self._longest is None:
            vocab = getattr(self.tokenizer, "get_vocab", lambda: {})()
            self._longest = max((len(t) for t in vocab), default=0)
        return self._longest or None

    def text_bound(self, max_positions: int | None) -> tuple[int, str]:
        """(most characters of text a conversation may have, why): ``max_positions`` at the longest token, at most
        ``MAX_TEXT_CHARS``."""
        longest = self.longest_token()
        if max_positions is None or longest is None or max_positions * longest >= MAX_TEXT_CHARS:
            return MAX_TEXT_CHARS, "tapdraft tokenizes at most"
        return max_positions * longest, (f"the target's {max_positions} positions hold at {longest} characters a "
                                         "token (its tokenizer's longest)")

    def check_text_size(self, messages: Sequence[Mapping[str, Any]], max_positions: int | None) -> None:
        """ValueError, before anything is rendered or tokenized, when the text of ``messages`` is longer than
        :meth:`text_bound` (module docstring): it names the longest turn and what to do."""
        sizes = [len(m["content"]) if isinstance(m.get("content"), str) else 0 for m in messages]
        bound, why = self.text_bound(max_positions)
        if sum(sizes) > bound:
            j = max(range(len(sizes)), key=sizes.__getitem__)
            raise ValueError(f"too long to tokenize: its text is {sum(sizes):,} characters (turn {j + 1}, "
                             f"{messages[j].get('role')}: {sizes[j]:,}), more than the {bound:,} {why}; it was not "
                             "tokenized: shorten or split the conversation")

    @property
    def mask_source(self) -> str:
        return MASK_BY_MARKERS if self.has_markers else MASK_BY_PREFIX

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages``; ValueError when the template refuses them (``raise_exception``).
        A reply's carried ids (``token_ids``, ``truncated``) are not shown to the template."""
        from jinja2 import TemplateError

        if any(carries_ids(m) for m in messages):
            messages = [{k: v for k, v in m.items() if k not in CARRIED_KEYS} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(list(messages), chat_template=self.text, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **self.kwargs)
        except TemplateError as e:
            raise ValueError(f"the chat template refuses this conversation: {e}") from None

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text (the template writes its own special tokens)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Ids of ``messages`` rendered with the generation prompt (what the target is prompted with), carried
        replies spliced in as they were generated."""
        text = self.render(messages, add_generation_prompt=True)
        if any(carries_ids(m) for m in messages):
            return _Spliced(self, messages, text).ids
        return self.encode(text)

    def tokenize(self, messages: Sequence[Mapping[str, Any]]) -> Tokenized:
        """Ids and supervised mask of a conversation; ValueError when no token is supervised."""
        if any(carries_ids(m) for m in messages):
            return self._tokenize_carried(messages)
        text = self.render(messages)
        enc = _Encoded(self, text)
        full = enc.ids
        spans, reasons, known = self._prefix_spans(messages, text, enc)
        derived = torch.zeros(len(full), dtype=torch.bool)
        for s, e in spans:
            derived[s:e] = True
        if self.has_markers:
            mask = self._marker_mask(messages, full)
            bad = torch.nonzero((mask != derived) & known).flatten()
            if bad.numel():
                j = int(bad[0])
                raise ValueError(
                    f"the chat template's {{% generation %}} markers and its prefix rendering disagree at token {j} "
                    f"({self._show(full, j)}: markers say {'' if mask[j] else 'not '}supervised); fix the markers or "
                    "pass a template without them with --chat-template"
                )
            reasons = []  # turns prefix rendering cannot check follow the markers
            if not bool(mask.any()):
                raise ValueError("no supervised tokens: the template's {% generation %} markers mark none (are the "
                                 "assistant turns empty?)")
        else:
            mask = derived
            if not bool(mask.any()):
                why = reasons[0] if reasons else "the conversation has no assistant turn"
                raise ValueError(f"no supervised tokens: {why}")
        return Tokenized(torch.tensor(full, dtype=torch.long), mask, reasons)

    def _tokenize_carried(self, messages: Sequence[Mapping[str, Any]]) -> Tokenized:
        """A conversation whose replies carry the ids the target generated: those ids are the reply's tokens
        (no text round trip), the text between them is encoded piece by piece (module docstring)."""
        text = self.render(messages)
        sp = _Spliced(self, messages, text)
        mask = torch.zeros(len(sp.ids), dtype=torch.bool)
        reasons: list[str] = []
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        for n, i in enumerate(turns):
            got = sp.turn_span(i, f"assistant turn {n + 1} of {len(turns)}")
            if isinstance(got, str):
                reasons.append(got)
            else:
                mask[got[0]:got[1]] = True
        if not bool(mask.any()):
            why = reasons[0] if reasons else "the conversation has no assistant turn"
            raise ValueError(f"no supervised tokens: {why}")
        return Tokenized(torch.tensor(sp.ids, dtype=torch.long), mask, reasons)

    # ------------------------------------------------------------------ derivation
    def _prefix_spans(self, messages: Sequence[Mapping[str, Any]], text: str, enc: "_Encoded"
                      ) -> tuple[list[tuple[int, int]], list[str], torch.Tensor]:
        """Checked spans [start, end) of F, reasons for unchecked turns, positions whose truth is known.

        Texts are compared first (cheap), tokens only for the turns whose texts are prefixes."""
        full = enc.ids
        spans: list[tuple[int, int]] = []
        reasons: list[str] = []
        # positions whose truth prefix rendering knows: checked spans (the tokens a template writes after a
        # turn's end-of-turn token are left to the markers) and the stretches between checked turns
        known = torch.zeros(len(full), dtype=torch.bool)
        prev_end: int | None = 0  # where the last checked turn ended (None: after an unchecked turn)
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        for n, i in enumerate(turns):
            got = self._check_turn(messages, i, f"assistant turn {n + 1} of {len(turns)}", text, enc)
            if isinstance(got, str):
                reasons.append(got)
                prev_end = None
                continue
            start, end, through = got
            spans.append((start, end))
            known[start:end] = True
            if prev_end is not None:
                known[prev_end:start] = True  # the prompt since the previous turn: never supervised
            prev_end = through
        return spans, reasons, known

    def _check_turn(self, messages: Sequence[Mapping[str, Any]], i: int, where: str, text: str, enc: "_Encoded"
                    ) -> tuple[int, int, int] | str:
        """(start, end, end of the turn's rendering) in F's tokens of assistant message i, or why it is unchecked."""
        full = enc.ids
        if i == 0:
            return f"{where} opens the conversation: there is no prompt to render before it"
        p_text = self.render(messages[:i], add_generation_prompt=True)
        q_text = self.render(messages[: i + 1])
        if not text.startswith(p_text):
            c = _text_mismatch(p_text, text)
            return (f"{where}: its generation prompt is not a prefix of the conversation (character {c}: "
                    f"prompt {p_text[c:c + 16]!r}, conversation {text[c:c + 16]!r}); the template renders "
                    "the prompt differently from the conversation")
        if not text.startswith(q_text):
            c = _text_mismatch(q_text, text)
            return (f"{where}: rendered as the last turn it differs from the conversation (character {c}: "
                    f"{q_text[c:c + 16]!r} vs {text[c:c + 16]!r}); the template renders it differently once "
                    "later turns follow, so its produced tokens are not in the sample")
        prompt, through = enc.prefix_ids(p_text), enc.prefix_ids(q_text)
        j = _mismatch(prompt, full)
        if j is not None:
            return (f"{where}: its generation prompt is not a prefix of the conversation's tokens "
                    f"(token {j}: prompt {self._show(prompt, j)}, conversation {self._show(full, j)}); "
                    "the tokenizer merges text across the turn boundary")
        j = _mismatch(through, full)
        if j is not None:
            return (f"{where}: its tokens are not a prefix of the conversation's (token {j}: "
                    f"{self._show(through, j)} vs {self._show(full, j)}); the tokenizer merges text across "
                    "the end of the turn")
        start, end = len(prompt), len(through)
        last_end = max((k for k in range(start, end) if full[k] in self.end_ids), default=None)
        if last_end is not None:
            end = last_end + 1
        if end <= start:
            return f"{where} is empty"
        return start, end, len(through)

    def _marker_mask(self, messages: Sequence[Mapping[str, Any]], full: list[int]) -> torch.Tensor:
        out = self.tokenizer.apply_chat_template(list(messages), chat_template=self.text, tokenize=True,
                                                 return_dict=True, return_assistant_tokens_mask=True, **self.kwargs)
        if list(out["input_ids"]) != full:
            raise AssertionError("apply_chat_template tokenized the conversation differently from render + encode")
        return torch.tensor(out["assistant_masks"], dtype=torch.bool)

    def _show(self, ids: list[int], j: int) -> str:
        return repr(self.tokenizer.decode([ids[j]])) if j < len(ids) else "<end>"


CARRIED_KEYS = ("token_ids", "truncated")
"""A reply's carried ids (``capture.inputs``): the ids the target generated, and whether it hit the token limit."""


def carries_ids(message: Mapping[str, Any]) -> bool:
    """The message is a reply that carries the ids the target generated."""
    return message.get("token_ids") is not None


class _Spliced:
    """A rendered conversation whose carried replies keep their generated ids.

    The text is cut at each carried reply's content (which the template must write verbatim right after
    that turn's generation prompt, and which the ids must decode to); the pieces between are encoded
    separately, so the first piece is exactly the first carried turn's prompt as the target saw it, and
    every later prompt is built the same way when ``regenerate`` prompts the next turn.
    """

    def __init__(self, ct: ChatTemplate, messages: Sequence[Mapping[str, Any]], text: str):
        self.ct, self.messages, self.text = ct, messages, text
        self.ids: list[int] = []
        self.pieces: list[tuple[int, int, int]] = []  # (start char, end char, first token) of each text piece
        self.replies: dict[int, tuple[int, int, int]] = {}  # message index -> (first token, end token, end char)
        cur = 0
        for i, m in enumerate(messages):
            if not carries_ids(m):
                continue
            where = f"message {i}"
            if m.get("role") != "assistant" or i == 0:
                raise ValueError(f"{where} carries token_ids but is not an assistant reply to a prompt")
            prompt = ct.render(messages[:i], add_generation_prompt=True)
            content = m["content"]
            if not text.startswith(prompt) or text[len(prompt):len(prompt) + len(content)] != content:
                raise ValueError(f"{where} carries token_ids, but the chat template does not write its text verbatim "
                                 "right after its generation prompt, so the ids have no place in the conversation; "
                                 "drop its token_ids to capture the text")
            got = ct.tokenizer.decode(list(m["token_ids"]), skip_special_tokens=False,
                                      clean_up_tokenization_spaces=False)
            if got != content:
                raise ValueError(f"{where}: its token_ids decode to {got[:40]!r}, not to its text {content[:40]!r}; "
                                 "the ids belong to another reply or another tokenizer")
            self._piece(cur, len(prompt))
            start = len(self.ids)
            self.ids += [int(t) for t in m["token_ids"]]
            cur = len(prompt) + len(content)
            self.replies[i] = (start, len(self.ids), cur)
        self._piece(cur, len(text))

    def _piece(self, start: int, end: int) -> None:
        self.pieces.append((start, end, len(self.ids)))
        self.ids += self.ct.encode(self.text[start:end])

    def _piece_at(self, char: int) -> tuple[int, int, int]:
        return next(p for p in self.pieces if p[0] <= char <= p[1])

    def turn_span(self, i: int, where: str) -> tuple[int, int] | str:
        """Supervised [start, end) tokens of assistant message i, or why it is left unsupervised."""
        q_text = self.ct.render(self.messages[: i + 1])
        if not self.text.startswith(q_text):
            return (f"{where}: rendered as the last turn it differs from the conversation; the template renders it "
                    "differently once later turns follow, so its produced tokens are not in the sample")
        end_ids = self.ct.end_ids
        if i in self.replies:  # the generated ids, then the end of turn the template writes (unless cut at the limit)
            start, end, char = self.replies[i]
            if self.messages[i].get("truncated"):
                return start, end
            tail = self.ct.encode(self.text[char:len(q_text)])
            last = max((k for k, t in enumerate(tail) if t in end_ids), default=len(tail) - 1)
            if self.ids[end:end + last + 1] == tail[:last + 1]:
                end += last + 1
            return start, end
        # a text reply among carried ones: prefix rendering inside its piece (as ChatTemplate._check_turn)
        if i == 0:
            return f"{where} opens the conversation: there is no prompt to render before it"
        p_text = self.ct.render(self.messages[:i], add_generation_prompt=True)
        if not self.text.startswith(p_text):
            return f"{where}: its generation prompt is not a prefix of the conversation"
        c0, c1, t0 = self._piece_at(len(p_text))
        if len(q_text) > c1:
            return f"{where}: its rendering runs into a carried reply"
        piece = self.ids[t0:t0 + len(self.ct.encode(self.text[c0:c1]))]
        prompt, through = self.ct.encode(self.text[c0:len(p_text)]), self.ct.encode(self.text[c0:len(q_text)])
        if _mismatch(prompt, piece) is not None or _mismatch(through, piece) is not None:
            return f"{where}: the tokenizer merges text across the turn's boundaries"
        start, end = len(prompt), len(through)
        last_end = max((k for k in range(start, end) if piece[k] in end_ids), default=None)
        if last_end is not None:
            end = last_end + 1
        if end <= start:
            return f"{where} is empty"
        return t0 + start, t0 + end


def _text_mismatch(prefix: str, text: str) -> int:
    """First character where ``prefix`` and ``text`` differ."""
    return next((c for c, (a, b) in enumerate(zip(prefix, text)) if a != b), min(len(prefix), len(text)))


class _Encoded:
    """A rendered conversation's tokens, and the tokens of any prefix of its text without encoding it whole.

    HF tokenizers (fast and slow) first split a text on its added tokens (the specials a template
    writes) and encode the pieces between them independently. So a text prefix that ends after added
    token a of the conversation encodes as the conversation's tokens before a, then the encoding of
    the prefix's text from a on; starting that re-encoding at the added token itself keeps a piece
    that is not the text's first one from being treated as first (Metaspace's prepend scheme "first").
    This turns the quadratic cost of encoding every turn's prefix into encoding the last turn of each.
    ``tests/capture/test_template.py`` checks it against whole encodings at every cut of several tokenizers.
    """

    def __init__(self, ct: ChatTemplate, text: str):
        self.ct = ct
        tok = ct.tokenizer
        self.anchors: list[tuple[int, int, int]] = []  # (end char, start char, token index) of each added token
        if getattr(tok, "is_fast", False):
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            self.ids = list(enc["input_ids"])
            added = {i: t.content for i, t in tok.added_tokens_decoder.items()}
            self.anchors = [(e, s, k) for k, (t, (s, e)) in enumerate(zip(self.ids, enc["offset_mapping"]))
                            if t in added and added[t] in text[s:e]]  # matched in the text (not an <unk> output)
        else:
            self.ids = ct.encode(text)

    def prefix_ids(self, prefix: str) -> list[int]:
        """The token ids ``prefix`` (a prefix of the text) encodes to."""
        start_char = start_tok = 0
        for end, s, k in self.anchors:
            if end > len(prefix):
                break
            start_char, start_tok = s, k
        return self.ids[:start_tok] + self.ct.encode(prefix[start_char:])


def _mismatch(prefix: list[int], full: list[int]) -> int | None:
    """First index where ``prefix`` is not ``full``'s prefix (None when it is one)."""
    if full[: len(prefix)] == prefix:
        return None
    for j, t in enumerate(prefix):
        if j >= len(full) or full[j] != t:
            return j
    return None
