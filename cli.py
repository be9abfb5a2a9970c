"""tapdraft's command line: each command builds a typed config, calls one function, prints a summary.

Commands are listed in pipeline order. A user's mistake is one ``error: ...`` line on stderr and the
exit code its type carries (``common.errors``: 2 for a mistake, 130 for an interrupt, 1 for verify
problems or a bug); ``tapdraft --debug COMMAND`` also prints the traceback.
"""

from __future__ import annotations

import signal
import sys
import threading
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import typer

from tapdraft.capture.engines import DEFAULT_ENGINE, engine_help, engine_settings
from tapdraft.shards.formats import DEFAULT_FORMAT, format_help
from tapdraft.shards.taps import DEFAULT_TAPS_CODEC, codec_help

app = typer.Typer(
    name="tapdraft",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
_RUN: dict = {"debug": False, "signal": ""}

THREADS_HELP = "CPU threads for torch (0: auto = half the CPUs this process may use, at most 8)."
# options several commands share: one wording each
INPUTS = "FILE.jsonl, a directory of JSONL shards, an HF dataset dir or hf:NAME[:split]"
OUTSIDE_HELP = ("Let audio paths in a JSONL leave its directory (../, absolute paths). Off by default, so that a "
                "shared manifest cannot make this command read other files of this machine; use it for a manifest "
                "you wrote.")
TARGET_HELP = ("Target directory: a SALM (salm_config.json), a NeMo SALM checkpoint (config.json + "
               "model.safetensors), a speech LLM as published (Qwen2-Audio, Qwen3-ASR, Voxtral, Granite Speech), "
               "or an HF causal LM.")
LLM_CONFIG_HELP = ("NeMo SALM checkpoints that only name their LLM: a local directory with its config.json and "
                   "tokenizer.")
DTYPE_HELP = "auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16 | float16"
DEVICE_HELP = "auto | cpu | cuda | cuda:N"
TEMPLATE_HELP = "Jinja file replacing the target's chat template."
TEMPLATE_KWARG_HELP = ("Chat-template variable key=value (JSON value or text), e.g. enable_thinking=false. "
                       "Repeatable; recorded.")


def _version(show: bool) -> None:
    if show:
        from tapdraft import __version__

        typer.echo(f"tapdraft {__version__}")
        raise typer.Exit()


@app.callback()
def _options(debug: bool = typer.Option(False, "--debug", help="On an error, print the full traceback too."),
             version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                          help="Print tapdraft's version and exit.")) -> None:
    """Capture a speech LLM's hidden states into shareable shards and train speculative-decoding drafters.

    Pipeline: (requests ->) regenerate -> capture -> verify / inspect -> train -> eval -> speculate / export.

    requests writes requests when you have no data of your own; regenerate is optional when replies are the target's.

    derive writes a lighter dataset; push / pull share one through an object store. `tapdraft demo` runs the
    whole chain on a built-in task.
    """
    _RUN["debug"] = debug


@contextmanager
def _kept_on_interrupt(command: str, kept: str) -> Iterator[None]:
    """Ctrl-C or SIGTERM (``main`` makes SIGTERM a KeyboardInterrupt, as train and capture take Ctrl-C) during
    ``command``: exit 130 with one line saying what was kept, as train's, instead of a bare 130 or 143."""
    try:
        yield
    except KeyboardInterrupt:
        from tapdraft.common.errors import Interrupted

        raise Interrupted(f"{command} stopped by {_RUN['signal'] or 'SIGINT'}: {kept}") from None


def _writers(value: str) -> int | None:
    """``--writers``: a lane count, or ``auto`` (None: the capture decides at its start, capture.config.pin_writers)."""
    if value == "auto":
        return None
    if not value.isdigit():
        raise ValueError(f"--writers must be auto or a whole number of lanes, got {value!r}")
    return int(value)  # its range is ShardConfig's to check


def _threads(n: int) -> int:
    """Apply ``--threads`` (0 = auto: ``common.host.default_threads``) to torch and return the count used."""
    import torch

    if n < 0:
        raise ValueError(f"--threads must be >= 0 (0 = auto), got {n}")
    if n == 0:
        from tapdraft.common.host import default_threads

        n = default_threads()
    torch.set_num_threads(n)
    return n


ON_LIMIT_HELP = ("A reply that hits --max-new-tokens: drop (default: a target that never ends its turns, from a wrong "
                 "template or end-of-turn id, shows as drops, not as a dataset of cut replies) | keep (written marked "
                 "truncated; its tokens are supervised, with no end of turn).")


def _reply_config(max_new_tokens: int, temperature: float, top_p: float, seed: int, last_turn_only: bool,
                  on_limit: str, max_conversation_tokens: int | None = None):
    from tapdraft.capture.generation import GenerationConfig, ReplyConfig

    if on_limit not in ("keep", "drop"):
        raise ValueError(f"--on-limit {on_limit!r}: give keep or drop")
    return ReplyConfig(
        generation=GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed),
        last_turn_only=last_turn_only, keep_truncated=on_limit == "keep", max_conversation_tokens=max_conversation_tokens)


