"""``python -m turnkv``: the same as the ``turnkv`` command."""

from turnkv.cli import main

raise SystemExit(main())
