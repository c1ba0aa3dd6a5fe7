"""What turnkv remembers between turns: conversation records (``record``) in a store (``base`` is the
contract; ``memory`` and ``redis`` implement it; ``guard`` keeps a failing store off the request path)."""