@app.command()
def regenerate(
    target: str = typer.Option(..., "--target", help=TARGET_HELP),
    llm_config: str = typer.Option(None, "--llm-config", help=LLM_CONFIG_HELP),
    data: str = typer.Option(..., "--data", help=f"Conversations: {INPUTS}."),
    out: str = typer.Option(..., "--out", help="FILE.jsonl, or a directory for JSONL shards (resumed when rerun)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens",
                                       help="Reply tokens at most; longer replies are truncated."),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy; > 0: sample."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (sampling only)."),
    seed: int = typer.Option(0, "--seed", help="Base seed; each reply's seed derives from it and the sample id."),
    last_turn_only: bool = typer.Option(False, "--last-turn-only", help="Replace only the last assistant turn."),
    on_limit: str = typer.Option("drop", "--on-limit", help=ON_LIMIT_HELP),
    max_conversation_tokens: int = typer.Option(
        None, "--max-conversation-tokens", help="Token budget of one conversation (prompt + replies): it ends at the "
        "last reply that fits (counted as cut), or is dropped when its first turn does not fit. Default: the target's "
        "context."),
    chat_template: str = typer.Option(None, "--chat-template", help=TEMPLATE_HELP),
    template_kwarg: list[str] = typer.Option([], "--template-kwarg", help=TEMPLATE_KWARG_HELP),
    max_samples: int = typer.Option(None, "--max-samples", help="Only the first N conversations."),
    batch_tokens: int = typer.Option(16384, "--batch-tokens",
                                     help="Padded prompt + reply tokens per generation batch."),
    max_batch_size: int = typer.Option(64, "--max-batch-size", help="Conversations per generation batch at most "
                                       "(with --engine vllm: conversations in flight at once)."),
    window: int = typer.Option(32, "--window", help="Conversations per part file: the unit a rerun after a kill "
                               "recomputes."),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    on_error: str = typer.Option("fail", "--on-error",
                                 help="fail: stop at the first bad input (resumable) | skip: count bad inputs with "
                                 "their reason."),
    allow_outside_paths: bool = typer.Option(False, "--allow-outside-paths", help=OUTSIDE_HELP),
    threads: int = typer.Option(0, "--threads", help=THREADS_HELP),
    engine: str = typer.Option(DEFAULT_ENGINE, "--engine", help=f"What decodes: {engine_help('regenerate')}."),
    vllm_python: str = typer.Option(None, "--vllm-python", help="With --engine vllm: the python of the environment "
                                    "vLLM is installed in (`tapdraft venv vllm` builds one and prints its path)."),
    data_parallel_size: int = typer.Option(1, "--data-parallel-size", help="With --engine vllm: independent vLLM "
                                           "engines sharing the conversations."),
    prefix_caching: bool = typer.Option(False, "--prefix-caching", help="With --engine vllm: a conversation's next "
                                        "turn reuses the KV of the turns before it (multi-turn data prefilled about "
                                        "once, not once per turn). Replies may then differ from the in-process "
                                        "engine's at near-ties, and a rerun after a kill may not repeat a window "
                                        "token for token."),
) -> None:
    """Replace assistant turns with the target's own replies (resumable); a sidecar JSON records settings and counts."""
    from pathlib import Path

    from tapdraft.capture.replies.regenerate import RegenerateConfig, summary
    from tapdraft.capture.replies.regenerate import regenerate as run_regenerate
    from tapdraft.common.template import parse_template_kwargs

    _threads(threads)
    cfg = RegenerateConfig(
        target=target, data=data, out=out,
        replies=_reply_config(max_new_tokens, temperature, top_p, seed, last_turn_only, on_limit,
                              max_conversation_tokens),
        chat_template=None if chat_template is None else str(Path(chat_template).resolve()),
        template_kwargs=tuple(parse_template_kwargs(template_kwarg).items()),
        max_samples=max_samples, batch_tokens=batch_tokens, max_batch_size=max_batch_size, window=window, dtype=dtype,
        device=device, on_error=on_error, llm_config=None if llm_config is None else str(Path(llm_config).resolve()),
        allow_outside_paths=allow_outside_paths, engine=engine,
        vllm=engine_settings(engine, data_parallel_size=data_parallel_size), prefix_caching=prefix_caching,
        vllm_python=None if vllm_python is None else str(Path(vllm_python).absolute()),
    )
    typer.echo(summary(run_regenerate(cfg)))


