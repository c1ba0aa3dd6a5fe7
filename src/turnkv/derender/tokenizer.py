"""A model's tokenizer in the router's process, for incremental derender text that costs the render service nothing.

``load_decode`` reads a Hugging Face ``tokenizer.json`` (the file in the model folder the render service
serves) with the ``tokenizers`` package (``pip install 'turnkv[tokenizer]'``) and returns its decode
function, special tokens kept (the reasoning and tool parsers read them, and turnkv reads them as they do).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path


class TokenizerUnavailable(RuntimeError):
    """The tokenizer file cannot be read, or the ``tokenizers`` package is not installed."""


def load_decode(path: str | Path) -> Callable[[Sequence[int]], str]:
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise TokenizerUnavailable("a tokenizer.json needs the tokenizers package: pip install tokenizers") from exc
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as exc:  # the package's own error types are not public
        raise TokenizerUnavailable(f"cannot read the tokenizer {p}: {exc}") from exc

    def decode(ids: Sequence[int]) -> str:
        return str(tok.decode(list(ids), skip_special_tokens=False))

    return decode
