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


if __name__ == "__main__":
    app()
