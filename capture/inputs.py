"""Capture inputs: conversation manifests (JSONL) and HF datasets with an Audio column.

JSONL conversation manifest, one conversation per line (NeMo's multimodal conversation style)::

    {"id": "utt-001",
     "conversations": [
        {"from": "User", "type": "text", "value": "what did i say ?"},
        {"from": "User", "type": "audio", "value": "audio/utt-001.wav", "offset": 0.0, "duration": 1.5},
        {"from": "Assistant", "type": "text", "value": "you said three one four ."}]}

- ``id`` (or ``sample_id``): the stable sample id, a non-empty string, unique within the split (a repeat
  is a bad input naming both lines: a dataset holds each sample once). Missing -> ``"<file stem>-<line
  number>"``, which is stable for an unchanged file. ``null`` or a number is refused, not stringified
  (two ``null`` ids would become the same ``"None"``).
- ``conversations`` (or ``messages``): turns with ``from``/``role`` (User|user|human, Assistant|
  assistant|gpt|model, System|system) and ``value``/``content``. ``type`` is ``text`` (default) or
  ``audio``; an audio turn's ``value`` (or ``audio``/``audio_filepath``) is a wav/flac path, relative
  paths resolve against the manifest's directory; ``offset`` and ``duration`` are seconds.
- Audio paths stay inside the manifest's directory (``..`` and absolute paths that leave it are bad
  inputs): a manifest someone shared cannot make a capture read, and store the states of, any file of
  this machine. ``allow_outside_paths`` (``--allow-outside-paths``) lifts that for a manifest you wrote.
  Links are the local user's own and are not resolved.
- An audio path must lead to a regular file: a FIFO, a device or a directory is a bad input that says what it is,
  refused before it is opened (``check_audio_path``; opening a FIFO waits for a writer, and a capture hung there).
  An audio turn becomes one ``<|audioplaceholder|>`` at its place in the text.
- Alternatively a text turn may contain placeholders itself and list its audios in ``audio``
  (a path, a dict ``{"path", "offset", "duration"}``, or a list of these), one per placeholder.
- Consecutive turns of the same role are joined with a space into one chat message.
- An assistant text turn may carry ``token_ids``, the ids the target generated for it (``tapdraft
  regenerate`` writes them, and ``"truncated": true`` when the reply hit the token limit): capture
  stores those ids instead of re-tokenizing the text (``capture.template``).
- In an HF dataset, an audio turn without a path (and a placeholder in a text turn that lists no
  audio) takes the next audio of the row's audio column, in order; in a JSONL manifest it is an error.
- ``offset`` must be >= 0 and ``offset + duration`` inside the file: audio is never cut silently, and
  a file that decodes shorter than its header declares (a truncated WAV) is a bad input.
- A line that is not valid UTF-8 is a bad input naming its file and line (skippable), not the end of
  the file.
- A conversation needs a user turn and an assistant turn; one without is a bad input.

Audio is decoded with soundfile (wav, flac, ogg...), mixed to mono and resampled to the encoder's
rate with a windowed-sinc resampler in torch (Hann window, 6 zero crossings, rolloff 0.99: the
kernel torchaudio uses by default), so no extra dependency is needed.

Every bad input is a :class:`BadInput` with the sample id, the line number and the reason; the
pipeline decides (``on_error``) whether it stops or skips.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from tapdraft.common.errors import InputError
from tapdraft.common.files import file_kind

DURATION_SLACK_S = 0.01
"""An audio span may end this far past the end of its file (manifests round durations); more is an error."""

ROLES = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant",
    "system": "system",
}


@dataclass
class AudioRef:
    """One audio: a file (path + optional offset/duration) or bytes or an array already decoded."""

    path: str | None = None
    offset: float = 0.0
    duration: float | None = None
    data: bytes | None = None
    array: np.ndarray | None = None
    sample_rate: int | None = None


@dataclass
class Conversation:
    """A parsed input: chat messages with one placeholder per audio, in order."""

    sample_id: str
    source: str
    messages: list[dict[str, Any]]
    audios: list[AudioRef] = field(default_factory=list)
    line: int | None = None
    generation_prompt: bool = False
    """Render with the chat template's generation prompt (the conversation ends before the reply to write)."""
    record: dict[str, Any] | None = None
    """The JSONL record it was parsed from (regeneration keeps its other fields)."""


