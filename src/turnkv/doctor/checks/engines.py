"""Reachability and roles: each engine as it describes itself, and whether P and D make a P/D pair
turnkv can reuse KV between (one model, a KV connector, bidirectional transfer on both, a tokenizer on
D, the handle on D's streams, the GPUs each computes on, the settings an engine keeps to itself)."""

from __future__ import annotations

from turnkv.doctor.checks import Context, Observed
from turnkv.doctor.checks.fmt import tokens
from turnkv.doctor.facts import EngineFacts, PullOutcome
from turnkv.doctor.findings import Finding, Item, Verdict
from turnkv.engine.diagnostics import Advice, EngineDescription


def check(obs: Observed, ctx: Context) -> list[Finding]:
    out = [_reachable(e) for e in obs.engines]
    up = [e for e in obs.engines if e.description is not None]
    if not up:
        return out
    out += _models(obs, ctx)
    out += _versions(up, ctx)
    out += _block_size(up, ctx)
    out += _connector(obs, ctx)
    out += _bidirectional(obs, ctx)
    out += [_tokenizer(e, ctx) for e in up]
    out += [_plugin(e) for e in obs.decode if e.description is not None]
    out.append(_gpus(obs, ctx))
    out += _side_channel(obs, ctx)
    out += _unexposed(up)
    return out


def _describe(d: EngineDescription) -> str:
    models = ", ".join(f"{m.name} (max {tokens(m.max_model_len)} tokens)" for m in d.models) or "no model listed"
    kv = (
        f"KV {tokens(d.capacity_tokens)} tokens ({tokens(d.num_blocks)} blocks of {d.block_size})"
        if d.capacity_tokens is not None
        else "KV capacity not said"
    )
    caching = {True: "prefix caching on", False: "prefix caching off", None: "prefix caching not said"}
    return f"version {d.version}, {models}, {kv}, {caching[d.prefix_caching]}"


def _reachable(e: EngineFacts) -> Finding:
    if e.description is None:
        return Finding(
            Item.REACHABLE,
            Verdict.FAIL,
            f"{e.role} engine {e.url} did not answer",
            fix="check the URL and that the engine is up (its /health answers 200)",
            engine=e.url,
        )
    return Finding(Item.REACHABLE, Verdict.OK, f"{e.role} {e.url}: {_describe(e.description)}", engine=e.url)


def _models(obs: Observed, ctx: Context) -> list[Finding]:
    ps = [e for e in obs.prefill if e.description is not None]
    ds = [e for e in obs.decode if e.description is not None]
    served = [e.models for e in (*ps, *ds)]
    common = frozenset.intersection(*served) if served else frozenset()
    out: list[Finding] = []
    if not common:
        listing = "; ".join(f"{e.role} {e.url}: {', '.join(sorted(e.models)) or 'none'}" for e in (*ps, *ds))
        out.append(
            Finding(
                Item.MODELS,
                Verdict.FAIL,
                f"the engines serve different models ({listing}): KV computed by one is meaningless to another",
                fix="serve one model (same weights, same --served-model-name) on every prefill and decode engine",
            )
        )
        return out
    missing = [m for m in ctx.settings.models if m not in common]
    if missing:
        out.append(
            Finding(
                Item.MODELS,
                Verdict.FAIL,
                f"the gateway's models setting names {', '.join(missing)}, which not every engine serves",
                fix=f"set models to what they serve: {', '.join(sorted(common))}",
            )
        )
    lens = {e.max_model_len for e in (*ps, *ds) if e.max_model_len}
    if len(lens) > 1:
        out.append(
            Finding(
                Item.MODELS,
                Verdict.WARN,
                f"the engines' max_model_len differ ({', '.join(tokens(n) for n in sorted(lens))}): a turn longer "
                "than the shortest fails on the engine that has it",
                fix="start every engine with the same --max-model-len",
            )
        )
    if not out:
        out.append(Finding(Item.MODELS, Verdict.OK, f"every engine serves {', '.join(sorted(common))}"))
    return out


def _versions(up: list[EngineFacts], ctx: Context) -> list[Finding]:
    versions = {e.description.version for e in up if e.description is not None}
    if len(versions) <= 1:
        return [Finding(Item.VERSIONS, Verdict.OK, f"every engine runs {next(iter(versions), '?')}")]
    return [
        Finding(
            Item.VERSIONS,
            Verdict.WARN,
            f"the engines run different versions ({', '.join(sorted(str(v) for v in versions))})",
            fix=ctx.advice(Advice.VERSIONS_DIFFER),
        )
    ]


