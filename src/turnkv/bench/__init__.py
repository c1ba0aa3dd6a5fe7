"""``turnkv bench``: a multi-turn load generator, the simulator scenarios, and their reports."""
