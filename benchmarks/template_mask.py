"""Cost of the assistant mask per conversation: prefix rendering vs HF's generation-marker mask.

capture.template derives the supervised tokens of any chat template by rendering each assistant turn's
prefix (with and without the generation prompt) and tokenizing those prefixes; HF's
``return_assistant_tokens_mask`` reads ``{% generation %}`` markers from one rendering. Both tokenize
with a byte-level BPE (vocabulary 2000, trained here on the benchmark's own text) a ChatML
conversation with a system prompt and N assistant turns. Interleaved pairs, median of ``--pairs``
(>= 5); ratio = variant / marker mask (lower is better). Writes benchmarks/results/template_mask.json.

    python -m benchmarks.template_mask              # 1, 4 and 8 assistant turns
    python -m benchmarks.template_mask --quick      # 4 turns only
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import write_result
from tapdraft.capture.targets.salm.model import CHAT_TEMPLATE
from tapdraft.capture.template import ChatTemplate

USER = "What did the speaker say about the weather in the second half of the recording? "
REPLY = "The speaker said it would rain in the afternoon and clear up by the evening, with light wind. "
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator([USER, REPLY, "system user assistant You are a helpful assistant."] * 8,
                           trainers.BpeTrainer(vocab_size=2000, special_tokens=SPECIALS, show_progress=False,
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def conversation(turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    for _ in range(turns):
        msgs += [{"role": "user", "content": USER * 2}, {"role": "assistant", "content": REPLY * 4}]
    return msgs


def measure(turns: int, pairs: int, reps: int = 10) -> dict:
    tok = tokenizer()
    eos = [tok.eos_token_id]
    plain = ChatTemplate(tok, CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", ""),
                         end_ids=eos)
    marked = ChatTemplate(tok, CHAT_TEMPLATE, end_ids=eos)
    msgs = conversation(turns)
    variants = {
        "markers (HF)": lambda: tok.apply_chat_template(msgs, chat_template=CHAT_TEMPLATE, tokenize=True,
                                                        return_dict=True, return_assistant_tokens_mask=True),
        "prefix rendering": lambda: plain.tokenize(msgs),
        "markers + prefix check": lambda: marked.tokenize(msgs),
    }
    assert plain.tokenize(msgs).mask.tolist() == marked.tokenize(msgs).mask.tolist()
    ms: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(pairs):
        for k, f in variants.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                f()
            ms[k].append((time.perf_counter() - t0) / reps * 1e3)
    base = ms["markers (HF)"]
    return {"assistant_turns": turns, "tokens": int(plain.tokenize(msgs).ids.shape[0]),
            "ms": {k: statistics.median(v) for k, v in ms.items()},
            "ratio": {k: statistics.median(a / b for a, b in zip(v, base)) for k, v in ms.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.pairs < 5:
        raise SystemExit("--pairs must be >= 5")
    rows = [measure(t, args.pairs) for t in ((4,) if args.quick else (1, 4, 8))]
    print(f"{'turns':>6}{'tokens':>8}  " + "".join(f"{k:>26}" for k in rows[0]["ms"]))
    for r in rows:
        print(f"{r['assistant_turns']:>6}{r['tokens']:>8}  "
              + "".join(f"{r['ms'][k]:>14.2f} ms ({r['ratio'][k]:.2f}x)" for k in r["ms"]))
    write_result("template_mask.json", {"benchmark": "template_mask", "rows": rows})


if __name__ == "__main__":
    main()
