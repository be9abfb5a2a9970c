"""The adapter for tapdraft's own SALM directories (capture.targets.salm.model): audio -> log-mel on the
prefetch thread, one encoder run per batch, placeholders expanded to the audio's frames."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from tapdraft.capture.inputs import Conversation, load_audio
from tapdraft.capture.targets.base import Expanded, Prepared, Target
from tapdraft.capture.targets.salm.model import SALM


class SALMTarget(Target):
    """A :class:`capture.targets.salm.model.SALM` directory."""

    kind = "salm"
    vllm_refused = "vLLM does not load SALM directories (their encoder and projector are tapdraft's own modules)"

    def __init__(self, salm: SALM, path: str | Path | None = None):
        self.salm = salm.eval()
        self.lm = salm.lm
        self.tokenizer = salm.tokenizer
        self.placeholder = salm.config.audio.placeholder
        self.audio_token_id = salm.audio_token_id
        self.sample_rate = salm.config.audio.sample_rate
        self._path = None if path is None else Path(path)

    def prepare(self, conv: Conversation, index: int) -> Prepared:
        tok = self._tokenize(conv)
        ids, mask = tok.ids, tok.mask
        n_ph = int((ids == self.salm.placeholder_id).sum())
        if n_ph != len(conv.audios):
            raise ValueError(f"has {n_ph} audio placeholder(s) after tokenization but {len(conv.audios)} audio(s)")
        waves, feats, seconds, frames = [], [], 0.0, 0
        acfg = self.salm.config.audio
        for ref in conv.audios:
            w, s = load_audio(ref, target_sr=acfg.sample_rate, min_sr=acfg.min_sample_rate)
            n = self.salm.num_frames(w.shape[0])
            if n < 1:
                raise ValueError(f"audio {ref.path or '<array>'} is {s:.3f}s: too short for one encoder frame")
            # log-mel here, on the prefetch thread (normalisation is per utterance, so this equals batched)
            f, fm = self.salm.featurize([w])
            waves.append(w)
            feats.append(f[0, : int(fm[0].sum())])
            seconds += s
            frames += n
        return Prepared(index, conv.sample_id, conv.source, ids, mask, waves, feats, seconds,
                        int(ids.shape[0]) - n_ph + frames, conv.line, len(tok.unsupervised))

    def embed(self, batch: Sequence[Prepared]) -> list[Expanded]:
        feats = [f for p in batch for f in p.features]
        if len(feats) != sum(len(p.waveforms) for p in batch):  # built without prepare(): featurize now
            audio = self.salm.encode_audio([w for p in batch for w in p.waveforms])
        elif feats:
            F = max(f.shape[0] for f in feats)
            padded = torch.stack([torch.nn.functional.pad(f, (0, 0, 0, F - f.shape[0])) for f in feats])
            fmask = torch.arange(F)[None, :] < torch.tensor([f.shape[0] for f in feats])[:, None]
            audio = self.salm.encode_features(padded, fmask)
        else:
            audio = []
        out, k = [], 0
        for p in batch:
            n = len(p.waveforms)
            out.append(self.salm.expand(p.token_ids, p.assistant_mask, audio[k : k + n]))
            k += n
        return out

    def audio_bundle(self) -> dict[str, Any]:
        a = self.salm.config.audio
        return {
            "sample_rate": a.sample_rate,
            "frame_seconds": a.frame_seconds,
            "placeholder": a.placeholder,
            "placeholder_token_id": self.salm.placeholder_id,
            "audio_token_id": self.audio_token_id,
            "encoder": "ParakeetEncoder",
        }
