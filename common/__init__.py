"""What every package shares, below all of them: the project's error types and exit codes (``errors``), progress of
long work (``progress``), atomic writes (``atomic``), locks on output directories (``lock``) and the chat-template
settings a dataset is captured with (``template``).

Standard library (and fsspec for remote writes) only: it imports no other package of the project and no model code,
so shards/, capture/, train/ and the rest can all import it.
"""
