"""Real chat-template formats as test fixtures, and a small byte-level BPE tokenizer that can encode them.

The Jinja strings are written here from each family's documented prompt format (model cards and
prompt-format pages), not copied from any repository. They keep what matters for the assistant mask:

- QWEN3: ChatML; the assistant turns after the last user message carry a ``<think>`` block (empty when
  the reply has no reasoning), earlier turns lose it; ``enable_thinking=false`` makes the generation
  prompt end in an empty think block. A ``<think>...</think>`` prefix in a reply is its reasoning.
- LLAMA3: ``<|begin_of_text|>``, header blocks ``<|start_header_id|>role<|end_header_id|>\\n\\n``, turns
  ending in ``<|eot_id|>``; the 3.1 system header with the knowledge cut-off and ``date_string``.
- GEMMA: ``<bos>``, ``<start_of_turn>user|model\\n ... <end_of_turn>\\n``; no system role, so a system
  prompt is prepended to the first user turn; roles must alternate.
"""

from __future__ import annotations

from functools import lru_cache

QWEN3 = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}"
    "{{- '<|im_start|>user\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- elif m['role'] == 'assistant' %}"
    "{%- set content = m['content'] %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

LLAMA3 = (
    "{{- bos_token }}"
    "{%- if date_string is not defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}"
    "{%- set system_message = '' %}{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message + '<|eot_id|>' }}"
    "{%- for m in loop_messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

GEMMA = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set first_prefix = messages[0]['content'] | trim + '\\n\\n' %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}"
    "{%- set first_prefix = '' %}{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{%- for m in loop_messages %}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + (first_prefix if loop.first else '') + m['content'] | trim }}"
    "{{- '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

SPECIALS = {
    "qwen3": ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"],
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "gemma": ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"],
}
TEMPLATES = {"qwen3": QWEN3, "llama3": LLAMA3, "gemma": GEMMA}
END_OF_TURN = {"qwen3": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>"}
"""The token that ends an assistant turn (the model's eos / generation-config eos)."""

_CORPUS = [
    "You are a helpful assistant. Answer briefly.",
    "What is the capital of France? Paris is the capital of France.",
    "How many people live there? About two million people live in Paris.",
    "Let me think about the numbers first. Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024",
    "user assistant system model hello world thanks bye good question the answer is 42",
]


@lru_cache(maxsize=None)
def _bpe(family: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS[family],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(_CORPUS * 4, trainer)
    return tk.to_str()


def make_tokenizer(family: str):
    """A byte-level BPE tokenizer (any text encodes) with ``family``'s special tokens and chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    sp = SPECIALS[family]
    bos = {"qwen3": None, "llama3": sp[0], "gemma": sp[0]}[family]
    eos = END_OF_TURN[family] if family != "gemma" else "<eos>"
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_bpe(family)), bos_token=bos, eos_token=eos,
                                  pad_token=sp[-1] if family == "qwen3" else sp[2] if family == "gemma" else sp[1])
    tok.chat_template = TEMPLATES[family]
    return tok


def end_ids(tok, family: str) -> list[int]:
    return [tok.convert_tokens_to_ids(END_OF_TURN[family]), tok.eos_token_id]


def supervised_runs(tok, ids, mask) -> list[str]:
    """The decoded text of each maximal run of supervised tokens."""
    runs, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


def save_qwen3(d, *, with_template: bool = False, layers: int = 2, seed: int = 0):
    """A tiny random-init Qwen3ForCausalLM + the qwen3 tokenizer saved with ``save_pretrained`` (HF layout);
    the tokenizer carries the QWEN3 template only when ``with_template``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = make_tokenizer("qwen3")
    if not with_template:
        tok.chat_template = None
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
                      eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id,
                      bos_token_id=None)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d
