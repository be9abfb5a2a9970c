"""demo.real.answer's parts on a tiny Qwen2-Audio in its real layout: the requests, the written replies, the scores,
and ``listen.fit`` (what trains and what stays frozen; the encoder's two audio forms agree)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tapdraft.demo.real.answer import (AnswerConfig, answer_examples, common_prefix, reply, requests, score_replies,
                              written_replies)
from tapdraft.demo.real.listen import VOCAB_OOV, audio_inputs, encode_audio, encode_audio_full, fit, tower_frames
from tests.demo.tones import waves


def test_requests_are_disjoint_and_hold_out_words():
    r = requests(AnswerConfig())
    assert [len(r[k]) for k in ("train", "test", "oov")] == [400, 40, 20]
    assert not set(r["train"]) & set(r["test"]) and not set(r["train"]) & set(r["oov"])
    seen = {w for s in r["train"] for w in s.split()}
    assert all(VOCAB_OOV & set(s.split()) for s in r["oov"]) and not VOCAB_OOV & seen
    assert requests(AnswerConfig()) == r
    with pytest.raises(ValueError, match="transcribe_share"):
        AnswerConfig(transcribe_share=1.0)
    assert AnswerConfig().n_transcribe == 400 and AnswerConfig(transcribe_share=0.25).n_transcribe == 133
    with pytest.raises(ValueError, match="the listener has 490"):  # more than the listener's sentences
        AnswerConfig(transcribe_share=0.6)


def test_scores_count_prefixes_and_whether_a_reply_follows_its_audio():
    written = [[1, 2, 3, 4], [5, 6, 7], [1, 2, 9, 9]]
    spoken = [[1, 2, 3, 4], [5, 6, 0], [1, 2, 3, 4]]  # the third follows the first's audio, not its own
    s = score_replies(written, spoken, first=2)
    assert s["first_2"] == 1.0 and s["whole"] == pytest.approx(1 / 3)
    assert s["mean_prefix_tokens"] == pytest.approx((4 + 2 + 2) / 3)
    assert s["follows_audio"] == "2/2"  # the 3rd is not judged: its written reply and the 1st's agree over 2
    assert score_replies(written, spoken, first=3)["follows_audio"] == "2/3"  # 3rd: 2 against the 1st's 4
    assert common_prefix([1, 2], [1, 2, 3]) == 2 and common_prefix([], [1]) == 0


def test_written_replies_batched_equal_one_at_a_time(tiny):
    model, proc = tiny
    asked = ["what did you say", "say one two three four", "you said five"]
    side = proc.tokenizer.padding_side
    batched = written_replies(model, proc.tokenizer, asked, max_new_tokens=6, batch=2)
    assert batched == [reply(model, proc, t, None, 6) for t in asked]
    assert all(1 <= len(r) <= 6 for r in batched) and proc.tokenizer.padding_side == side
    spoken = reply(model, proc, None, waves(1)[0], 5)
    assert 1 <= len(spoken) <= 5


def test_the_fast_encoder_pass_equals_the_models_masked_one(tiny):
    model, proc = tiny
    for a, b in zip(encode_audio(model, waves(2), proc.feature_extractor),
                    encode_audio_full(model, waves(2), proc.feature_extractor)):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=0)


def test_fit_trains_what_it_is_given_and_nothing_else(tiny):
    base, proc = tiny
    tok = proc.tokenizer
    replies = [tok("one two three", add_special_tokens=False)["input_ids"],
               tok("four five", add_special_tokens=False)["input_ids"]]
    examples = answer_examples(tok, replies, 0, reply_tokens=2)
    assert [e.reply.tolist() for e in examples] == [r[:2] for r in replies]
    w = waves(2)

    def run(train_tower: bool, frames: bool):
        model = copy.deepcopy(base)
        tower = model.model.audio_tower
        fe = proc.feature_extractor
        audio = encode_audio(model, w, fe) if frames else audio_inputs(tower, w, fe)
        params = list(model.model.multi_modal_projector.parameters())
        params += list(tower.parameters()) if train_tower else []
        losses = fit(model, examples, audio, params, steps=4, batch=2, lr=1e-2, seed=0, log=lambda *_: None)
        return model, losses

    before = base.state_dict()
    model, losses = run(train_tower=True, frames=False)
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any(k.startswith("model.multi_modal_projector.") for k in changed)
    assert any(k.startswith("model.audio_tower.layers.") for k in changed)
    assert not [k for k in changed if k.startswith(("model.language_model.", "lm_head."))]
    assert losses[-1] < losses[0]
    frozen_a, la = run(train_tower=False, frames=False)
    frozen_b, lb = run(train_tower=False, frames=True)  # the encoder run once, its frames cached: the same steps
    assert la == lb
    assert torch.equal(frozen_a.model.audio_tower.layers[0].fc1.weight, base.model.audio_tower.layers[0].fc1.weight)
    model = copy.deepcopy(base)  # parameter groups: the encoder's own rate (0 here) holds it still
    groups = [{"params": list(model.model.multi_modal_projector.parameters())},
              {"params": list(model.model.audio_tower.parameters()), "lr": 0.0}]
    fit(model, examples, audio_inputs(model.model.audio_tower, w, proc.feature_extractor), groups, steps=2, batch=2,
        lr=1e-2, seed=0, log=lambda *_: None)
    assert torch.equal(model.model.audio_tower.layers[0].fc1.weight, base.model.audio_tower.layers[0].fc1.weight)
    proj, base_proj = model.model.multi_modal_projector, base.model.multi_modal_projector
    assert not torch.equal(proj.linear.weight, base_proj.linear.weight)
    with torch.no_grad():
        x = audio_inputs(base.model.audio_tower, w[:1], proc.feature_extractor)[0]
        one = encode_audio(base, w[:1], proc.feature_extractor)[0]
        assert torch.equal(tower_frames(base.model.audio_tower, x), one)


def test_fit_resumed_after_a_kill_takes_the_uninterrupted_runs_steps(tiny, tmp_path):
    base, proc = tiny
    tok = proc.tokenizer
    replies = [tok(t, add_special_tokens=False)["input_ids"] for t in ("one two three", "four five", "six")]
    examples = answer_examples(tok, replies, 0, reply_tokens=3)
    frames = [f.half() for f in encode_audio(base, waves(3), proc.feature_extractor)]  # a half-precision cache

    def run(resume=None, die_at=None):
        model = copy.deepcopy(base)
        params = list(model.model.multi_modal_projector.parameters())
        if die_at is not None:
            step = torch.optim.AdamW.step
            calls = []

            def dying(self, *a, **k):
                calls.append(1)
                if len(calls) == die_at:
                    raise KeyboardInterrupt
                return step(self, *a, **k)

            torch.optim.AdamW.step = dying
        try:
            losses = fit(model, examples, frames, params, steps=6, batch=2, lr=1e-2, seed=0, log=lambda *_: None,
                         resume=resume, every=2)
        finally:
            if die_at is not None:
                torch.optim.AdamW.step = step
        return model, losses

    whole, losses = run()
    ckpt = tmp_path / "fit.pt"
    with pytest.raises(KeyboardInterrupt):
        run(ckpt, die_at=4)  # killed in step 4: steps 1-2 saved, step 3's work lost
    assert torch.load(ckpt, weights_only=False)["step"] == 2
    resumed, resumed_losses = run(ckpt)
    assert resumed_losses == losses
    assert torch.equal(resumed.model.multi_modal_projector.linear.weight, whole.model.multi_modal_projector.linear.weight)
    with pytest.raises(ValueError, match="remove it to start again"):
        fit(copy.deepcopy(base), examples, frames, list(base.model.multi_modal_projector.parameters()), steps=9,
            batch=2, lr=1e-2, seed=0, log=lambda *_: None, resume=ckpt)


def test_spoken_requests_hold_out_what_the_answerer_and_the_drafter_heard(tmp_path, fake_speech):
    from tapdraft.capture.inputs import BadInput, read_inputs
    from tapdraft.demo.real.answer import every_request, spoken_requests
    from tapdraft.demo.real.listen import VOICES

    assert len(every_request()) == len(set(every_request())) == 516
    convs = spoken_requests(tmp_path, 600, 20, 30)
    text = {s: [c["request"] for c in v] for s, v in convs.items()}
    assert [len(text[s]) for s in ("train", "validation", "held_out")] == [600, 20, 30]
    answerer = requests(AnswerConfig())
    held = set(text["held_out"])
    assert not held & (set(answerer["train"]) | set(answerer["test"]) | set(text["train"]) | set(text["validation"]))
    assert len(fake_speech) == len(set(fake_speech)) == 650  # a repeated request is another voice's utterance
    assert len(set(text["train"])) < 600 and {(v, r) for t, v, r in fake_speech} >= set(VOICES[:2])
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs["train"]))
    first = next(iter(read_inputs(str(tmp_path / "train.jsonl"), placeholder="<|AUDIO|>")))
    assert not isinstance(first, BadInput)
    assert first.messages[0] == {"role": "user", "content": "<|AUDIO|>"}  # no system turn, no written instruction
    with pytest.raises(ValueError, match="requests the answerer did not train on"):
        spoken_requests(tmp_path, 10, 1, 77)


def test_a_low_rank_lm_update_starts_at_zero_and_merges_into_the_checkpoint_names(tiny, tmp_path):
    from transformers import Qwen2AudioForConditionalGeneration

    from tapdraft.demo.real.answer import add_low_rank, merge_low_rank

    base, proc = tiny
    model = copy.deepcopy(base)
    names = set(base.state_dict())
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        before = base(input_ids=ids).logits
    params = add_low_rank(model.model.language_model, rank=2)
    assert len(params) == 2 * 7 * base.config.text_config.num_hidden_layers
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)  # B = 0: the model as it was
        for p in params[1::2]:
            p.normal_()
        moved = model(input_ids=ids).logits
    assert not torch.allclose(moved, before)
    assert merge_low_rank(model.model.language_model) == 7 * base.config.text_config.num_hidden_layers
    assert set(model.state_dict()) == names  # plain Linear weights again, under the checkpoint's names
    model.save_pretrained(tmp_path)
    again = Qwen2AudioForConditionalGeneration.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.allclose(again(input_ids=ids).logits, moved, atol=1e-5)
    with pytest.raises(ValueError, match="lm_rank"):
        AnswerConfig(lm_rank=-1)
    with pytest.raises(ValueError, match="nothing would train"):
        AnswerConfig(train_projector=False)
    assert AnswerConfig(train_projector=False, lm_rank=8).lm_rank == 8


def test_reply_losses_equal_a_float64_reference():
    from tapdraft.demo.real.listen import TopK, reply_losses

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, generator=g, dtype=torch.float64)
    y = torch.randint(0, 11, (7,), generator=g)
    teacher = torch.log_softmax(torch.randn(4, 11, generator=g, dtype=torch.float64), -1)
    top = teacher.topk(5, -1)
    got = reply_losses(logits.float(), y, [3, 4], [None, TopK(top.values.float(), top.indices)])
    logq = torch.log_softmax(logits, -1)
    ce = torch.nn.functional.cross_entropy(logits[:3], y[:3], reduction="none")
    p = torch.log_softmax(top.values, -1)  # the top-k renormalised
    kl = (p.exp() * (p - logq[3:].gather(1, top.indices))).sum(-1)
    assert torch.allclose(got.double(), torch.cat([ce, kl]), atol=1e-5, rtol=0)
    whole = teacher.topk(11, -1)  # every id kept: the exact KL
    exact = torch.nn.functional.kl_div(logq[3:], teacher, log_target=True, reduction="none").sum(-1)
    got = reply_losses(logits.float(), y, [3, 4], [None, TopK(whole.values.float(), whole.indices)])[3:]
    assert torch.allclose(got.double(), exact, atol=1e-5, rtol=0)
    same = torch.full((4, 11), -30.0, dtype=torch.float64).scatter(1, top.indices, p)  # the student is the teacher
    assert reply_losses(same.float(), y[3:], [4], [TopK(top.values.float(), top.indices)]).abs().max() < 1e-5
    with pytest.raises(AssertionError):
        reply_losses(logits.float(), y, [3, 3], [None, None])  # rows left over: the lengths do not cover the batch


def test_the_teacher_is_the_lms_own_forward_on_the_written_request(tiny):
    from tapdraft.demo.real.answer import prompt_text, written_teachers

    model, proc = tiny
    tok = proc.tokenizer
    teacher = written_teachers(model, tok, ["what did you say"], [[8, 9, 10]], 2, k=4)[0]
    prompt = tok(prompt_text(tok, "what did you say"), add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + [8, 9]])).logits[0, len(prompt) - 1: len(prompt) + 1]
    ref = torch.log_softmax(logits.double(), -1).topk(4, -1)
    assert torch.equal(teacher.ids, ref.indices) and torch.allclose(teacher.logp.double(), ref.values, atol=1e-5)
    ex = answer_examples(tok, [[8, 9, 10]], 0, 2, teachers=[teacher])[0]
    assert ex.reply.tolist() == [8, 9] and ex.teacher is teacher
    frames = encode_audio(model, waves(1), proc.feature_extractor)

    def first_loss(examples):
        m = copy.deepcopy(model)
        return fit(m, examples, frames, list(m.model.multi_modal_projector.parameters()), steps=1, batch=1, lr=1e-3,
                   seed=0, log=lambda *_: None)

    ce, kl = first_loss(answer_examples(tok, [[8, 9]], 0, 2)), first_loss([ex])
    assert kl[0] >= 0 and kl[0] != ce[0]


def test_the_benchmark_records_the_answerers_own_figures(tmp_path, monkeypatch):
    """``benchmarks.answer`` builds the answerer its flags describe (the same flags as ``python -m tapdraft.demo.real
    answer``) and writes that model's figures with the machine's facts."""
    import benchmarks.common
    import tapdraft.demo.real.answer as answer
    from benchmarks.answer import main

    asked = []

    def build(root, cfg):
        asked.append(cfg)
        return tmp_path / "smollm2-whisper-tiny-answer-abc", {"answers_held_out": {"first_32": 0.75}}

    monkeypatch.setattr(answer, "build_answerer", build)
    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path)
    main(["--distill", "--lm-rank", "8", "--steps", "12", "--name", "a.json"])
    assert asked == [AnswerConfig(distill=True, lm_rank=8, steps=12)]
    doc = json.loads((tmp_path / "a.json").read_text())
    assert doc["answers_held_out"]["first_32"] == 0.75 and doc["model"] == "smollm2-whisper-tiny-answer-abc"
    assert "load_avg_before" in doc["machine"] and doc["command"]


def test_fit_in_bf16_moves_the_projector_as_fp32_does_and_leaves_the_lm_alone(tiny):
    base, proc = tiny
    tok = proc.tokenizer
    replies = [tok(t, add_special_tokens=False)["input_ids"] for t in ("one two three", "four five six", "seven")]
    examples = answer_examples(tok, replies, 0, reply_tokens=3)
    frames = encode_audio(base, waves(3), proc.feature_extractor)
    lm_before = {k: v.clone() for k, v in base.model.language_model.state_dict().items()}

    def step(dtype):
        model = copy.deepcopy(base)
        proj = model.model.multi_modal_projector.linear.weight
        start = proj.detach().clone()
        losses = fit(model, examples, frames, list(model.model.multi_modal_projector.parameters()), steps=1, batch=3,
                     lr=1e-3, seed=0, log=lambda *_: None, frozen_dtype=dtype)
        return model, losses[0], (proj.detach() - start).flatten()

    m16, loss16, d16 = step(torch.bfloat16)
    _, loss32, d32 = step(torch.float32)
    assert loss16 == pytest.approx(loss32, rel=0.02)
    assert torch.nn.functional.cosine_similarity(d16, d32, dim=0) > 0.9  # Adam's first step: the gradients' signs
    for k, v in m16.model.language_model.state_dict().items():  # the bf16 copy trained nothing into the model
        assert v.dtype == lm_before[k].dtype and torch.equal(v, lm_before[k])
    model = copy.deepcopy(base)
    with pytest.raises(ValueError, match="frozen language model"):
        fit(model, examples, frames, list(model.model.language_model.layers[0].parameters()), steps=1, batch=1,
            lr=1e-3, seed=0, log=lambda *_: None, frozen_dtype=torch.bfloat16)
