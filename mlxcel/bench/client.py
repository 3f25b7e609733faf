"""Streaming chat requests against an OpenAI-compatible server, timed.

Synchronous (httpx with threads for concurrent requests) so the timing code
is the same whether the caller is a script or a Trio test in a worker thread.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

import attrs
import httpx

from mlxcel.bench.workload import Workload

__all__ = ["RequestRecord", "ConversationRunner", "parse_sse_lines", "resolve_model", "stream_chat"]

REQUEST_TIMEOUT_S = 600.0


@attrs.frozen(kw_only=True)
class RequestRecord:
    server: str
    conversation: int
    turn: int
    ttft_s: float | None
    e2e_s: float
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    first_event_s: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    # An unseen probe (``conversation`` is the probe's index), not a chat turn.
    unseen: bool = False
    reply: str = attrs.field(default="", repr=False)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self, filter=lambda attribute, _value: attribute.name != "reply")


def parse_sse_lines(lines: Any) -> Any:
    """Yield the JSON bodies of ``data:`` events until ``[DONE]``."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        if payload:
            yield json.loads(payload)


def resolve_model(client: httpx.Client, base_url: str) -> str:
    """The first model id the server lists at /v1/models."""
    response = client.get(f"{base_url}/v1/models", timeout=30.0)
    response.raise_for_status()
    data = response.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


def stream_chat(
    client: httpx.Client,
    base_url: str,
    *,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    server: str,
    conversation: int,
    turn: int,
    unseen: bool = False,
) -> RequestRecord:
    """One streaming chat request, timed from just before the request is sent."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    texts: list[str] = []
    usage: dict[str, Any] | None = None
    ttft = first_event = None
    finish_reason = error = None
    start = time.perf_counter()
    try:
        with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                error = f"HTTP {response.status_code}: {response.text[:200]}"
            else:
                for event in parse_sse_lines(response.iter_lines()):
                    now = time.perf_counter() - start
                    if first_event is None:
                        first_event = now
                    if "error" in event:
                        error = str(event["error"])[:200]
                    if event.get("usage"):
                        usage = event["usage"]
                    for choice in event.get("choices") or []:
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            if ttft is None:
                                ttft = now
                            texts.append(content)
                        if choice.get("finish_reason"):
                            finish_reason = choice["finish_reason"]
    except (httpx.HTTPError, ValueError) as exception:
        error = f"{type(exception).__name__}: {exception}"
    e2e = time.perf_counter() - start
    details = (usage or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return RequestRecord(
        server=server,
        conversation=conversation,
        turn=turn,
        ttft_s=ttft,
        e2e_s=e2e,
        prompt_tokens=(usage or {}).get("prompt_tokens"),
        cached_tokens=int(cached) if isinstance(cached, int) else None,
        completion_tokens=(usage or {}).get("completion_tokens"),
        first_event_s=first_event,
        finish_reason=finish_reason,
        error=error,
        unseen=unseen,
        reply="".join(texts),
    )


def format_progress(record: RequestRecord) -> str:
    def seconds(value: float | None) -> str:
        return "   -   " if value is None else f"{value:7.3f}"

    where = f"unseen {record.conversation:2d}" if record.unseen else (
        f"conversation {record.conversation:2d} turn {record.turn}")
    line = (
        f"[{record.server}] {where}: "
        f"ttft {seconds(record.ttft_s)} s  e2e {seconds(record.e2e_s)} s  "
        f"prompt {record.prompt_tokens} cached {record.cached_tokens} completion {record.completion_tokens}"
    )
    return line + (f"  ERROR {record.error}" if record.error else "")


class ConversationRunner:
    """One server's side of the workload: its conversations' histories, turn by turn.

    ``run_turn(k)`` sends turn k of every conversation: one at a time
    (``concurrency=1``) or all at once (``concurrency=None``), and appends
    each actual reply to that conversation's history. ``run_unseen(i)`` sends
    unseen probe i, outside every conversation.
    """

    def __init__(
        self,
        workload: Workload,
        *,
        server: str,
        base_url: str,
        model: str | None = None,
        progress: TextIO | None = sys.stderr,
        on_record: Callable[[RequestRecord], None] | None = None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.workload = workload
        self.server = server
        self.base_url = base_url.rstrip("/")
        self.client = httpx.Client(timeout=request_timeout_s)
        self.model = model or resolve_model(self.client, self.base_url)
        self.replies: list[list[str]] = [[] for _ in range(workload.shape.conversations)]
        self.records: list[RequestRecord] = []
        self.progress = progress
        self.on_record = on_record
        self._lock = threading.Lock()

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> ConversationRunner:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _one(self, conversation: int, turn: int) -> RequestRecord:
        record = stream_chat(
            self.client,
            self.base_url,
            model=self.model,
            messages=self.workload.messages(conversation, turn, self.replies[conversation]),
            max_tokens=self.workload.shape.reply_tokens,
            server=self.server,
            conversation=conversation,
            turn=turn,
        )
        with self._lock:
            self.replies[conversation].append(record.reply)
            self._keep(record)
        return record

    def _keep(self, record: RequestRecord) -> None:
        self.records.append(record)
        if self.progress is not None:
            print(format_progress(record), file=self.progress, flush=True)
        if self.on_record is not None:
            self.on_record(record)

    def run_unseen(self, index: int) -> RequestRecord:
        """Unseen probe ``index``: a prompt that shares nothing with the chat turns or the other probes."""
        record = stream_chat(
            self.client,
            self.base_url,
            model=self.model,
            messages=self.workload.unseen_messages(index),
            max_tokens=self.workload.shape.reply_tokens,
            server=self.server,
            conversation=index,
            turn=0,
            unseen=True,
        )
        with self._lock:
            self._keep(record)
        return record

    def run_turn(self, turn: int, *, concurrency: int | None = 1) -> list[RequestRecord]:
        conversations = range(self.workload.shape.conversations)
        if concurrency == 1:
            return [self._one(conversation, turn) for conversation in conversations]
        results: dict[int, RequestRecord] = {}
        threads = [
            threading.Thread(target=lambda c=c: results.__setitem__(c, self._one(c, turn)), daemon=True)
            for c in conversations
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return [results[c] for c in conversations]

    def run_all(self, *, concurrency: int | None = 1) -> list[RequestRecord]:
        for turn in range(self.workload.shape.turns):
            self.run_turn(turn, concurrency=concurrency)
        return self.records
