"""What turnkv remembers between turns: conversation records (``record``) in a store whose contract
(``base``) has three parts, records, the pin index and documents; ``memory`` and ``redis`` implement each,
and ``guard`` keeps a failing store off the request path."""
