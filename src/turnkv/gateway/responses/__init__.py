"""OpenAI's Responses API (``/v1/responses``) on the gateway, translated onto chat completions.

Why translate instead of forwarding to vLLM's own ``/v1/responses``: everything turnkv decides is
built on chat completions. vLLM's P/D connector protocol (P runs a 1-token prefill and hands D its
``kv_transfer_params``) is driven through ``/v1/chat/completions`` on both engines; the token check
needs the prompt's exact ids, which ``/v1/chat/completions/render`` gives (there is no render for
responses); capture reads D's prompt and generated ids from ``return_token_ids`` on chat chunks; and
vLLM 0.26's responses path differs from 0.33's (and neither streams D's handle). So a Responses
request becomes a chat request (``translate``), runs through the SAME turn pipeline as any chat turn
(``gateway/turn``: render, plan, prefill, decode, capture: reuse and checks apply unchanged), and
its chat answer becomes a Response object or the Responses stream events (``events``).

The gateway keeps the responses it creates (``store``, on by default, as OpenAI does) in the
conversation store, tenant-scoped, with a TTL: the history as chat messages, the Response object
and the store key of its conversation record, so ``previous_response_id`` continues the
conversation and finds its KV, and ``GET /v1/responses/{id}`` answers.
"""
