"""What gateway tests that need no model share: a stand-in tokenizer (bytes as token ids,
BOS 256), and calling the HTTP app in process and reading its SSE events."""

from __future__ import annotations

import asyncio
import json

import httpx


class ByteTokenizer:
    chat_template = None

    def __len__(self) -> int:
        return 259

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([256] if add_special_tokens else []) + list(text.encode())

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def call(core, path: str, body: dict) -> httpx.Response:
    """POST `body` to `path` of the gateway's HTTP app for `core`, in process."""
    from gateway.http_api import create_app

    async def run():
        transport = httpx.ASGITransport(app=create_app(core))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.post(path, json=body)
    return asyncio.run(run())


def events(reply: httpx.Response) -> list[dict]:
    """The JSON events of an SSE reply, which must end with [DONE]."""
    lines = [line[len("data: "):] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]