@app.command()
def requests(
    target: str = typer.Option(..., "--target", help=TARGET_HELP),
    out: str = typer.Option(..., "--out", help="FILE.jsonl: one conversation a line, the request and a pending reply "
                            "(its NAME.requests.json sidecar says how they were made)."),
    count: int = typer.Option(1000, "--count", help="Requests to keep."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Tokens a request may take; longer ones are "
                                       "dropped."),
    temperature: float = typer.Option(1.0, "--temperature", help="Sampling temperature (> 0)."),
    top_p: float = typer.Option(0.95, "--top-p", help="Nucleus sampling mass."),
    seed: int = typer.Option(0, "--seed", help="Base seed; each draw's seed derives from it and its index."),
    min_words: int = typer.Option(3, "--min-words", help="Requests of fewer words are dropped."),
    batch_size: int = typer.Option(64, "--batch-size", help="Requests sampled at once."),
    max_draws: int = typer.Option(None, "--max-draws", help="Draws at most (default 4 x --count)."),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    threads: int = typer.Option(0, "--threads", help=THREADS_HELP),
) -> None:
    """Have the target write requests itself, for training without data of your own (the Magpie method): sampled from
    its chat template's opening of a user turn, deduplicated and filtered; then `tapdraft regenerate` them."""
    from tapdraft.capture.generation import GenerationConfig
    from tapdraft.capture.replies.requests import RequestsConfig, summary, write_requests

    _threads(threads)
    cfg = RequestsConfig(target=target, out=out, count=count, min_words=min_words, batch_size=batch_size,
                         max_draws=max_draws, dtype=dtype, device=device,
                         generation=GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature,
                                                     top_p=top_p, seed=seed))
    typer.echo(summary(write_requests(cfg)))


