"""SALM: placeholder expansion, audio framing, directory round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tapdraft.capture.targets.base import expand_placeholders
from tapdraft.capture.targets.salm.model import SALM

A = 99  # placeholder id in the hand-made fixture
SENT = 98  # sentinel id audio rows carry


def test_expansion_nemo_fixture_positions():
    """ids [7, A, 1, 2, A, 1] with 4 and 3 frames -> 11 positions, frames in place, never supervised."""
    emb = nn.Embedding(100, 5)
    ids = torch.tensor([7, A, 1, 2, A, 1])
    amask = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.bool)  # pretend the tail is an assistant turn
    a1, a2 = torch.randn(4, 5), torch.randn(3, 5)
    ex = expand_placeholders(ids, amask, [a1, a2], placeholder_id=A, audio_token_id=SENT, embed=emb)
    assert ex.input_ids.tolist() == [7, SENT, SENT, SENT, SENT, 1, 2, SENT, SENT, SENT, 1]
    assert ex.is_audio.tolist() == [0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0]
    assert ex.loss_mask.tolist() == [0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1]
    assert ex.inputs_embeds.shape == (11, 5)
    torch.testing.assert_close(ex.inputs_embeds[1:5], a1, rtol=0, atol=0)
    torch.testing.assert_close(ex.inputs_embeds[7:10], a2, rtol=0, atol=0)
    torch.testing.assert_close(ex.inputs_embeds[[0, 5, 6, 10]], emb(torch.tensor([7, 1, 2, 1])), rtol=0, atol=0)


def test_expansion_count_mismatch():
    emb = nn.Embedding(100, 5)
    with pytest.raises(ValueError, match="2 audio placeholder.*1 audio"):
        expand_placeholders(torch.tensor([7, A, 1, A]), torch.zeros(4, dtype=torch.bool), [torch.randn(2, 5)],
                            placeholder_id=A, audio_token_id=SENT, embed=emb)


def test_frames_are_80ms_and_batch_independent(salm):
    assert salm.config.audio.frame_seconds == pytest.approx(0.08)
    rng = np.random.default_rng(0)
    waves = [rng.normal(0, 0.1, n).astype(np.float32) for n in (16000, 9000, 4000)]
    with torch.no_grad():
        batched = salm.encode_audio(waves)
        single = [salm.encode_audio([w])[0] for w in waves]
    for w, b, s in zip(waves, batched, single):
        assert b.shape[0] == salm.num_frames(len(w))
        torch.testing.assert_close(b, s, rtol=1e-4, atol=1e-5)
    assert [b.shape[0] for b in batched] == [13, 7, 4]  # ~ seconds / 0.08


def test_assistant_mask_from_chat_template(salm):
    ids, mask = salm.tokenize([{"role": "user", "content": "<|audioplaceholder|> what did i say ?"},
                               {"role": "assistant", "content": "you said one ."}])
    toks = salm.tokenizer.convert_ids_to_tokens(ids.tolist())
    assert [t for t, m in zip(toks, mask.tolist()) if m] == ["you", "said", "one", ".", "<|im_end|>"]


def test_from_pretrained_roundtrip(salm_dir, tmp_path):
    m = SALM.from_pretrained(salm_dir)
    m.save_pretrained(tmp_path / "copy")
    m2 = SALM.from_pretrained(tmp_path / "copy")
    wave = [np.random.default_rng(2).normal(0, 0.1, 12000).astype(np.float32)]
    ids, mask = m.tokenize([{"role": "user", "content": "<|audioplaceholder|> what did i say ?"},
                            {"role": "assistant", "content": "you said one ."}])
    with torch.no_grad():
        outs = []
        for model in (m, m2):
            ex = model.expand(ids, mask, model.encode_audio(wave))
            outs.append(model(inputs_embeds=ex.inputs_embeds[None]).logits)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert m2.tokenizer.chat_template == m.tokenizer.chat_template
    assert m2.placeholder_id == m.placeholder_id and m2.audio_token_id == m.audio_token_id


def test_from_pretrained_errors(tmp_path, salm_dir):
    with pytest.raises(FileNotFoundError, match="not a SALM directory"):
        SALM.from_pretrained(tmp_path)
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(salm_dir, broken)
    shutil.rmtree(broken / "encoder")
    with pytest.raises(FileNotFoundError, match="encoder is missing"):
        SALM.from_pretrained(broken)


def test_an_lm_narrower_than_the_adapter_is_refused_at_load(tmp_path, salm_dir):
    import json
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    broken = tmp_path / "wide"
    shutil.copytree(salm_dir, broken)
    cfg = AutoConfig.from_pretrained(broken / "lm")
    lm_hidden = json.loads((broken / "salm_config.json").read_text())["adapter"]["lm_hidden"]
    cfg.hidden_size, cfg.head_dim = lm_hidden + 16, (lm_hidden + 16) // cfg.num_attention_heads
    shutil.rmtree(broken / "lm")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(broken / "lm")
    with pytest.raises(ValueError, match=f"adapter outputs {lm_hidden}-wide frames but its LM's hidden size is "
                                         f"{lm_hidden + 16}") as e:
        SALM.from_pretrained(broken)
    assert "\n" not in str(e.value)