@dataclass
class BadInput:
    """An input that could not be parsed; kept in the input order so indices stay stable."""

    sample_id: str
    source: str
    reason: str
    line: int | None = None

    def error(self) -> InputError:
        return InputError(self.reason, sample_id=self.sample_id, line=self.line, source=self.source)


# ------------------------------------------------------------------------------------------ parsing
def _inside(path: Path, base: Path, allow_outside: bool) -> Path:
    """``path`` resolved against ``base``; ValueError when it leaves ``base`` (lexically: links are not resolved)."""
    full = Path(os.path.normpath(os.path.join(os.path.abspath(base), path)))
    if not allow_outside and not full.is_relative_to(os.path.abspath(base)):
        raise ValueError(f"audio path {str(path)!r} leaves the manifest's directory {base}: refused, so that a "
                         "shared manifest cannot read other files of this machine; move the audio beside the "
                         "manifest, or pass --allow-outside-paths for a manifest you trust")
    return full if path.is_absolute() else base / path


def _audio_refs(spec: Any, base: Path, allow_outside: bool = False) -> list[AudioRef]:
    if spec is None:
        return []
    items = spec if isinstance(spec, list) else [spec]
    out = []
    for it in items:
        if isinstance(it, str):
            it = {"path": it}
        if not isinstance(it, dict) or not isinstance(it.get("path", it.get("audio_filepath")), str):
            raise ValueError(f"audio entry {it!r} must be a path or a dict with 'path'")
        p = _inside(Path(it.get("path", it.get("audio_filepath"))), base, allow_outside)
        dur = it.get("duration")
        out.append(AudioRef(path=str(p), offset=float(it.get("offset", 0.0) or 0.0),
                            duration=None if dur is None else float(dur)))
    return out


def record_id(rec: Any, default_id: str) -> str:
    """A record's sample id: its ``id`` (or ``sample_id``), a non-empty string; ``default_id`` when it has none.
    ValueError for any other value (``null``, a number): stringified, two of them could become one id."""
    if not isinstance(rec, dict) or ("id" not in rec and "sample_id" not in rec):
        return default_id
    sid = rec["id"] if "id" in rec else rec["sample_id"]
    if not isinstance(sid, str) or not sid:
        raise ValueError(f"id {json.dumps(sid)} is not a non-empty string; give every line a unique string id "
                         "(or none: the file's name and line number then serve)")
    return sid


def _carried_ids(turn: dict, j: int, role: str, kind: str) -> dict[str, Any]:
    """A reply's ``token_ids`` (the ids the target generated; ``truncated``: cut at the token limit), or {}."""
    ids = turn.get("token_ids")
    if ids is None:
        return {}
    if role != "assistant" or kind != "text":
        raise ValueError(f"turn {j} carries token_ids, which only an assistant text turn may")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                       for i in ids):
        raise ValueError(f"turn {j}: token_ids must be a non-empty list of token ids (integers >= 0)")
    truncated = turn.get("truncated", False)
    if not isinstance(truncated, bool):
        raise ValueError(f"turn {j}: truncated must be true or false, got {truncated!r}")
    return {"token_ids": ids, **({"truncated": True} if truncated else {})}


