"""turnkv: an OpenAI-compatible gateway for prefill/decode disaggregated serving that reuses a conversation's
decode KV when, and only when, the new prompt's tokens extend it (docs/architecture.md)."""
