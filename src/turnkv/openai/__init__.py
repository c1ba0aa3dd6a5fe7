"""OpenAI's wire shapes, below both the gateway and the engines: server-sent events (``sse``) and a chat
answer with its digests (``answer``). Nothing here imports the rest of turnkv."""
