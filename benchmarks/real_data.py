"""Conversations for the real targets, so the storage and capture benchmarks run on real activations.

    smollm2   SmolLM2-135M-Instruct (``demo.real.build``): the user asks to continue a passage of the project's
              own docs (80-160 words), the reply is the passage that follows (80-160 words); ~330 tokens each
              with SmolLM2's chat template and default system prompt. The replies are the docs' text, not the
              target's own: the activations over them are the model's all the same.
    speech    the listening speech LLM (``demo.real.listen``, projector trained 300 steps: WER 0.13 held out):
              espeak-ng speaks listen's held-out sentences, the user asks for a transcript, the reply is the
              sentence; ~2-3 s of audio, ~100 tokens each with the audio's.

Both targets are built or reused from ~/.cache/tapdraft/models. Writes ``OUT/smollm2.jsonl``,
``OUT/speech.jsonl`` (+ ``OUT/audio/``) and prints a JSON object with the target directories and files.

    python -m benchmarks.real_data --out DIR [--text 48] [--speech 48]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def passages(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (passage, the passage that follows) pairs of 80-160 words from docs/*.md (LOG.md left out: its
    numbers dominate), at seeded offsets."""
    words = " ".join(p.read_text() for p in sorted(DOCS.glob("*.md")) if p.name != "LOG.md").split()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(80, 160), rng.randint(80, 160)
        s = rng.randint(0, len(words) - a - b)
        out.append((" ".join(words[s:s + a]), " ".join(words[s + a:s + a + b])))
    return out


def text_records(n: int) -> list[dict]:
    return [{"id": f"text-{i:04d}", "conversations": [
        {"from": "User", "type": "text", "value": "Continue this text:\n\n" + p},
        {"from": "Assistant", "type": "text", "value": c}]} for i, (p, c) in enumerate(passages(n))]


def speech_records(n: int, audio: Path) -> list[dict]:
    import soundfile as sf

    from tapdraft.demo.real.listen import PROMPT, VOICES, sentences, speak

    texts = sentences(1, n, 1, seed=1)["test"]
    audio.mkdir(parents=True, exist_ok=True)
    out = []
    for i, (text, voice) in enumerate(zip(texts, itertools.cycle(VOICES))):
        wav = audio / f"{i:04d}.wav"
        if not wav.is_file():
            sf.write(wav, speak(text, *voice), 16000, subtype="PCM_16")
        out.append({"id": f"speech-{i:04d}", "conversations": [
            {"from": "User", "type": "audio", "value": str(wav.resolve())},
            {"from": "User", "type": "text", "value": PROMPT},
            {"from": "Assistant", "type": "text", "value": text}]})
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where the conversations (and audio) are written")
    ap.add_argument("--text", type=int, default=48, help="SmolLM2 text conversations")
    ap.add_argument("--speech", type=int, default=48, help="speech conversations")
    args = ap.parse_args(argv)
    from tapdraft.demo.real.build import build_real_targets
    from tapdraft.demo.real.listen import ListenConfig, build_listener

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    smollm2 = build_real_targets().smollm2
    speech, _ = build_listener(cfg=ListenConfig(steps=300))
    files = {"smollm2.jsonl": text_records(args.text), "speech.jsonl": speech_records(args.speech, out / "audio")}
    for name, recs in files.items():
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    doc = {"smollm2": {"target": str(smollm2), "data": str(out / "smollm2.jsonl")},
           "speech": {"target": str(speech), "data": str(out / "speech.jsonl")}}
    print(json.dumps(doc, indent=2))
    return doc


if __name__ == "__main__":
    main()
