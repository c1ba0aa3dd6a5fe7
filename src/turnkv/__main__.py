"""``python -m turnkv``: the same as the ``turnkv`` command."""

from turnkv.cli import main

if __name__ == "__main__":  # not when a spawned worker process imports it
    raise SystemExit(main())
