"""What a regenerated conversation is: which turns are replaced, its resume key, its output record.

The resume key (:func:`prefix_key`) is a sha256 over what regenerating a conversation reads: its
sample id, its turns with the replaced assistant turns blanked, and its audio references (path,
offset, duration; a content hash for audio given as bytes or arrays). Row position never enters it,
so a rerun finds the conversations it already did wherever they sit in the file.

An output record is the input record with its other fields kept and its turns rewritten as text
turns (placeholders inline, each listing its audios by a path relative to the output), which
``capture.inputs.read_jsonl`` reads back; ``regenerated_by`` names the target fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capture.generate import GenerationConfig
from capture.inputs import AudioRef, BadInput, Conversation
from shards.atomic import staged


@dataclass(frozen=True)
class ReplyConfig:
    """Which assistant turns the target rewrites and how (shared by ``regenerate`` and ``capture --regenerate``)."""

    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Greedy or seeded sampling, and the reply length cap."""
    last_turn_only: bool = False
    """Replace only the last assistant turn (earlier ones stay as given)."""
    keep_truncated: bool = False
    """Keep replies that hit max_new_tokens, marked ``"truncated": true``, instead of dropping them."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Chat-template variables (``enable_thinking``, ...), applied to every prompt and recorded."""

    def __post_init__(self) -> None:
        if not isinstance(self.generation, GenerationConfig):
            raise ValueError("ReplyConfig.generation must be a GenerationConfig")
        if not isinstance(self.template_kwargs, dict):
            raise ValueError("ReplyConfig.template_kwargs must be a dict of chat-template variables")

    @property
    def from_target(self) -> bool:
        """Every supervised turn is the target's own greedy reply (offline tau is then exact for greedy decoding)."""
        return self.generation.greedy and not self.last_turn_only

    def to_dict(self) -> dict[str, Any]:
        return {"generation": self.generation.to_dict(), "last_turn_only": self.last_turn_only,
                "keep_truncated": self.keep_truncated, "template_kwargs": dict(self.template_kwargs)}


# ------------------------------------------------------------------------------------------ keys and turns
def regenerated_turns(messages: list[dict[str, str]], last_only: bool) -> list[int]:
    """Indices of the assistant messages to replace."""
    idx = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return idx[-1:] if last_only else idx


def _audio_key(ref: AudioRef) -> list[Any]:
    if ref.data is not None:
        return ["bytes", hashlib.sha256(ref.data).hexdigest()]
    if ref.array is not None:
        import numpy as np

        return ["array", hashlib.sha256(np.ascontiguousarray(ref.array).tobytes()).hexdigest(), ref.sample_rate]
    return ["path", ref.path, ref.offset, ref.duration]


def prefix_key(item: Conversation | BadInput, last_only: bool) -> str:
    """Content hash of what regenerating ``item`` reads (replaced turns blanked): the resume key."""
    if isinstance(item, BadInput):
        doc: Any = ["bad", item.sample_id, item.source, item.line, item.reason]
    else:
        turns = set(regenerated_turns(item.messages, last_only))
        msgs = [[m["role"], None if i in turns else m["content"]] for i, m in enumerate(item.messages)]
        doc = [item.sample_id, msgs, [_audio_key(a) for a in item.audios]]
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def output_record(conv: Conversation, messages: list[dict[str, str]], out_dir: Path, placeholder: str,
                  fingerprint: str, truncated: bool) -> dict[str, Any]:
    """The conversation as a JSONL record capture reads back: the input record's other fields kept,
    turns rewritten (text with placeholders, each listing its audios relative to the output)."""
    audios = list(conv.audios)
    turns = []
    for m in messages:
        n = m["content"].count(placeholder)
        turn: dict[str, Any] = {"from": m["role"], "type": "text", "value": m["content"]}
        if n:
            turn["audio"] = [_audio_entry(a, out_dir) for a in audios[:n]]
            audios = audios[n:]
        turns.append(turn)
    rec = {k: v for k, v in (conv.record or {}).items() if k not in ("conversations", "messages", "sample_id")}
    rec.update(id=conv.sample_id, conversations=turns, regenerated_by=fingerprint)
    if truncated:
        rec["truncated"] = True
    return rec


def _audio_entry(ref: AudioRef, out_dir: Path) -> dict[str, Any]:
    if ref.path is None:  # bytes or an array: write it beside the output so the record can point at it
        import soundfile as sf

        d = out_dir / "audio"
        d.mkdir(parents=True, exist_ok=True)
        if ref.data is not None:
            name = hashlib.sha256(ref.data).hexdigest()[:20]
            ext = {b"RIFF": ".wav", b"fLaC": ".flac", b"OggS": ".ogg"}.get(ref.data[:4], ".audio")
            path = d / (name + ext)
            if not path.is_file():
                with staged(path) as tmp:
                    tmp.write_bytes(ref.data)
        else:
            import numpy as np

            arr = np.ascontiguousarray(ref.array, dtype=np.float32)
            path = d / (hashlib.sha256(arr.tobytes()).hexdigest()[:20] + ".wav")
            if not path.is_file():
                with staged(path) as tmp:
                    sf.write(str(tmp), arr, int(ref.sample_rate or 16000), subtype="FLOAT", format="WAV")
        rel = path.relative_to(out_dir).as_posix()
    else:
        rel = Path(ref.path).resolve().as_posix()
        try:
            rel = Path(rel).relative_to(out_dir.resolve()).as_posix()
        except ValueError:
            rel = os.path.relpath(rel, out_dir.resolve())
    e: dict[str, Any] = {"path": rel}
    if ref.offset:
        e["offset"] = ref.offset
    if ref.duration is not None:
        e["duration"] = ref.duration
    return e
