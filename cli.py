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


if __name__ == "__main__":
    app()
