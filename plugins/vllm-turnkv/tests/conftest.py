"""Make ``vllm_turnkv`` importable from the source tree, whichever directory pytest starts in."""

import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")
if SRC not in sys.path:
    sys.path.insert(0, SRC)
