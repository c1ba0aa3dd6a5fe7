"""``turnkv sim``: a vLLM stand-in as a real HTTP server (prefill, decode or colocated) that speaks vLLM's P/D
protocol of 0.26 or 0.33 and makes a wrong KV reuse visible in its answers; the real-process test tier."""
