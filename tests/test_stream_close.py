"""A streamed response closes its body iterator when the client disconnects mid-send.

Starlette's own StreamingResponse leaves the iterator suspended when the disconnect cancels the
``send`` of a chunk; the request's lease and worker stream (closed in the iterator's ``finally``)
then wait for the garbage collector. ``ClosingStreamingResponse`` closes it at once."""

import asyncio

from fastapi.responses import StreamingResponse

from cluster.app import ClosingStreamingResponse


def _run(response_cls) -> dict:
    state = {"closed": False, "sent": 0}

    async def body():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
        finally:
            state["closed"] = True

    async def main():
        sending = asyncio.Event()

        async def send(message):
            if message["type"] == "http.response.body":
                state["sent"] += 1
                if state["sent"] == 3:  # the client goes away while this chunk is being sent
                    sending.set()
                    await asyncio.sleep(3600)

        async def receive():
            await sending.wait()
            return {"type": "http.disconnect"}

        resp = response_cls(body(), media_type="text/event-stream")
        await asyncio.wait_for(resp({"type": "http", "asgi": {"spec_version": "2.0"}}, receive, send), 10)
        return state["closed"]

    state["closed_on_return"] = asyncio.run(main())
    return state


def test_the_body_iterator_is_closed_when_the_client_leaves_during_a_send():
    state = _run(ClosingStreamingResponse)
    assert state["sent"] == 3 and state["closed_on_return"]


def test_starlette_alone_leaves_it_open_which_is_why_the_subclass_exists():
    state = _run(StreamingResponse)  # if Starlette starts closing it, the subclass can go
    assert state["sent"] == 3 and not state["closed_on_return"]


def test_a_normal_end_closes_it_once():
    state = {"n": 0, "closed": 0}

    async def body():
        try:
            yield "a"
            yield "b"
        finally:
            state["closed"] += 1

    async def main():
        async def send(message):
            state["n"] += 1

        async def receive():
            await asyncio.sleep(3600)

        await ClosingStreamingResponse(body())({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)

    asyncio.run(main())
    assert state == {"n": 4, "closed": 1}  # start, 2 chunks, the end