def parse_record(rec: Any, *, base: Path, placeholder: str, default_id: str,
                 column_audios: list[AudioRef] | None = None,
                 allow_outside: bool = False) -> tuple[str, list[dict], list[AudioRef]]:
    """One JSON record -> (sample id, messages, audios); ValueError says what is wrong.

    ``column_audios`` (an HF dataset row's audio column) fill, in order, the placeholders whose turn
    names no audio; without it every placeholder needs its own path. ``allow_outside``: audio paths may
    leave ``base``.
    """
    if not isinstance(rec, dict):
        raise ValueError(f"a manifest line must be a JSON object, got {type(rec).__name__}")
    sid = record_id(rec, default_id)
    turns = rec.get("conversations", rec.get("messages"))
    if not isinstance(turns, list) or not turns:
        raise ValueError("needs a non-empty 'conversations' (or 'messages') list of turns")
    messages: list[dict[str, str]] = []
    audios: list[AudioRef | None] = []  # None: taken from column_audios
    for j, t in enumerate(turns):
        if not isinstance(t, dict):
            raise ValueError(f"turn {j} must be an object, got {type(t).__name__}")
        role_raw = t.get("role", t.get("from"))
        role = ROLES.get(str(role_raw).lower()) if role_raw is not None else None
        if role is None:
            raise ValueError(f"turn {j} has unknown role {role_raw!r}; use one of {sorted(set(ROLES))}")
        kind = t.get("type", "text")
        if kind == "audio":
            path = t.get("value", t.get("audio", t.get("audio_filepath")))
            if path is None:
                audios.append(None)
            else:
                audios += _audio_refs({"path": path, "offset": t.get("offset", 0.0), "duration": t.get("duration")},
                                      base, allow_outside)
            text = placeholder
        elif kind == "text":
            text = t.get("value", t.get("content"))
            if not isinstance(text, str):
                raise ValueError(f"turn {j} ({role}) has no text 'value'/'content'")
            n_ph = text.count(placeholder)
            refs = _audio_refs(t.get("audio", t.get("audios")), base, allow_outside)
            if refs and len(refs) != n_ph:
                raise ValueError(
                    f"turn {j} has {n_ph} placeholder(s) {placeholder!r} but lists {len(refs)} audio(s)"
                )
            audios += refs if refs else [None] * n_ph
        else:
            raise ValueError(f"turn {j} has unknown type {kind!r}; use 'text' or 'audio'")
        if role == "assistant" and not text.strip():
            raise ValueError(f"turn {j} is an empty assistant turn; drop the conversation or fill the turn")
        carried = _carried_ids(t, j, role, kind)
        if messages and messages[-1]["role"] == role:
            if carried or "token_ids" in messages[-1]:
                raise ValueError(f"turn {j} would be joined with the turn before it (same role), but one of them "
                                 "carries token_ids; give the reply as one turn")
            messages[-1]["content"] += " " + text
        else:
            messages.append({"role": role, "content": text, **carried})
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("has no assistant turn: nothing would be supervised")
    if not any(m["role"] == "user" for m in messages):
        raise ValueError("has no user turn: the assistant would answer nothing (a drafter learns prompt -> reply)")
    n_ph = sum(m["content"].count(placeholder) for m in messages)
    if n_ph != len(audios):
        raise ValueError(f"has {n_ph} audio placeholder(s) but {len(audios)} audio(s); one placeholder per audio")
    n_open = sum(a is None for a in audios)
    column = list(column_audios or [])
    if column_audios is None and n_open:
        raise ValueError(f"has {n_open} audio placeholder(s) or audio turn(s) without a path; give each audio turn "
                         "a 'value' path, or list a text turn's audios in 'audio'")
    if column_audios is not None and n_open != len(column):
        raise ValueError(f"has {n_open} audio placeholder(s) without a path but {len(column)} audio(s) in the "
                         "audio column; one column audio per audio turn that names no file")
    it = iter(column)
    return sid, messages, [a if a is not None else next(it) for a in audios]


def read_jsonl(path: str | Path, *, placeholder: str, allow_outside_paths: bool = False
               ) -> Iterator[Conversation | BadInput]:
    """Every line of a JSONL manifest in file order (blank lines are skipped but keep numbering); a line that is not
    valid UTF-8 or JSON is that line's BadInput. ``allow_outside_paths``: audio may lie outside the file's directory."""
    path = Path(path)
    if not path.is_file():
        if path.exists():
            raise ValueError(f"manifest {path} is {file_kind(path.stat().st_mode)}: give a JSONL file (write a stream "
                             "to a file first)")
        raise FileNotFoundError(f"manifest {path} does not exist")
    base = path.parent
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            default_id = f"{path.stem}-{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield BadInput(default_id, str(path), f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column "
                               f"{e.start + 1}); re-encode the file as UTF-8, or skip the line with --on-error skip",
                               lineno)
                continue
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                yield BadInput(default_id, str(path), f"malformed JSON: {e.msg} at column {e.colno}", lineno)
                continue
            try:
                sid = record_id(rec, default_id)
            except ValueError as e:
                yield BadInput(default_id, str(path), str(e), lineno)
                continue
            try:
                sid, messages, audios = parse_record(rec, base=base, placeholder=placeholder, default_id=default_id,
                                                     allow_outside=allow_outside_paths)
            except ValueError as e:
                yield BadInput(sid, str(path), str(e), lineno)
                continue
            yield Conversation(sid, str(path), messages, audios, lineno, record=rec)


def unique_ids(items: Iterable[Conversation | BadInput]) -> Iterator[Conversation | BadInput]:
    """The items with every repeat of an earlier id turned into a BadInput naming both lines (a split holds each
    sample once: a repeat would be captured twice, trained on twice, and refused by ``tapdraft verify``)."""
    first: dict[str, str] = {}
    for item in items:
        where = item.source if item.line is None else f"{item.source}:{item.line}"
        sid = item.sample_id
        if isinstance(item, Conversation) and sid in first:
            yield BadInput(sid, item.source, f"id {sid!r} repeats the id of {first[sid]}; ids must be unique within a "
                           "split: rename or drop one of the two", item.line)
            continue
        if isinstance(item, Conversation):
            first[sid] = where
        yield item


