"""The built-in demo: a small speech LLM on a synthetic spoken task, taken through the whole chain.

    task.py     the tone-coded digits task: audio, prompts, templated replies
    target.py   the demo SALM (word-level tokenizer, sizes) and its ~90 s training loop
    data.py     the capture half, cached in a work directory: target, audio + its own greedy
                replies, dataset
    run.py      the rest: DFlash drafter training, offline and live acceptance, export, summary

demo/ sits above capture, train and speculate and may import all three; only ``cli.py``, tests and
benchmarks import it.
"""