@app.command()
def capture(
    target: str = typer.Option(..., "--target", help=TARGET_HELP),
    llm_config: str = typer.Option(None, "--llm-config", help=LLM_CONFIG_HELP),
    data: list[str] = typer.Option(..., "--data", help=f"Input for the train split ({INPUTS}); SPLIT=INPUT for "
                                   "other splits. Repeatable."),
    out: str = typer.Option(..., "--out", help="Dataset directory (created, or resumed with the same settings), or "
                            "a URL (s3://...): shards are staged locally and uploaded as they finish, manifest last."),
    stage: str = typer.Option(None, "--stage", help="With a URL --out: the local staging directory (default under "
                              "~/.cache/tapdraft/staging; rerun with the same one to resume)."),
    max_samples: int = typer.Option(None, "--max-samples", help="Only the first N inputs of each split."),
    max_length: int = typer.Option(None, "--max-length",
                                   help="Skip (and count) samples longer than this many tokens; never truncate."),
    format: str = typer.Option(DEFAULT_FORMAT, "--format", help=f"Storage format: {format_help()}."),
    top_k: int = typer.Option(64, "--top-k", help="Teacher top-k per supervised row (0: none)."),
    taps: str = typer.Option(None, "--taps", help="Comma-separated HF tap ids (default: the DFlash rule for "
                             "--draft-layers and for one layer, as the dflash recipe trains, + the last layer)."),
    draft_layers: int = typer.Option(5, "--draft-layers", help="Draft depth the default taps are chosen for."),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
    codec: str = typer.Option(DEFAULT_TAPS_CODEC, "--codec", help=f"Taps codec: {codec_help()}."),
    on_error: str = typer.Option("fail", "--on-error", help="fail: stop at a bad input (resumable) | skip: record it."),
    allow_outside_paths: bool = typer.Option(False, "--allow-outside-paths", help=OUTSIDE_HELP),
    final_hidden: bool = typer.Option(False, "--final-hidden", help="Also store final_hidden (pre-norm last layer)."),
    audio_embeds: bool = typer.Option(False, "--audio-embeds", help="Also store input embeddings at audio rows."),
    batch_tokens: int = typer.Option(16384, "--batch-tokens", help="Padded tokens per forward batch."),
    shard_bytes: int = typer.Option(1 << 30, "--shard-bytes", help="Roll shards at this size in bytes (1 GiB)."),
    zstd_level: int = typer.Option(1, "--zstd-level", help="Shard compression level; 0 = uncompressed Arrow: the "
                                   "fastest read (with --bf16-layout raw), ~1.45x the default's bytes on disk."),
    writers: str = typer.Option("auto", "--writers", help="Writer threads per rank, each compressing its own "
                                "shards: what keeps up with a fast GPU. auto: 1 on a CPU, 4 on a GPU (fewer with "
                                "under 8 host cores a rank), a resume's recorded count (docs/performance.md)."),
    bf16_layout: str = typer.Option("planes", "--bf16-layout", help="planes (compresses better) | raw (uint16 words: "
                                    "with --zstd-level 0, taps are read without a decode pass) | split (only the taps' "
                                    "exponent bytes compressed, by the codec: with --zstd-level 0 the writer needs "
                                    "about half planes' CPU for about its size; the layout for a GPU's rate)."),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    responses_from_target: bool = typer.Option(
        None, "--responses-from-target/--responses-from-elsewhere",
        help="Record whether the assistant turns are the target's own greedy replies (offline tau is then exact "
             "for greedy decoding). Default: derived (--regenerate, or a regenerate sidecar beside the input)."),
    chat_template: str = typer.Option(None, "--chat-template", help=TEMPLATE_HELP),
    template_kwarg: list[str] = typer.Option([], "--template-kwarg", help=TEMPLATE_KWARG_HELP),
    threads: int = typer.Option(0, "--threads", help=THREADS_HELP),
    regenerate: bool = typer.Option(False, "--regenerate", help="First replace the assistant turns with the target's "
                                    "own replies; taps come from the generation pass itself (see --two-pass)."),
    two_pass: bool = typer.Option(False, "--two-pass", help="With --regenerate: write the replies to OUT.regenerated/ "
                                  "and capture them in a second forward (bit-identical prefill taps; slower)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="With --regenerate: reply tokens at most."),
    temperature: float = typer.Option(0.0, "--temperature", help="With --regenerate: 0 greedy; > 0 sample."),
    top_p: float = typer.Option(1.0, "--top-p", help="With --regenerate: nucleus sampling mass."),
    seed: int = typer.Option(0, "--seed", help="With --regenerate: base seed of per-sample samplers."),
    last_turn_only: bool = typer.Option(False, "--last-turn-only",
                                        help="With --regenerate: replace only the last assistant turn."),
    on_limit: str = typer.Option("drop", "--on-limit", help="With --regenerate: " + ON_LIMIT_HELP),
    restart: bool = typer.Option(False, "--restart", help="Discard what an earlier capture wrote into --out and start "
                                 "over (after a changed input or setting)."),
    engine: str = typer.Option(DEFAULT_ENGINE, "--engine", help=f"What runs the target: {engine_help('capture')}."),
    vllm_python: str = typer.Option(None, "--vllm-python", help="With --engine vllm: the python of the environment "
                                    "vLLM is installed in (default: this one)."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", help="With --engine vllm: vLLM's tensor "
                                             "parallelism."),
    pipeline_parallel_size: int = typer.Option(1, "--pipeline-parallel-size", help="With --engine vllm: vLLM's "
                                               "pipeline parallelism (vLLM <= 0.32 refuses it for hidden-state "
                                               "extraction)."),
    data_parallel_size: int = typer.Option(1, "--data-parallel-size", help="With --engine vllm: independent vLLM "
                                           "engines sharing each window."),
) -> None:
    """Run the frozen target once over conversations; write taps + teacher rows as a dataset (resumable)."""
    from pathlib import Path

    from tapdraft.capture.config import CaptureConfig
    from tapdraft.capture.pipeline import capture as run_capture
    from tapdraft.capture.pipeline import summary
    from tapdraft.common.template import parse_template_kwargs
    from tapdraft.shards.shard_file import ShardConfig

    _threads(threads)
    pairs = []
    for d in data:
        split, sep, spec = d.partition("=")
        split, spec = (split, spec) if sep and not Path(d).exists() else ("train", d)
        pairs.append((split, str(Path(spec).resolve()) if Path(spec).exists() else spec))
    cfg = CaptureConfig(
        target=str(Path(target).resolve()), out=out, stage=stage, data=tuple(pairs), max_samples=max_samples,
        max_length=max_length,
        shard=ShardConfig(format=format, shard_bytes=shard_bytes, zstd_level=zstd_level, bf16_layout=bf16_layout,
                          writers=_writers(writers)),
        top_k=top_k, taps=None if taps is None else tuple(int(t) for t in taps.split(",") if t.strip()),
        draft_layers=draft_layers, dtype=dtype, codec=codec, on_error=on_error, final_hidden=final_hidden,
        allow_outside_paths=allow_outside_paths, audio_embeds=audio_embeds, batch_tokens=batch_tokens, device=device,
        responses_from_target=responses_from_target,
        llm_config=None if llm_config is None else str(Path(llm_config).resolve()),
        chat_template=None if chat_template is None else str(Path(chat_template).resolve()),
        template_kwargs=tuple(parse_template_kwargs(template_kwarg).items()),
        replies=_reply_config(max_new_tokens, temperature, top_p, seed, last_turn_only, on_limit)
        if regenerate else None, fused=not two_pass, engine=engine,
        vllm=engine_settings(engine, tensor_parallel_size=tensor_parallel_size,
                             pipeline_parallel_size=pipeline_parallel_size, data_parallel_size=data_parallel_size),
        vllm_python=None if vllm_python is None else str(Path(vllm_python).absolute()),
    )
    typer.echo(summary(run_capture(cfg, restart=restart)))


@app.command()
def verify(
    dataset: str = typer.Argument(..., help="Dataset directory or fsspec URL."),
    quick: bool = typer.Option(False, "--quick", help="Sizes and sha256 only; skip decoding every sample."),
) -> None:
    """Check manifest, bundle, every shard's sha256, schema and counts; exit 0 only when all hold."""
    from tapdraft.shards.verify import verify_dataset

    rep = verify_dataset(dataset, deep=not quick)
    for p in rep.problems:
        typer.echo(f"PROBLEM {p}", err=True)
    typer.echo(f"{rep.path}: {rep.shards_checked} shards, {rep.samples_checked} samples, {rep.bytes_checked} bytes "
               f"checked; {len(rep.problems)} problem(s)" + ("" if rep.problems else ", OK"))
    raise typer.Exit(0 if rep.ok else 1)


@app.command()
def inspect(
    dataset: str = typer.Argument(..., help="Dataset directory or fsspec URL."),
    sample: int = typer.Option(None, "--sample", help="Also show this sample's fields and shapes."),
    split: str = typer.Option("train", help="Split for --sample."),
) -> None:
    """One screen about a dataset: splits, counts, taps, dtypes and codecs, size, fingerprint."""
    from tapdraft.shards.inspect import describe_sample, render_summary, summary
    from tapdraft.shards.reader import open_dataset

    ds = open_dataset(dataset)
    typer.echo(render_summary(summary(ds)))
    if sample is not None:
        typer.echo(f"\n{split}[{sample}]\n" + describe_sample(ds.sample(split, sample)))


@app.command()
def push(
    dataset: str = typer.Argument(..., help="Finished local dataset directory."),
    url: str = typer.Argument(..., help="Destination: any fsspec URL (s3://bucket/prefix, gs://...). Credentials and "
                              "endpoint as the store's own tools read them (AWS_* variables, ~/.aws/config)."),
) -> None:
    """Upload a dataset: shards and bundle first (resumable multipart, each object verified), manifest.json last."""
    from tapdraft.shards.transfer import push as run_push

    with _kept_on_interrupt("push", f"what was sent to {url} is kept and its manifest.json, written last, is not "
                            "yet new; rerun the same command to resume"):
        st = run_push(dataset, url)
    typer.echo(f"{url}: up to date ({st['files']} files)" if st["up_to_date"] else
               f"{url}: {st['uploaded']} uploaded ({st['bytes_sent']} bytes), {st['copied']} copied on the store, "
               f"{st['skipped']} already there; manifest written last")


@app.command()
def pull(
    url: str = typer.Argument(..., help="A dataset at any fsspec URL (s3://bucket/prefix, ...)."),
    dest: str = typer.Argument(..., help="Local directory (created; a partial pull there is resumed)."),
) -> None:
    """Download a dataset (resumable), verify every shard's sha256 and the bundle, write manifest.json last."""
    from tapdraft.shards.transfer import pull as run_pull

    with _kept_on_interrupt("pull", f"the files downloaded into {dest} are kept (manifest.json is written last); "
                            "rerun the same command to resume"):
        st = run_pull(url, dest)
    typer.echo(f"{dest}: up to date ({st['files']} files)" if st["up_to_date"] else
               f"{dest}: {st['downloaded']} downloaded ({st['bytes_received']} bytes), {st['skipped']} already there; "
               "verified, manifest written last")


@app.command()
def derive(
    src: str = typer.Argument(..., help="Finished source dataset (directory or fsspec URL)."),
    out: str = typer.Option(..., "--out", help="New dataset directory (resumed when rerun with the same settings)."),
    add: list[str] = typer.Option([], "--add", help="Another finished dataset of the same target whose samples follow "
                                  "SRC's, split by split (repeat for more): broad data and your own traffic in one "
                                  "training set. A conversation in both is kept once."),
    taps: str = typer.Option(None, "--taps", help="Comma-separated HF tap ids to keep (default: all)."),
    codec: str = typer.Option(None, "--codec", help=f"Taps codec: {codec_help()} (default: the source's)."),
    splits: str = typer.Option(None, "--splits", help="Comma-separated splits to keep (default: all)."),
    max_samples: int = typer.Option(None, "--max-samples",
                                    help="At most N samples per split, the first in file order."),
    top_k: int = typer.Option(None, "--top-k",
                              help="Teacher top-k to keep, at most the source's (0: drop teacher rows)."),
    zstd_level: int = typer.Option(None, "--zstd-level", help="Recompress the shards at this zstd level (0: "
                                   "uncompressed; default: the source's)."),
    bf16_layout: str = typer.Option(None, "--bf16-layout", help="planes | raw | split (default: the source's)."),
    writers: int = typer.Option(1, "--writers", help="Writer threads, each compressing its own shards."),
) -> None:
    """Write a lighter dataset from a finished one (no target needed): fewer taps, fp8, fewer splits or samples,
    a smaller top-k, other compression, or several datasets of one target joined (--add); the bundle is copied and
    the lineage recorded in the manifest."""
    from tapdraft.shards.derive import DeriveConfig, derive_dataset
    from tapdraft.shards.inspect import render_summary, summary
    from tapdraft.shards.reader import open_dataset

    def _list(v: str | None) -> tuple[str, ...] | None:
        return None if v is None else tuple(x.strip() for x in v.split(",") if x.strip())

    try:
        tap_ids = None if taps is None else tuple(int(t) for t in _list(taps))
    except ValueError:
        raise ValueError(f"--taps {taps!r}: give comma-separated integer tap ids, e.g. 1,9,17") from None
    cfg = DeriveConfig(src=src, out=out, taps=tap_ids, codec=codec, splits=_list(splits), max_samples=max_samples,
                       top_k=top_k, zstd_level=zstd_level, bf16_layout=bf16_layout, writers=writers,
                       add=tuple(add))
    with _kept_on_interrupt("derive", f"the finished shards in {out} are kept; rerun the same command to resume"):
        derive_dataset(cfg)
    typer.echo(render_summary(summary(open_dataset(out))))


@app.command()
def train(
    data: str = typer.Option(None, "--data", help="Dataset directory or fsspec URL (required to train)."),
    out: str = typer.Option(None, "--out", help="Run directory, resumed from its latest checkpoint (required to "
                            "train)."),
    recipe: str = typer.Option("dflash", "--recipe", help="Recipe name (see --list-recipes) or a YAML path."),
    config: str = typer.Option(None, "--config", help="YAML file merged over the recipe (family/drafter/train)."),
    set_: list[str] = typer.Option([], "--set", help="Override one field: key=value (e.g. max_steps=100, "
                                   "drafter.gamma=4, eval_every=50); --show-recipe lists every key. Repeatable."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON instead of text."),
    threads: int = typer.Option(0, "--threads", help=THREADS_HELP),
    list_recipes: bool = typer.Option(False, "--list-recipes", help="List the recipes (name, family, what) and exit."),
    show_recipe: str = typer.Option(None, "--show-recipe", help="Print recipe NAME resolved with every default (the "
                                    "keys --set takes) and exit."),
) -> None:
    """Train a drafter from a dataset (Ctrl-C saves a checkpoint; rerun to resume); config in RUN/config.json."""
    import json

    from tapdraft.train.config import load_run_config
    from tapdraft.train.loop import train as run_training
    from tapdraft.train.run import format_summary

    if list_recipes or show_recipe:
        from tapdraft.train import config as recipes

        rows = recipes.list_recipes()
        width = max(len(n) for n, _, _ in rows)
        typer.echo(recipes.show_recipe(show_recipe) if show_recipe else
                   "\n".join(f"{n:<{width}}  {fam:<8} {what}" for n, fam, what in rows))
        return
    for name, value in (("--data", data), ("--out", out)):
        if value is None:
            raise typer.BadParameter(f"{name} is required (or give --list-recipes / --show-recipe NAME)")
    _threads(threads)
    run = load_run_config(recipe, config_file=config, overrides=set_)
    summary = run_training(run, data, out)
    typer.echo(json.dumps(summary, indent=2) if json_out else format_summary(summary))


@app.command("eval")
def eval_(
    draft: str = typer.Option(..., "--draft", help="Run directory written by `tapdraft train`."),
    data: str = typer.Option(..., "--data", help="Dataset directory or fsspec URL (same target)."),
    split: str = typer.Option(None, "--split", help="Split to evaluate (default: validation or test if present, "
                              "else the training split)."),
    out: str = typer.Option(None, "--out", help="Where eval.json and acceptance.png go (default RUN/eval-SPLIT)."),
    max_samples: int = typer.Option(None, "--max-samples", help="Evaluate at most this many samples."),
    temperature: float = typer.Option(1.0, "--temperature", help="Also measure speculative sampling at this "
                                      "temperature (sum_v min(p, q) against the exact target rows); 0 = greedy only."),
    chat_template: str = typer.Option(None, "--chat-template", help="Jinja file the drafter will be served with: a "
                                      "dataset captured with another template is refused."),
    template_kwarg: list[str] = typer.Option([], "--template-kwarg", help="Chat-template variable key=value the "
                                             "drafter will be served with (repeatable); a dataset captured with "
                                             "other kwargs is refused."),
    round_cost: float = typer.Option(None, "--round-cost", help="The serving engine's cost of a round (draft + "
                                     "verify) over a plain decode step, e.g. measured on vLLM: eval says whether tau "
                                     "clears it (default: the expected speedup at a few costs)."),
    sampled_rows: int = typer.Option(None, "--sampled-rows", help="Rows at draft position 1 the sampled "
                                     "acceptance measures, then it stops (default 2048; 0: every row)."),
    threads: int = typer.Option(0, "--threads", help=THREADS_HELP),
) -> None:
    """Offline teacher-forced acceptance per block position and tau (greedy and sampled), with a PNG plot, and
    whether tau clears the engine's round cost (--round-cost)."""
    from tapdraft.common.template import parse_template_kwargs, read_template_file
    from tapdraft.train.evaluate import evaluate, format_result

    _threads(threads)
    template = None if chat_template is None else read_template_file(chat_template)
    kwargs = parse_template_kwargs(template_kwarg) if template_kwarg else None
    typer.echo(format_result(evaluate(draft, data, split=split, out_dir=out, max_samples=max_samples,
                                      template=template, template_kwargs=kwargs, temperature=temperature,
                                      round_cost=round_cost, sampled_rows=sampled_rows)))


@app.command()
def speculate(
    target: str = typer.Option(..., "--target", help="The target model directory the dataset was captured from."),
    llm_config: str = typer.Option(None, "--llm-config", help=LLM_CONFIG_HELP),
    draft: str = typer.Option(..., "--draft", help="Run directory written by `tapdraft train` (its latest "
                              "checkpoint is used)."),
    data: str = typer.Option(..., "--data", help="The dataset the draft was trained on (bundle and tap layout)."),
    conversations: str = typer.Option(..., "--conversations", help=f"Conversations to take prompts from ({INPUTS}); "
                                      "the last assistant reply is regenerated."),
    max_samples: int = typer.Option(32, "--max-samples", help="Conversations to decode."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens to generate per conversation at most."),
    drafts: int = typer.Option(None, "--drafts", help="Drafts a round, fewer than the draft was trained for, as an "
                               "engine serving its export at num_speculative_tokens=N drafts them (MTP, EAGLE-3, "
                               "DFlash); default: the trained number."),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy (output must equal the target's own); "
                                      "> 0: rejection sampling."),
    seed: int = typer.Option(0, "--seed", help="Seed for sampling."),
    device: str = typer.Option("auto", "--device", help=f"{DEVICE_HELP}, for the target and the drafter."),
    chat_template: str = typer.Option(None, "--chat-template", help="Jinja file replacing the target's chat template "
                                      "(must be the one the dataset was captured with)."),
    template_kwarg: list[str] = typer.Option([], "--template-kwarg", help="Chat-template variable key=value "
                                             "(repeatable; must equal the capture's)."),
    json_path: str = typer.Option(None, "--json", help="Also write the report, round by round per conversation, "
                                  "as JSON here (schema: docs/speedup.md)."),
    cost_steps: int = typer.Option(8, "--cost-steps", help="Plain decode steps timed per conversation for the round "
                                   "cost when the greedy check does not run (it times all of its own)."),
    threads: int = typer.Option(0, "--threads", help=THREADS_HELP),
) -> None:
    """Real speculative decoding with the live target: tau (tokens per target forward) vs the offline estimate, and
    the break-even tau at the round cost measured here."""
    from tapdraft.common.template import parse_template_kwargs
    from tapdraft.speculate.run import SpeculateConfig, format_result, run_speculate

    _threads(threads)
    cfg = SpeculateConfig(target=target, draft=draft, data=data, conversations=conversations, max_samples=max_samples,
                          max_new_tokens=max_new_tokens, drafts=drafts, temperature=temperature, seed=seed,
                          device=device, llm_config=llm_config, chat_template=chat_template,
                          template_kwargs=tuple(parse_template_kwargs(template_kwarg).items()),
                          cost_steps=cost_steps, json_path=json_path)
    typer.echo(format_result(run_speculate(cfg)))


def _layout_help() -> str:
    """``export --layout``'s help, from each family's declared layouts (families with the same list share an entry)."""
    from tapdraft.train.drafters import export_layouts

    groups: dict[tuple[tuple[str, ...], str | None], list[str]] = {}
    for family, key in export_layouts().items():
        if key[0]:
            groups.setdefault(key, []).append(family)
    entries = [", ".join(families) + ": " + (" | ".join(f"{n} (default)" if n == default else n for n in names)
                                             if default else "native (default) | " + " | ".join(names))
               for (names, default), families in groups.items()]
    return ("The loader the export is for; the other families have one layout. " + "; ".join(entries)
            + ". docs/engines.md says which engine loads which.")


@app.command()
def export(
    draft: str = typer.Option(..., "--draft", help="Run directory written by `tapdraft train`."),
    out: str = typer.Option(..., "--out", help="Export directory (model.safetensors + config.json)."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON instead of text."),
    layout: str = typer.Option(None, "--layout", help=_layout_help()),
    verifier: str = typer.Option(None, "--verifier", help="--layout speculators: the target's hub id or directory "
                                 "name, as the format records it (speculators_config.verifier)."),
    checkpoint: str = typer.Option(None, "--checkpoint", help="A checkpoint directory of the run "
                                   "(RUN/checkpoints/step-N) instead of its latest."),
    data: str = typer.Option(None, "--data", help="A dataset of the draft's target: needed only by a draft with a "
                             "draft vocabulary, whose export carries those frozen lm_head rows for vLLM."),
) -> None:
    """Export the draft only (no target weights) in the layout serving engines load."""
    import json

    from tapdraft.train.export import export_run, format_export

    with _kept_on_interrupt("export", f"{out} is as it was (an export is committed whole or not at all); rerun the "
                            "same command"):
        res = export_run(draft, out, checkpoint=checkpoint, layout=layout, verifier=verifier, data=data)
    typer.echo(json.dumps(res, indent=2) if json_out else format_export(res))


@app.command()
def venv(engine: str = typer.Argument(..., help="The engine: vllm (the CPU build), vllm_gpu, modelopt.")) -> None:
    """Build (once, from the pins this version ships) or reuse a serving engine's own venv and print its path, for
    --vllm-python and the like. The venvs live under ~/.cache/tapdraft/engines."""
    from tapdraft.engines.serving import engine_venv

    typer.echo(str(engine_venv(engine)))


@app.command()
def demo(
    workdir: str = typer.Option(None, "--workdir", help="Directory for the demo's target, data, dataset and "
                                "runs, reused by later runs (default demo_work; with --real, demo_real or "
                                "demo_real_quick)."),
    quick: bool = typer.Option(False, "--quick", help="A seconds-long miniature (smoke test; its numbers mean "
                               "nothing). With --real: the real chain's quick size, a general drafter for the speech "
                               "LLM's language model alone (SmolLM2, its replies to 100 ShareGPT conversations, served "
                               "on conversations it never saw)."),
    real: bool = typer.Option(False, "--real", help="A real-parts speech LLM instead of the toy (Whisper tiny.en's "
                              "encoder + SmolLM2-135M-Instruct from PyPI, aligned to answer spoken requests): its own "
                              "replies of up to 128 tokens, capture, an EAGLE-3 drafter, then vLLM serving held-out "
                              "spoken requests with and without it. About 1 h 45 min on 2 cores the first time, "
                              "47 minutes with the speech LLM cached (measured: 2.02x); every stage is cached in "
                              "--workdir."),
) -> None:
    """The whole chain on a built-in task: train a small speech LLM, capture it, train a DFlash drafter, print tau.

    With --real: the same chain on a speech LLM built from real trained parts, ending in vLLM (its venv is built
    on first use) with both speeds printed; --real --quick: a general drafter for its language model alone, in
    minutes."""
    if real:
        from tapdraft.demo.real.speedup import DEMO_SIZES, format_serve, run_speedup

        size = "quick" if quick else "full"
        report = run_speedup(workdir or f"demo_real{'_quick' * quick}", DEMO_SIZES[size], log=typer.echo)
        typer.echo(format_serve(report))
        return
    from tapdraft.demo.run import format_demo, run_demo

    typer.echo(format_demo(run_demo(workdir or "demo_work", quick=quick)))


_ROOT = Path(__file__).parent
"""The tapdraft package as imported (its links unresolved): a file under it is tapdraft's own."""
_PYTHON_FORMAT = warnings.formatwarning


def _format_warning(message, category, filename, lineno, line=None) -> str:  # noqa: ANN001 (warnings' signature)
    """tapdraft's own warnings read as one ``warning:`` line (with --debug, or from a library: Python's format)."""
    if not _RUN["debug"] and Path(filename).is_relative_to(_ROOT):
        return f"warning: {message}\n"
    return _PYTHON_FORMAT(message, category, filename, lineno, line)


_TAGS = {"str": "TEXT", "int": "INTEGER", "float": "FLOAT"}


def _tagged(command):  # noqa: ANN001, ANN202 (click's types)
    """The click command with plain value tags in its help: none on flags (typer prints ``<bool>``) and click's
    own names (TEXT, INTEGER, FLOAT) on values, never ``<list[str]>``."""
    for cmd in [command, *getattr(command, "commands", {}).values()]:
        for p in cmd.params:
            kind = p.bare_type().removeprefix("list[").removesuffix("]")
            tag = "" if getattr(p, "is_flag", False) else _TAGS.get(kind, kind.upper())
            if hasattr(p, "is_flag") and p.metavar is None:  # an option (typer vendors its own click)
                p.metavar = tag
            elif not hasattr(p, "is_flag"):  # an argument: its metavar is its name, so only the type column changes
                p.display_type_rich = lambda ctx, tag=tag: tag  # noqa: ANN001
        cmd.get_help_option = _untagged_help(cmd.get_help_option)
    return command


def _untagged_help(get_help_option):  # noqa: ANN001, ANN202
    def get(ctx):  # noqa: ANN001, ANN202
        opt = get_help_option(ctx)
        if opt is not None and opt.metavar is None:
            opt.metavar = ""
        return opt

    return get


def main(argv: list[str] | None = None) -> None:
    """Console entry point: an error a user can act on is one ``error:`` line and its documented exit code;
    a warning of tapdraft's own is one ``warning:`` line. The same holds for such an error in a library's
    thread (TensorBoard writes its event files from one, then raises the error again in the caller): one line,
    not the thread's traceback and then the line."""
    from tapdraft.common.errors import EXIT_INTERRUPTED, classify

    _RUN["debug"], _RUN["signal"] = False, ""
    warnings.formatwarning = _format_warning
    said: set[str] = set()
    thread_hook = threading.excepthook

    def one_line(args: threading.ExceptHookArgs) -> None:
        verdict = classify(args.exc_value) if args.exc_value is not None else None
        if verdict is None or _RUN["debug"]:
            thread_hook(args)
        elif verdict[1] not in said:
            said.add(verdict[1])
            typer.echo(f"error: {verdict[1]}", err=True)

    def terminate(signum: int, frame: object) -> None:  # SIGTERM stops a command as Ctrl-C does (train: its own)
        _RUN["signal"] = signal.Signals(signum).name
        raise KeyboardInterrupt

    threading.excepthook = one_line
    main_thread = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, terminate) if main_thread else None
    try:
        _tagged(typer.main.get_command(app))(args=argv, prog_name="tapdraft")
    except Exception as e:  # SystemExit and KeyboardInterrupt pass (typer turns Ctrl-C into exit 130)
        verdict = classify(e)
        if verdict is None:
            raise
        if _RUN["debug"]:
            traceback.print_exc()
        sys.stdout.flush()
        label = "interrupted" if verdict[0] == EXIT_INTERRUPTED else "error"  # a stop the user asked for is no error
        if verdict[1] not in said:
            said.add(verdict[1])
            typer.echo(f"{label}: {verdict[1]}", err=True)
        raise SystemExit(verdict[0]) from None
    finally:
        threading.excepthook = thread_hook
        if main_thread:
            signal.signal(signal.SIGTERM, old_term if old_term is not None else signal.SIG_DFL)


if __name__ == "__main__":
    main()