def read_hf_dataset(
    name_or_path: str,
    *,
    split: str = "train",
    placeholder: str,
    audio_column: str = "audio",
    text_column: str = "text",
    id_column: str | None = "id",
    prompt: str = "Transcribe the audio.",
) -> Iterator[Conversation | BadInput]:
    """Rows of an HF dataset (a saved dataset directory or a local loading script/data dir).

    A row with a ``conversations``/``messages`` column is parsed like a JSONL record, its audio
    column filling the placeholders in order; otherwise (ASR style) it becomes
    ``user: prompt + placeholder`` / ``assistant: row[text_column]``. Audio is read undecoded
    (``Audio(decode=False)``: bytes or path) and decoded here with soundfile.
    """
    import datasets

    p = Path(name_or_path)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # the capture shows its own progress
    try:
        if p.is_dir() and any((p / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split]
        else:
            ds = datasets.load_dataset(name_or_path, split=split)
    finally:
        if bars:
            datasets.enable_progress_bars()
    if audio_column in ds.column_names:
        ds = ds.cast_column(audio_column, datasets.Audio(decode=False))
    for i, row in enumerate(ds):
        sid = str(row[id_column]) if id_column and id_column in row else f"{p.name or name_or_path}-{i}"
        try:
            auds = row.get(audio_column)
            auds = auds if isinstance(auds, list) else ([auds] if auds is not None else [])
            refs = [AudioRef(path=a.get("path") if not a.get("bytes") else None, data=a.get("bytes")) for a in auds]
            if "conversations" in row or "messages" in row:
                rec = {"id": sid, "conversations": row.get("conversations", row.get("messages"))}
                sid, messages, refs = parse_record(rec, base=Path("."), placeholder=placeholder, default_id=sid,
                                                   column_audios=refs)
            else:
                text = row.get(text_column)
                if not isinstance(text, str) or not text.strip():
                    raise ValueError(f"empty assistant turn (column {text_column!r})")
                if len(refs) != 1:
                    raise ValueError(f"ASR-style rows need exactly one audio in {audio_column!r}, got {len(refs)}")
                messages = [{"role": "user", "content": f"{prompt} {placeholder}"},
                            {"role": "assistant", "content": text}]
        except ValueError as e:
            yield BadInput(sid, name_or_path, str(e), i)
            continue
        yield Conversation(sid, name_or_path, messages, refs, i)


def input_digest(spec: str) -> str | None:
    """sha256 of an input's content: a JSONL file's bytes, or every file of a local dataset directory
    (relative names and bytes, in sorted order); None for a hub dataset (``hf:NAME`` not on disk),
    whose content ``datasets`` resolves. Audio files a manifest points to are not included."""
    name = spec[3:].partition(":")[0] if spec.startswith("hf:") else spec
    p = Path(name)
    if p.is_file():
        files, root = [p], p.parent
    elif p.is_dir():
        files, root = sorted(f for f in p.rglob("*") if f.is_file()), p
    else:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0")
        with f.open("rb") as fh:
            h.update(hashlib.file_digest(fh, "sha256").digest())
    return h.hexdigest()


def check_input(spec: str) -> str | None:
    """Refuse an input that cannot hold a conversation, before a command creates anything: a local path
    that does not exist (FileNotFoundError with its full path). Returns ``"empty"`` for a JSONL file
    (or a directory of them) with no non-blank line, else None; hub datasets are not looked up here."""
    name = spec[3:].partition(":")[0] if spec.startswith("hf:") else spec
    p = Path(name)
    if spec.startswith("hf:") and not p.exists():
        return None  # a hub name: ``datasets`` resolves it
    if not p.exists():
        raise FileNotFoundError(f"input {p.absolute()} does not exist; check the --data path")
    files = [p] if p.is_file() else sorted(p.glob("*.jsonl")) if p.is_dir() else []
    if p.is_dir() and any((p / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
        return None
    for f in files:
        with f.open("rb") as fh:
            if any(line.strip() for line in fh):
                return None
    return "empty" if files else None


def read_inputs(spec: str, *, placeholder: str, allow_outside_paths: bool = False, **hf_kwargs: Any
                ) -> Iterator[Conversation | BadInput]:
    """``*.jsonl`` -> :func:`read_jsonl`; a directory of ``*.jsonl`` shards -> each in name order;
    ``hf:NAME_OR_DIR[:split]`` or an HF dataset dir -> :func:`read_hf_dataset`. One split's inputs: a repeated id
    is a BadInput (:func:`unique_ids`)."""
    if spec.startswith("hf:"):
        name, _, split = spec[3:].partition(":")
        return unique_ids(read_hf_dataset(name, split=split or "train", placeholder=placeholder, **hf_kwargs))
    p = Path(spec)
    if p.is_dir():
        shards = sorted(p.glob("*.jsonl"))
        if shards and not any((p / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
            return unique_ids(c for s in shards
                              for c in read_jsonl(s, placeholder=placeholder, allow_outside_paths=allow_outside_paths))
        return unique_ids(read_hf_dataset(spec, placeholder=placeholder, **hf_kwargs))
    return unique_ids(read_jsonl(p, placeholder=placeholder, allow_outside_paths=allow_outside_paths))


def stored_source(source: str, line: int | None) -> str:
    """A sample's ``source`` as datasets store it: the input's name relative to its root (the directory
    of a JSONL manifest or the HF dataset directory) plus the line or row, e.g. ``train.jsonl:12``.
    A hub name (``org/name``) is kept whole. Absolute paths would leak one machine's layout into a
    shared dataset."""
    p = Path(source)
    name = p.name if p.is_absolute() or p.exists() else source
    return name if line is None else f"{name}:{line}"


# ------------------------------------------------------------------------------------------ audio
def resample(wave: np.ndarray, orig_sr: int, new_sr: int, *, zero_crossings: int = 6,
             rolloff: float = 0.99) -> np.ndarray:
    """Band-limited resampling of a mono float waveform (windowed sinc, polyphase by conv1d)."""
    if orig_sr == new_sr:
        return wave.astype(np.float32, copy=False)
    g = math.gcd(int(orig_sr), int(new_sr))
    orig, new = int(orig_sr) // g, int(new_sr) // g
    base = min(orig, new) * rolloff
    width = math.ceil(zero_crossings * orig / base)
    idx = torch.arange(-width, width + orig, dtype=torch.float64) / orig  # [K]
    t = (torch.arange(0, -new, -1, dtype=torch.float64)[:, None] / new + idx[None, :]) * base  # [new, K]
    t = t.clamp(-zero_crossings, zero_crossings)
    window = torch.cos(t * math.pi / zero_crossings / 2) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t) * window * (base / orig)
    x = torch.from_numpy(np.ascontiguousarray(wave, dtype=np.float32)).to(torch.float64)
    n = x.shape[0]
    x = torch.nn.functional.pad(x[None, None], (width, width + orig))
    y = torch.nn.functional.conv1d(x, kernel[:, None, :], stride=orig)  # [1, new, frames]
    y = y[0].t().reshape(-1)
    target = math.ceil(new * n / orig)
    return y[:target].to(torch.float32).numpy()


def _span(ref: AudioRef, sr: int, total: int) -> tuple[int, int]:
    """(first frame, frame count or -1 for the rest) of ``[offset, offset + duration)`` inside the file."""
    name = ref.path or "<bytes>"
    if ref.offset < 0 or (ref.duration is not None and ref.duration <= 0):
        raise ValueError(f"audio {name}: offset must be >= 0 and duration > 0, got offset {ref.offset}s, "
                         f"duration {ref.duration}s")
    start = int(round(ref.offset * sr))
    if start >= total:
        raise ValueError(f"offset {ref.offset}s is past the end of {name} ({total / sr:.2f}s)")
    if ref.duration is None:
        return start, -1
    count = int(round(ref.duration * sr))
    if start + count > total + int(round(DURATION_SLACK_S * sr)):
        raise ValueError(f"offset {ref.offset}s + duration {ref.duration}s runs past the end of {name} "
                         f"({total / sr:.2f}s); fix the manifest's offset/duration")
    return start, min(count, total - start)


_DATA_CHUNK = re.compile(r"^data\s*:\s*(\d+)\s*\(should be (\d+)\)", re.M)
_UNKNOWN_SIZES = (0, 0xFFFFFFFF)  # a WAV written while streaming: the size was never filled in


def _sample_bytes(subtype: str) -> int:
    m = re.search(r"(\d+)$", subtype)
    return max(1, int(m.group(1)) // 8) if m else 2


def _check_header(info: str, name: str, sr: int, frame_bytes: int) -> None:
    """A WAV whose data chunk declares more bytes than the file holds was cut short: libsndfile reads what is there
    and reports that shorter length as the file's, so the loss shows only in its header report."""
    m = _DATA_CHUNK.search(info)
    if m and int(m.group(1)) not in _UNKNOWN_SIZES and int(m.group(2)) < int(m.group(1)):
        declared, held = int(m.group(1)) / frame_bytes / sr, int(m.group(2)) / frame_bytes / sr
        raise ValueError(f"audio {name} holds {held:.2f}s, its header declares {declared:.2f}s: the file is "
                         "truncated; re-copy it")


def check_audio_path(path: str | None) -> None:
    """Refuse an audio path that is not a regular file before anything opens it: ValueError naming the path, what it
    is, and what to give instead. Opening a FIFO waits for a writer (a capture hung there for minutes, past Ctrl-C), a
    device is read without end, a directory holds no audio. A link is followed: it is the user's own. Every audio
    file is opened through this check (``header_seconds``, ``load_audio``), so capture and regenerate refuse alike."""
    if path is None:
        raise ValueError("an audio has neither a path nor bytes; give each audio turn a file path")
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise ValueError(f"audio file {path} does not exist; check the path in the manifest") from None
    except OSError as e:
        raise ValueError(f"audio file {path} cannot be looked at ({e.strerror}); check its path and permissions") \
            from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"audio path {path} is {file_kind(mode)}: give the path of an audio file (wav, flac, ...); "
                         "write a stream or a device's audio to a file first")


def header_seconds(ref: AudioRef) -> float | None:
    """Seconds ``ref`` will decode to, read from the file's header alone (no sample decoded: a 1-hour WAV is 3.4 GB
    once decoded); None when the header cannot tell (``load_audio`` then decodes and names the problem), a path that
    is not a regular file included (never opened: see ``check_audio_path``)."""
    import soundfile as sf

    if ref.array is not None:
        return len(ref.array) / ref.sample_rate if ref.sample_rate else None
    try:
        if ref.data is None:
            check_audio_path(ref.path)
        with sf.SoundFile(io.BytesIO(ref.data) if ref.data is not None else ref.path) as f:
            sr, total = int(f.samplerate), f.frames
        start, count = _span(ref, sr, total)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError, OSError):
        return None
    return ((total - start) if count < 0 else count) / sr


def load_audio(ref: AudioRef, *, target_sr: int, min_sr: int) -> tuple[np.ndarray, float]:
    """Decode, mix to mono, cut [offset, offset + duration), resample -> (float32 waveform, seconds)."""
    import soundfile as sf

    if ref.array is not None:
        wave, sr = np.asarray(ref.array, dtype=np.float32), int(ref.sample_rate or 0)
    else:
        src: Any = io.BytesIO(ref.data) if ref.data is not None else ref.path
        if ref.data is None:
            check_audio_path(ref.path)
        try:
            with sf.SoundFile(src) as f:
                sr, total = int(f.samplerate), f.frames
                _check_header(f.extra_info, ref.path or "<bytes>", sr, f.channels * _sample_bytes(f.subtype))
                start, count = _span(ref, sr, total)
                f.seek(start)
                wave = f.read(frames=count, dtype="float32", always_2d=True).mean(axis=1)
        except (sf.LibsndfileError, RuntimeError, TypeError) as e:
            raise ValueError(f"cannot decode audio {ref.path or '<bytes>'}: {e}") from e
        want = (total - start) if count < 0 else count
        if wave.shape[0] < want:
            raise ValueError(f"audio {ref.path or '<bytes>'} decodes to {wave.shape[0] / sr:.2f}s, its header "
                             f"declares {want / sr:.2f}s from offset {ref.offset}s: the file is truncated; re-copy it")
    if sr < min_sr:
        raise ValueError(
            f"audio {ref.path or '<array>'} is sampled at {sr} Hz; the encoder needs {target_sr} Hz and inputs "
            f"below {min_sr} Hz cannot be upsampled faithfully"
        )
    if wave.ndim != 1 or wave.size == 0:
        raise ValueError(f"audio {ref.path or '<array>'} is empty")
    if not np.isfinite(wave).all():
        raise ValueError(f"audio {ref.path or '<array>'} contains NaN or Inf samples")
    seconds = wave.shape[0] / sr
    return resample(wave, sr, target_sr), seconds