def _block_size(up: list[EngineFacts], ctx: Context) -> list[Finding]:
    sizes = {e.description.block_size for e in up if e.description is not None and e.description.block_size}
    if not sizes:
        return [
            Finding(
                Item.BLOCK_SIZE,
                Verdict.WARN,
                f"no engine says its block size; the gateway assumes {ctx.settings.block_size}",
                fix="check each engine's --block-size against the gateway's block_size",
            )
        ]
    if len(sizes) > 1:
        return [
            Finding(
                Item.BLOCK_SIZE,
                Verdict.FAIL,
                f"the engines use different block sizes ({', '.join(str(s) for s in sorted(sizes))}): turnkv "
                "trims handles by one block size",
                fix="start every engine with the same --block-size",
            )
        ]
    (size,) = sizes
    if size != ctx.settings.block_size:
        return [
            Finding(
                Item.BLOCK_SIZE,
                Verdict.FAIL,
                f"the engines use blocks of {size} tokens, the gateway's block_size is {ctx.settings.block_size}: "
                "it would cut handles at the wrong tokens",
                fix=f"set block_size: {size} (TURNKV_BLOCK_SIZE={size})",
            )
        ]
    return [Finding(Item.BLOCK_SIZE, Verdict.OK, f"blocks of {size} tokens on every engine and in the gateway")]


def _connector(obs: Observed, ctx: Context) -> list[Finding]:
    out: list[Finding] = []
    t = obs.transfer
    for e in obs.engines:
        d = e.description
        if d is None or d.transfer is None:
            continue
        if not d.transfer.connector:
            out.append(
                Finding(
                    Item.CONNECTOR,
                    Verdict.FAIL,
                    f"{e.role} {e.url} runs no KV connector",
                    fix=ctx.advice(Advice.NO_CONNECTOR),
                    engine=e.url,
                )
            )
        else:
            out.append(
                Finding(
                    Item.CONNECTOR,
                    Verdict.OK,
                    f"{e.role} {e.url}: {d.transfer.connector}, kv_role {d.transfer.role}",
                    engine=e.url,
                    data={"connector": d.transfer.connector, "role": d.transfer.role},
                )
            )
    if t is not None and t.p_hands_off is False:
        out.append(
            Finding(
                Item.CONNECTOR,
                Verdict.FAIL,
                f"prefill {t.prefill} answered a remote-decode prefill without what D needs to take its KV over: "
                "no KV connector",
                fix=ctx.advice(Advice.NO_CONNECTOR),
                engine=t.prefill,
            )
        )
    if t is not None and t.push_failed:
        out.append(
            Finding(
                Item.CONNECTOR,
                Verdict.FAIL,
                f"decode {t.decode} could not read prefill {t.prefill}'s KV: {t.push_failed}",
                fix=ctx.advice(Advice.TRANSFER_FAILED),
                engine=t.decode,
            )
        )
    return out


def _said(e: EngineFacts) -> bool | None:
    """The bidirectional flag as the engine's config or its log says it (None: neither says)."""
    d = e.description
    if d is not None and d.transfer is not None and d.transfer.connector:
        return d.transfer.bidirectional
    if e.log is not None and e.log.settings.get("bidirectional_kv_xfer") == "true":
        return True
    return None


def _bidirectional(obs: Observed, ctx: Context) -> list[Finding]:
    t = obs.transfer
    out: list[Finding] = []
    for e in obs.decode:
        handle = t.d_handle if t is not None and t.decode == e.url else None
        how = "D returned its own handle" if handle else "D answered without a handle of its own"
        out.append(_flag(e, _said(e), handle, Advice.BIDIRECTIONAL_OFF_D, ctx, how))
    for e in obs.prefill:
        pulled: bool | None = None
        how = ""
        if t is not None and t.prefill == e.url:
            if t.pull is PullOutcome.DONE:
                pulled, how = True, "P pulled D's blocks"
            elif t.pull in (PullOutcome.REFUSED, PullOutcome.STALLED):
                pulled, how = False, t.pull_detail
        out.append(_flag(e, _said(e), pulled, Advice.BIDIRECTIONAL_OFF_P, ctx, how))
    return out


