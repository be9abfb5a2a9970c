"""``python -m tapdraft``: the ``tapdraft`` command."""

from tapdraft.cli import main

if __name__ == "__main__":
    main()
