"""A stored Response through the real ``openai`` SDK: its input items listed and paged, deleted, and a cancel
refused (turnkv runs no background response), each error in OpenAI's shape (the SDK raises its typed error).

In process: the whole gateway over the simulator-backed engines (``tests.pipeline.harness``), the SDK's HTTP
client on an ASGI transport."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import openai
import pytest

from tests.pipeline.harness import Gateway, gateway
from tests.sim_engine import MODEL


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    async with gateway(conversation_from_history=True) as g:
        yield g


@pytest.fixture
def client(gw: Gateway) -> openai.AsyncOpenAI:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=gw.app), base_url="http://gateway.test")
    return openai.AsyncOpenAI(api_key="key-a", base_url="http://gateway.test/v1", http_client=http, max_retries=0)


def said(item: Any) -> tuple[str, str]:
    """A listed message item's role and text."""
    d = item.model_dump()
    assert d["type"] == "message" and d["status"] == "completed"
    return d["role"], "".join(p["text"] for p in d["content"])


SECOND: list[Any] = [
    {"role": "developer", "content": "Answer in one line."},
    {"role": "user", "content": [{"type": "input_text", "text": "And the second day?"}]},
    {"type": "message", "role": "user", "content": "Keep it cheap.", "id": "msg_mine"},
]


async def test_a_responses_input_items_are_what_its_request_sent_paged_as_openai_pages(
    client: openai.AsyncOpenAI,
) -> None:
    first = await client.responses.create(model=MODEL, input="Plan a day in Lyon.", max_output_tokens=40)
    second = await client.responses.create(
        model=MODEL, input=SECOND, previous_response_id=first.id, max_output_tokens=40
    )
    only = await client.responses.input_items.list(first.id)
    assert [said(i) for i in only.data] == [("user", "Plan a day in Lyon.")]
    page = await client.responses.input_items.list(second.id)  # the last item first, its own id kept
    assert [said(i) for i in page.data] == [
        ("user", "Keep it cheap."),
        ("user", "And the second day?"),
        ("developer", "Answer in one line."),
    ]
    assert page.data[0].id == "msg_mine" and all(i.id.startswith("msg_") for i in page.data)
    first_page = await client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [i.id for i in first_page.data] == [page.data[2].id, page.data[1].id] and first_page.has_more
    rest = await client.responses.input_items.list(second.id, order="asc", limit=2, after=first_page.data[-1].id)
    assert [i.id for i in rest.data] == ["msg_mine"] and not rest.has_more
    assert [i.id async for i in client.responses.input_items.list(second.id, limit=1)] == [i.id for i in page.data]


@pytest.mark.parametrize(
    ("query", "param"),
    [({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_x"}, "after")],
)
async def test_bad_list_parameters_are_named(client: openai.AsyncOpenAI, query: dict[str, Any], param: str) -> None:
    r = await client.responses.create(model=MODEL, input="Plan a day in Lyon.", max_output_tokens=20)
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.input_items.list(r.id, **query)
    assert err.value.status_code == 400 and err.value.param == param


async def test_a_deleted_response_is_gone_for_get_continue_list_and_delete(client: openai.AsyncOpenAI) -> None:
    r = await client.responses.create(model=MODEL, input="Plan a day in Lyon.", max_output_tokens=20)
    kept = await client.responses.create(model=MODEL, input="Plan a day in Nice.", max_output_tokens=20)
    raw = await client.responses.with_raw_response.delete(r.id)
    assert raw.http_request.method == "DELETE" and raw.status_code == 200
    assert json.loads(raw.text) == {"id": r.id, "object": "response", "deleted": True}
    for gone in (
        client.responses.retrieve(r.id),
        client.responses.input_items.list(r.id),
        client.responses.delete(r.id),
    ):
        with pytest.raises(openai.NotFoundError):
            await gone
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.create(model=MODEL, input="And then?", previous_response_id=r.id)
    assert err.value.code == "previous_response_not_found"
    assert (await client.responses.retrieve(kept.id)).id == kept.id  # only that one


async def test_a_cancel_is_refused_in_openais_shape(client: openai.AsyncOpenAI) -> None:
    r = await client.responses.create(model=MODEL, input="Plan a day in Lyon.", max_output_tokens=20)
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.cancel(r.id)
    assert err.value.param == "response_id" and "background" in err.value.message
    assert (await client.responses.retrieve(r.id)).model_dump() == r.model_dump()  # untouched
    with pytest.raises(openai.NotFoundError):
        await client.responses.cancel("resp_nope")
