"""tapdraft's command line: each command builds a typed config, calls one function, prints a summary."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="tapdraft",
    help="Capture a speech LLM's hidden states into shareable shards and train speculative-decoding drafters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def inspect(
    dataset: str = typer.Argument(..., help="Dataset directory or fsspec URL."),
    sample: int = typer.Option(None, "--sample", help="Also show this sample's fields and shapes."),
    split: str = typer.Option("train", help="Split for --sample."),
) -> None:
    """One screen about a dataset: splits, counts, taps, dtypes and codecs, size, fingerprint."""
    from shards.inspect import describe_sample, render_summary, summary
    from shards.reader import open_dataset

    ds = open_dataset(dataset)
    typer.echo(render_summary(summary(ds)))
    if sample is not None:
        s = ds.sample(split, sample) if ds.format == "arrow" else next(
            x for i, x in enumerate(ds.stream(split, seed=0, shuffle=False)) if i == sample)
        typer.echo(f"\n{split}[{sample}]\n" + describe_sample(s))


@app.command()
def verify(
    dataset: str = typer.Argument(..., help="Dataset directory or fsspec URL."),
    quick: bool = typer.Option(False, "--quick", help="Sizes and sha256 only; skip decoding every sample."),
) -> None:
    """Check manifest, bundle, every shard's sha256, schema and counts; exit 0 only when all hold."""
    from shards.verify import verify_dataset

    rep = verify_dataset(dataset, deep=not quick)
    for p in rep.problems:
        typer.echo(f"PROBLEM {p}", err=True)
    typer.echo(f"{rep.path}: {rep.shards_checked} shards, {rep.samples_checked} samples, {rep.bytes_checked} bytes "
               f"checked; {len(rep.problems)} problem(s)" + ("" if rep.problems else ", OK"))
    raise typer.Exit(0 if rep.ok else 1)


@app.command()
def train(
    data: str = typer.Option(..., "--data", help="Dataset directory or fsspec URL."),
    recipe: str = typer.Option("dflash", "--recipe", help="Recipe name in train/recipes (dflash, dflash_b8, ...) or a YAML path."),
    config: str = typer.Option(None, "--config", help="YAML file merged over the recipe (family/drafter/train)."),
    set_: list[str] = typer.Option([], "--set", help="Override one field: key=value (e.g. max_steps=100, drafter.gamma=4)."),
    out: str = typer.Option(..., "--out", help="Run directory (resumes from its latest checkpoint)."),
) -> None:
    """Train a drafter from a dataset; the resolved config is saved as RUN/config.json."""
    import json

    from train.config import load_run_config
    from train.loop import train as run_training

    run = load_run_config(recipe, config_file=config, overrides=set_)
    summary = run_training(run, data, out)
    typer.echo(json.dumps(summary, indent=2))


@app.command("eval")
def eval_(
    draft: str = typer.Option(..., "--draft", help="Run directory written by `tapdraft train`."),
    data: str = typer.Option(..., "--data", help="Dataset directory or fsspec URL (same target)."),
    split: str = typer.Option(None, "--split", help="Split to evaluate (default: validation/test if present, else the training split)."),
    out: str = typer.Option(None, "--out", help="Where eval.json and acceptance.png go (default RUN/eval-SPLIT)."),
    max_samples: int = typer.Option(None, "--max-samples", help="Evaluate at most this many samples."),
) -> None:
    """Offline teacher-forced acceptance per block position and tau, with a PNG plot beside the JSON."""
    from train.evaluate import evaluate, format_result

    typer.echo(format_result(evaluate(draft, data, split=split, out_dir=out, max_samples=max_samples)))


@app.command()
def export(
    draft: str = typer.Option(..., "--draft", help="Run directory written by `tapdraft train`."),
    out: str = typer.Option(..., "--out", help="Export directory (model.safetensors + config.json)."),
) -> None:
    """Export the draft only (no target weights) in the layout serving engines load."""
    import json

    from train.export import export_run

    typer.echo(json.dumps(export_run(draft, out), indent=2))


if __name__ == "__main__":
    app()
