"""The assistant mask from real chat-template formats (Qwen3 with thinking, Llama-3, Gemma) by prefix
rendering, the {% generation %} cross-check, tokenisation boundaries, and template kwargs."""

from __future__ import annotations

import pytest

from tapdraft.capture.targets.salm.model import CHAT_TEMPLATE
from tapdraft.capture.template import MASK_BY_MARKERS, MASK_BY_PREFIX, ChatTemplate
from tapdraft.demo.target import build_word_tokenizer
from tapdraft.common.template import check_template, parse_template_kwargs
from tests.capture.chat_templates import end_ids, make_tokenizer, supervised_runs

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
Q1 = {"role": "user", "content": "What is the capital of France?"}
A1 = {"role": "assistant", "content": "Paris is the capital."}
Q2 = {"role": "user", "content": "How many people live there?"}
A2 = {"role": "assistant", "content": "About two million."}
A2_THINK = {"role": "assistant", "content": "<think>\nLet me think.\n</think>\n\nAbout two million."}
Q3 = {"role": "user", "content": "thanks"}
A3 = {"role": "assistant", "content": "good question, bye"}


def _template(family, **kwargs):
    tok = make_tokenizer(family)
    return tok, ChatTemplate(tok, kwargs=kwargs, end_ids=end_ids(tok, family))


def _runs(family, messages, **kwargs):
    tok, ct = _template(family, **kwargs)
    t = ct.tokenize(messages)
    assert ct.mask_source == MASK_BY_PREFIX and t.ids.shape == t.mask.shape
    return supervised_runs(tok, t.ids, t.mask), t.unsupervised


def test_llama3_every_turn_up_to_its_eot_and_nothing_else():
    runs, dropped = _runs("llama3", [SYSTEM, Q1, A1, Q2, A2, Q3, A3])
    assert runs == ["Paris is the capital.<|eot_id|>", "About two million.<|eot_id|>", "good question, bye<|eot_id|>"]
    assert dropped == []
    runs, _ = _runs("llama3", [Q1, A1])  # no system message: the template writes its default header
    assert runs == ["Paris is the capital.<|eot_id|>"]


def test_llama3_date_kwarg_changes_the_tokens_not_the_turns():
    tok, plain = _template("llama3")
    _, dated = _template("llama3", date_string="1 Jan 2026")
    a, b = plain.tokenize([SYSTEM, Q1, A1]), dated.tokenize([SYSTEM, Q1, A1])
    assert "Today Date: 1 Jan 2026" in dated.render([Q1]) and "26 Jul 2024" in plain.render([Q1])
    assert a.ids.tolist() != b.ids.tolist()
    assert supervised_runs(tok, a.ids, a.mask) == supervised_runs(tok, b.ids, b.mask)


def test_gemma_system_prompt_goes_into_the_first_user_turn_and_is_not_supervised():
    tok, ct = _template("gemma")
    t = ct.tokenize([SYSTEM, Q1, A1, Q2, A2])
    assert supervised_runs(tok, t.ids, t.mask) == ["Paris is the capital.<end_of_turn>",
                                                   "About two million.<end_of_turn>"]
    text = ct.render([SYSTEM, Q1, A1])
    assert text.startswith("<bos><start_of_turn>user\nYou are a helpful assistant.\n\nWhat is")
    assert not t.mask[t.ids == tok.convert_tokens_to_ids("<start_of_turn>")].any()


def test_a_conversation_the_template_refuses_is_a_value_error():
    _, ct = _template("gemma")
    with pytest.raises(ValueError, match="refuses this conversation: Conversation roles must alternate"):
        ct.tokenize([Q1, Q2, A1])


