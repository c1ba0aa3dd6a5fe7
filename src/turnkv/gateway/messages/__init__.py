"""Anthropic's Messages API (``/v1/messages``) on the gateway, translated onto chat completions.

The API coding agents speak (Claude Code, the ``anthropic`` SDKs). Like the Responses API
(``gateway.responses``), a request is translated into a chat completions request (``translate``) and
comes in the one way every front end does (``intake``): it runs through the same turn pipeline (render,
token check, P/D, capture), so a multi-turn conversation reuses D's KV exactly as on chat, found by
``X-Session-ID`` or from its history, with the same decision headers. The chat answer becomes a Message
(JSON) or Anthropic's stream events (``events``). Errors take Anthropic's shape on these paths
(``error_responses.shape_of``), so the SDK raises its own typed exceptions.

Thinking blocks are the model's reasoning (a reasoning parser's output): sent back, they are the
assistant message's reasoning, which is what keeps the history token-identical to what D computed.
``POST /v1/messages/count_tokens`` renders the same translation and counts its tokens.
"""
