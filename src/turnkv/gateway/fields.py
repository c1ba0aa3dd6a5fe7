"""Which fields of a client's request reach the engines: an allow-list, applied before any engine call.

Every top-level field of a chat or completions body is one of:

* forwarded: OpenAI's fields and vLLM's documented sampling, structured-output and template fields
  (their types are checked in ``requests``);
* read by the gateway and not forwarded: the conversation's id (``session_id``, ``conversation_id``,
  ``prompt_cache_key``, ``metadata``: ``identity``);
* dropped: OpenAI fields that do not change what an engine computes and that OpenAI clients send as a matter
  of course (``store``, ``service_tier``...);
* refused unless ``engine_fields`` lists it: fields that steer a shared engine for everyone rather than
  shape one answer (``priority`` jumps the queue under priority scheduling, ``vllm_xargs`` can carry
  ``kv_transfer_params``, ``request_id`` names the engine's own request), and OpenAI features an engine
  cannot serve (audio, web search, the deprecated ``functions``), so a client never gets a silently
  different answer;
* anything else: refused with OpenAI's own words, ``Unrecognized request argument supplied: <name>``.

A refused field is named in the error's ``param``; names and values a client chose are shown cut to
``SHOWN_CHARS`` characters, never whole.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from turnkv.errors import ClientError

if TYPE_CHECKING:
    from turnkv.config import Settings

SHOWN_CHARS = 64

# OpenAI's chat and completions fields, and vLLM's documented extensions of both
_COMMON = frozenset(
    {
        "model",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "max_tokens",
        "n",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "user",
        "response_format",
        # vLLM sampling parameters
        "use_beam_search",
        "top_k",
        "min_p",
        "repetition_penalty",
        "length_penalty",
        "stop_token_ids",
        "include_stop_str_in_output",
        "ignore_eos",
        "min_tokens",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "truncate_prompt_tokens",
        "prompt_logprobs",
        "allowed_token_ids",
        "bad_words",
        # vLLM structured outputs (and the guided_* fields of the releases before them)
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
        # vLLM output shape
        "return_tokens_as_token_ids",
        "return_token_ids",
        "add_special_tokens",
        "cache_salt",  # replaced by the tenant's own salt (``auth.cache_salt``), which it goes into
    }
)
CHAT = _COMMON | {
    "messages",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning_effort",
    "include_reasoning",
    "thinking_token_budget",
    "echo",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "media_io_kwargs",
}
COMPLETIONS = _COMMON | {"prompt", "best_of", "echo", "suffix", "prompt_embeds"}
GATEWAY = frozenset({"session_id", "conversation_id", "prompt_cache_key", "metadata"})
DROPPED = frozenset(
    {"store", "service_tier", "safety_identifier", "prompt_cache_retention", "verbosity", "prediction", "modalities"}
)
ENGINE_PRIVATE = {
    "priority": "it orders the engines' shared queue (priority scheduling)",
    "request_id": "it names the engines' own request; the gateway sends X-Request-Id",
    "vllm_xargs": "it passes arguments to engine extensions, kv_transfer_params among them",
    "kv_transfer_params": "it is set by turnkv, not by clients",
    "ec_transfer_params": "it is set by the serving system, not by clients",
    "logits_processors": "it loads code into the engines",
}
UNSERVED = {
    "audio": "audio output is not supported",
    "web_search_options": "web search is not supported",
    "functions": "functions is deprecated and not supported: use tools",
    "function_call": "function_call is deprecated and not supported: use tool_choice",
}


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """A name or value a client chose, as an error message may quote it: at most ``limit`` characters."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _refuse(name: str, why: str) -> ClientError:
    return ClientError(f"{shown(name)}: {why}", param=shown(name))


def engine_fields(settings: Settings) -> frozenset[str]:
    """The fields the operator lets clients send beyond the list: ``engine_fields``, and
    ``kv_transfer_params`` with ``allow_client_kv_transfer_params``."""
    extra = frozenset(settings.engine_fields)
    return extra | {"kv_transfer_params"} if settings.allow_client_kv_transfer_params else extra


def engine_body(body: Mapping[str, Any], *, chat: bool, allowed: Collection[str] = ()) -> dict[str, Any]:
    """The fields of ``body`` the engines get (types are checked separately, ``requests.validate``);
    raises ``ClientError`` naming the first field that may not reach them. ``allowed``: the fields the
    operator lets through beyond the list (``engine_fields``)."""
    known = CHAT if chat else COMPLETIONS
    out: dict[str, Any] = {}
    for name, value in body.items():
        if name in known or name in allowed:
            out[name] = value
        elif name in GATEWAY or name in DROPPED:
            continue
        elif name in ENGINE_PRIVATE:
            raise _refuse(name, f"not accepted from clients: {ENGINE_PRIVATE[name]}")
        elif name in UNSERVED:
            raise _refuse(name, UNSERVED[name])
        else:
            raise ClientError(f"Unrecognized request argument supplied: {shown(name)}", param=shown(name))
    if "modalities" in body and body["modalities"] not in (None, ["text"]):
        raise ClientError("modalities: only text output is supported", param="modalities")
    return out