def test_qwen3_thinking_on_supervises_the_think_block_of_the_last_turn():
    runs, dropped = _runs("qwen3", [SYSTEM, Q1, A1])
    assert runs == ["<think>\n\n</think>\n\nParis is the capital.<|im_end|>"]
    runs, dropped = _runs("qwen3", [SYSTEM, Q1, A1, Q2, A2_THINK])
    assert runs == ["<think>\nLet me think.\n</think>\n\nAbout two million.<|im_end|>"]
    # the first reply loses its think block once a user turn follows: what the model wrote is not in the sample
    assert len(dropped) == 1 and dropped[0].startswith("assistant turn 1 of 2: rendered as the last turn it differs")


def test_qwen3_thinking_off_supervises_the_reply_after_the_empty_think_block():
    runs, dropped = _runs("qwen3", [SYSTEM, Q1, A1], enable_thinking=False)
    assert runs == ["Paris is the capital.<|im_end|>"]
    runs, dropped = _runs("qwen3", [Q1, A1, Q2, A2, Q3, A3], enable_thinking=False)
    assert runs == ["good question, bye<|im_end|>"]
    assert len(dropped) == 2 and all("generation prompt is not a prefix" in r for r in dropped)
    with pytest.raises(ValueError, match="no supervised tokens: assistant turn 1 of 1: its generation prompt"):
        _runs("qwen3", [Q1, A2_THINK], enable_thinking=False)  # a reply with reasoning under thinking off


def test_generation_markers_are_used_and_agree_with_prefix_rendering():
    tok = build_word_tokenizer(["what", "did", "i", "say", "?", "you", "said", "one", "two", "."])
    ct = ChatTemplate(tok, end_ids=[tok.eos_token_id])
    assert ct.has_markers and ct.mask_source == MASK_BY_MARKERS
    msgs = [{"role": "user", "content": "what did i say ?"}, {"role": "assistant", "content": "you said one ."},
            {"role": "user", "content": "say ?"}, {"role": "assistant", "content": "two ."}]
    t = ct.tokenize(msgs)
    assert supervised_runs(tok, t.ids, t.mask) == ["you said one . <|im_end|>", "two . <|im_end|>"]
    plain = ChatTemplate(tok, CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", ""),
                         end_ids=[tok.eos_token_id])
    assert not plain.has_markers and plain.tokenize(msgs).mask.tolist() == t.mask.tolist()


def test_markers_that_contradict_the_template_refuse_the_sample():
    tok = build_word_tokenizer(["what", "did", "i", "say", "?", "you", "said", "one", "."])
    wrong = CHAT_TEMPLATE.replace("{% else %}{{ m['content'] + '<|im_end|>' }}",
                                  "{% else %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}")
    ct = ChatTemplate(tok, wrong, end_ids=[tok.eos_token_id])
    with pytest.raises(ValueError, match="markers and its prefix rendering disagree at token 2"):
        ct.tokenize([{"role": "user", "content": "what did i say ?"},
                     {"role": "assistant", "content": "you said one ."}])


def test_what_follows_the_end_of_turn_token_is_left_to_the_markers_but_a_marked_user_turn_is_not():
    tok = make_tokenizer("qwen3")
    chatml = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
              "{%- if m['role'] == 'assistant' %}"
              "{% generation %}{{- m['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
              "{%- else %}{{- m['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
              "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    t = ChatTemplate(tok, chatml, end_ids=end_ids(tok, "qwen3")).tokenize([Q1, A1, Q2, A2])
    assert supervised_runs(tok, t.ids, t.mask) == ["Paris is the capital.<|im_end|>\n",
                                                   "About two million.<|im_end|>\n"]
    marks_q2 = chatml.replace("{%- else %}{{- m['content'] + '<|im_end|>\\n' }}",
                              "{%- elif loop.index0 > 0 %}{% generation %}{{- m['content'] + '<|im_end|>\\n' }}"
                              "{% endgeneration %}{%- else %}{{- m['content'] + '<|im_end|>\\n' }}")
    with pytest.raises(ValueError, match=r"markers and its prefix rendering disagree at token \d+ \('How'"):
        ChatTemplate(tok, marks_q2, end_ids=end_ids(tok, "qwen3")).tokenize([Q1, A1, Q2, A2])


