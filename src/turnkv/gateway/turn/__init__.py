"""One chat turn as a sequence of steps (render, plan, prefill, decode, relay, capture), each a function
that returns its result as a frozen value (``results``); ``driver.run_turn`` runs them for any front end."""
