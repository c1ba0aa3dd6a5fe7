"""``python -m vllm_turnkv serve ARGS``: ``vllm serve ARGS`` with the plugin registered first.

The path for environments where the entry point cannot be installed (the package is only on
``PYTHONPATH``). Registering in this, the API server process, is enough: the engine processes
need no patch.
"""

from __future__ import annotations

import sys


def main() -> None:
    import vllm_turnkv

    vllm_turnkv.register()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