def _flag(e: EngineFacts, said: bool | None, seen: bool | None, fix: Advice, ctx: Context, how: str) -> Finding:
    if e.description is None:
        return Finding(Item.BIDIRECTIONAL, Verdict.SKIPPED, f"{e.role} {e.url}: unreachable", engine=e.url)
    on = said if said is not None else seen
    source = "its config says" if said is not None else ("seen: " + how if seen is not None else "")
    if on is False or seen is False:
        what = how if seen is False else "its config has bidirectional_kv_xfer off"
        return Finding(
            Item.BIDIRECTIONAL,
            Verdict.FAIL,
            f"{e.role} {e.url}: bidirectional KV transfer is off ({what}); turnkv cannot reuse D's KV",
            fix=ctx.advice(fix),
            engine=e.url,
        )
    if on is None:
        return Finding(
            Item.BIDIRECTIONAL,
            Verdict.WARN,
            f"{e.role} {e.url}: could not tell whether bidirectional KV transfer is on (no handle from D to try)",
            fix=ctx.advice(fix),
            engine=e.url,
        )
    return Finding(
        Item.BIDIRECTIONAL, Verdict.OK, f"{e.role} {e.url}: bidirectional KV transfer on ({source})", engine=e.url
    )


def _tokenizer(e: EngineFacts, ctx: Context) -> Finding:
    d = e.description
    assert d is not None
    if d.tokenizer is False and e.role == "decode":
        return Finding(
            Item.TOKENIZER,
            Verdict.FAIL,
            f"decode {e.url}: {d.tokenizer_detail}; turnkv sends D the client's chat request, which D must render",
            fix="start D with its tokenizer",
            engine=e.url,
        )
    verdict = Verdict.INFO if d.tokenizer is False else (Verdict.OK if d.tokenizer else Verdict.WARN)
    return Finding(Item.TOKENIZER, verdict, f"{e.role} {e.url}: {d.tokenizer_detail}", engine=e.url)


def _plugin(e: EngineFacts) -> Finding:
    d = e.description
    assert d is not None
    if d.stream_handles:
        how = f"turnkv's plugin {d.plugin}" if d.plugin else f"vLLM {d.version}"
        return Finding(Item.PLUGIN, Verdict.OK, f"decode {e.url}: streams end with D's handle ({how})", engine=e.url)
    return Finding(
        Item.PLUGIN,
        Verdict.WARN,
        f"decode {e.url} ({d.version}) returns its handle only in non-streamed answers: streamed turns run as "
        "plain P/D and D still pins their blocks",
        fix="install turnkv's vLLM plugin (plugins/vllm-turnkv) in D's environment, or run vLLM 0.33 or later",
        engine=e.url,
    )


def _gpus(obs: Observed, ctx: Context) -> Finding:
    known = {e.url: e.description.gpus for e in obs.engines if e.description is not None and e.description.gpus}
    setting = ctx.settings.shared_gpu
    if not known:
        return Finding(
            Item.GPUS,
            Verdict.INFO,
            f"no engine says which GPUs it computes on; the gateway's shared_gpu is {setting}",
            fix="install turnkv's vLLM plugin on every engine (it names the GPUs in /version's x-turnkv-plugin "
            "header), or check each engine's CUDA_VISIBLE_DEVICES and set shared_gpu",
        )
    shared = any(known.get(p.url, frozenset()) & known.get(d.url, frozenset()) for p in obs.prefill for d in obs.decode)
    listing = "; ".join(f"{url}: {', '.join(sorted(g))}" for url, g in known.items())
    summary = f"{'P and D share a GPU' if shared else 'P and D compute on GPUs of their own'} ({listing})"
    if (setting is True and not shared) or (setting is False and shared):
        return Finding(
            Item.GPUS,
            Verdict.WARN,
            f"{summary}, but the gateway's shared_gpu is {setting}",
            fix="set shared_gpu: auto",
            data={"shared": shared},
        )
    return Finding(Item.GPUS, Verdict.OK, summary, data={"shared": shared})


def _side_channel(obs: Observed, ctx: Context) -> list[Finding]:
    t = obs.transfer
    if t is None or not (t.p_endpoint or t.d_endpoint):
        return []
    where = f"P serves its blocks at {t.p_endpoint or '?'}, D at {t.d_endpoint or '?'}"
    if t.p_endpoint and t.p_endpoint == t.d_endpoint:
        return [
            Finding(Item.SIDE_CHANNEL, Verdict.WARN, f"{where}: one address", fix=ctx.advice(Advice.SAME_SIDE_CHANNEL))
        ]
    return [Finding(Item.SIDE_CHANNEL, Verdict.INFO, where)]


def _unexposed(up: list[EngineFacts]) -> list[Finding]:
    hidden: dict[str, tuple[str, list[str]]] = {}
    for e in up:
        assert e.description is not None
        for setting, how in e.description.unexposed:
            hidden.setdefault(setting, (how, []))[1].append(e.url)
    return [
        Finding(Item.UNEXPOSED, Verdict.INFO, f"{setting} ({', '.join(urls)}): {how}", data={"setting": setting})
        for setting, (how, urls) in hidden.items()
    ]
