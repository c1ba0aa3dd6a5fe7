"""turnkv."""