QWEN3_MARKED_HISTORY = (  # ChatML whose history turns are marked; the last turn's think block is marked too
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}{{- '<|im_start|>user\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- elif loop.last %}{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}{{- '<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}{{- m['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_turns_prefix_rendering_cannot_check_follow_the_markers():
    tok = make_tokenizer("qwen3")
    ct = ChatTemplate(tok, QWEN3_MARKED_HISTORY, end_ids=end_ids(tok, "qwen3"))
    t = ct.tokenize([Q1, A1, Q2, A2])
    assert supervised_runs(tok, t.ids, t.mask) == ["Paris is the capital.<|im_end|>",
                                                   "<think>\n\n</think>\n\nAbout two million.<|im_end|>"]
    assert t.unsupervised == []


def test_a_tokenizer_merge_across_the_turn_boundary_is_refused_with_the_reason():
    tok = make_tokenizer("llama3")
    colon = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    ct = ChatTemplate(tok, colon, end_ids=end_ids(tok, "llama3"))
    # the prompt ends in a lone space token; the conversation has it merged into " Paris"
    with pytest.raises(ValueError, match="no supervised tokens: assistant turn 1 of 1: its generation prompt is not a "
                                         "prefix .* merges text across the turn boundary"):
        ct.tokenize([Q1, A1])


def test_template_kwargs_parse_validate_and_compare():
    kw = parse_template_kwargs(["enable_thinking=false", "system_prompt=Be brief.", "n=3", 'tags=["a"]'])
    assert kw == {"enable_thinking": False, "n": 3, "system_prompt": "Be brief.", "tags": ["a"]}
    assert list(kw) == sorted(kw)
    for bad, msg in (("add_generation_prompt=true", "set by tapdraft"), ("no-equals", "key=value"),
                     ("2x=1", "identifier")):
        with pytest.raises(ValueError, match=msg):
            parse_template_kwargs([bad])
    dataset = ("TEMPLATE", {"enable_thinking": False})
    check_template(dataset, template="TEMPLATE", kwargs={"enable_thinking": False}, where="ds", given_by="x")
    check_template(dataset, where="ds", given_by="x")  # no expectation: nothing to refuse
    with pytest.raises(ValueError, match=r"^ds was captured with other chat-template settings: speculate has "
                                         r"template kwargs \{\} \(the dataset's are \{\"enable_thinking\": false\}\)"):
        check_template(dataset, template="TEMPLATE", kwargs={}, where="ds", given_by="speculate")
    with pytest.raises(ValueError, match=r"train has chat template sha256 \w+ \(the dataset's is sha256 \w+\); "
                                         r"use") as e:
        check_template(dataset, template="OTHER", where="ds", given_by="train")
    assert "\n" not in str(e.value)


def _metaspace_tokenizer():
    """A SentencePiece-style BPE (Metaspace, prepend scheme "first": only the text's first piece gets a ▁), whose
    end-of-turn token absorbs the whitespace around it (lstrip/rstrip)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.capture.chat_templates import _CORPUS

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tk.train_from_iterator(_CORPUS * 4, trainers.BpeTrainer(vocab_size=300, show_progress=False, special_tokens=[
        "<unk>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]))
    tk.add_special_tokens([AddedToken("<end_of_turn>", lstrip=True, rstrip=True, special=True)])  # eats spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = GEMMA_TEMPLATE
    eot = tok.convert_tokens_to_ids("<end_of_turn>")
    assert tok(" <end_of_turn>\n", add_special_tokens=False)["input_ids"] == [eot]
    return tok


from tests.capture.chat_templates import GEMMA as GEMMA_TEMPLATE  # noqa: E402


@pytest.mark.parametrize("family", ["qwen3", "llama3", "gemma", "metaspace", "words"])
def test_prefix_tokens_from_the_conversation_equal_encoding_the_prefix_whole(family):
    """The shortcut capture.template takes (re-encode only after the last special token) at every cut."""
    from tapdraft.capture.template import _Encoded

    if family == "metaspace":
        tok = _metaspace_tokenizer()
    elif family == "words":
        tok = build_word_tokenizer(["what", "is", "the", "capital", "of", "france", "?", "paris", "."])
    else:
        tok = make_tokenizer(family)
    ct = ChatTemplate(tok, end_ids=[tok.eos_token_id])
    msgs = [SYSTEM, Q1, A1, Q2, A2] if family not in ("words",) else [
        {"role": "user", "content": "what is the capital of france ?"}, {"role": "assistant", "content": "paris ."}]
    text = ct.render(msgs)
    enc = _Encoded(ct, text)
    assert enc.ids == ct.encode(text) and (family == "words" or len(enc.anchors) >= 5)
    for c in range(len(text) + 1):
        assert enc.prefix_ids(text[:c]) == ct.encode(text[:c]), (c, text[:c][-20:])


@pytest.mark.parametrize("family", ["qwen3", "llama3", "gemma"])
def test_no_token_stands_for_more_characters_than_the_text_bound_assumes(family):
    """The text bound (``ChatTemplate.text_bound``) refuses a conversation its positions cannot hold at the tokenizer's
    longest token: sound only if no token of any text covers more characters than that. Checked on byte-level BPE
    over trained words, the longest token repeated, special tokens inline, multi-byte and random text."""
    import random

    tok = make_tokenizer(family)
    ct = ChatTemplate(tok, end_ids=end_ids(tok, family))
    longest = ct.longest_token()
    top = max(tok.get_vocab(), key=len)
    rng = random.Random(0)
    texts = ["What is the capital of France? Paris is the capital of France.", tok.convert_tokens_to_string([top]) * 50,
             " ".join(tok.all_special_tokens) * 20, "é中文😀 " * 40, "x" * 1000, " " * 1000,
             "".join(chr(rng.randrange(32, 0x3000)) for _ in range(2000))]
    for text in texts:
        n = len(tok(text, add_special_tokens=False)["input_ids"])
        assert n * longest >= len(text), (text[:40], n, longest)


def test_the_text_bound_refuses_one_character_past_it_before_rendering(monkeypatch):
    """``check_text_size`` passes a conversation at its bound and refuses one a character longer, naming the longest
    turn, without rendering or tokenizing; a target whose positions are unknown gets ``MAX_TEXT_CHARS``."""
    from tapdraft.capture import template as tm

    tok = make_tokenizer("qwen3")
    ct = ChatTemplate(tok, end_ids=end_ids(tok, "qwen3"))
    monkeypatch.setattr(ChatTemplate, "render", lambda *a, **k: pytest.fail("rendered"))
    monkeypatch.setattr(ChatTemplate, "encode", lambda *a, **k: pytest.fail("tokenized"))
    bound, why = ct.text_bound(100)
    assert bound == 100 * ct.longest_token() and "100 positions" in why
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x" * (bound - 2)}]
    ct.check_text_size(msgs, 100)
    msgs[1]["content"] += "x"
    with pytest.raises(ValueError, match=rf"too long to tokenize: its text is {bound + 1:,} characters \(turn 2, "
                                         rf"assistant: {bound - 1:,}\).*was not tokenized: shorten or split") as e:
        ct.check_text_size(msgs, 100)
    assert "\n" not in str(e.value)
    monkeypatch.setattr(tm, "MAX_TEXT_CHARS", 50)
    assert ct.text_bound(None) == (50, "tapdraft tokenizes at most") == ct.text_bound(10 ** 9)
    with pytest.raises(ValueError, match="more than the 50 tapdraft tokenizes at most"):
        ct.check_text_size([{"role": "user", "content": "y" * 51}], None)
