"""Where the gateway records a key's calls (`Sessions`, its two kinds), and the env worker's side of it.

What it is:
- `LocalSessions`, the embedded gateway's: a key reaches the live Session of
  this process's LLM client, and a call records itself there, exactly like a
  `jet.llm` call.
- `Episodes`, the env worker's side: `open` gives an episode's session the
  gateway's base URL and its API key (and a minter for keys of other agents or
  models of the same episode run); with a standalone gateway it also creates
  the episode run's stream `calls:<episode>.<tag>` (an "open" entry, with a
  TTL = the key's lifetime). `collect`, awaited once the workflow is done and
  before the merge and the atomic commit, reads and deletes that stream in ONE
  MULTI and adds its calls to the session: every call the gateway
  acknowledged is in the published trajectory. `close` deletes it after a
  failed episode (its TTL is the backstop).
- `RecordingSessions`, the standalone gateway's side: a Session per episode
  run (in memory, LRU), each answered call appended with XADD NOMKSTREAM, so
  a call of an episode that is over (collected, failed, expired) is refused
  with 401 and never written. On a miss the session's kept turns are rebuilt
  from the stream (`restore`), so a restarted or second gateway still extends
  the same kept token ids, and answers the previous_response_id of a response
  another gateway made.
- `responses_of(session)`: the conversations behind the episode's Responses
  API response ids (what `previous_response_id` continues), per episode run.

Calls the client never received: a call is recorded before its answer is sent
(so a call of an episode that is over is refused with 401, never written);
when the client disconnected before the whole answer went out, the gateway
withdraws it: embedded, `Session.withdraw` moves it to `session.undelivered`;
standalone, a "gw_undelivered" entry names the call's entry and `collect`
puts that call in `session.undelivered`. Undelivered calls are left out of
training, not trained masked: the agent never saw the completion, so the
episode's reward says nothing about it, and no later call extends it (the
client cannot send back what it never got), so it is no one's context.

Entries: codec entries (orjson metadata, raw int32/float32 arrays), kind
"gw_open", "gw_call" or "gw_undelivered"; a call carries its Call and the
message keys of the turn it leaves (what `jet.chat.Conversations` matches
on), and, for a Responses API call, its response id and conversation.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import OrderedDict
from typing import Any, Protocol

import anyio

from jet.chat import Turn, message_key, tools_key
from jet.errors import CodecError, QueueError
from jet.keys import Keys
from jet.llm import ChatCompletion, LLMClient, Session
from jet.queues import codec
from jet.queues.connect import translated
from jet.sampling import NEUTRAL, settings_of
from jet.timeline import Call
from jet.workers.gateway.auth import Claims, InvalidKey, Signer
from jet.workers.gateway.chat import ChatRequest

MAX_SESSIONS = 4096  # episode runs whose conversation state a standalone gateway keeps in memory
MAX_RESPONSES = 256  # Responses API conversations kept per episode run (for previous_response_id)
OPEN, CALL, UNDELIVERED = "gw_open", "gw_call", "gw_undelivered"  # entry kinds of a calls stream
_responses: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def responses_of(session: Session) -> OrderedDict[str, list[dict]]:
    """Response id -> the conversation (messages without instructions, reply included) it ends with."""
    if session not in _responses:
        _responses[session] = OrderedDict()
    return _responses[session]


def remember(session: Session, rid: str, messages: list[dict]) -> None:
    log = responses_of(session)
    log[rid] = messages
    while len(log) > MAX_RESPONSES:
        log.popitem(last=False)


class Episodes:
    """What an env worker does for the gateway: give each episode's session its credentials and,
    with a standalone gateway, open its calls stream and collect it at the end."""

    def __init__(self, signer: Signer, base_url: str, r=None, keys: Keys | None = None, url: str = ""):
        self.signer, self.base_url, self.r, self.keys, self.url = signer, base_url, r, keys, url

    @property
    def standalone(self) -> bool:
        return self.r is not None

    async def open(self, session: Session, ttl_s: float, task: str = "") -> None:
        """Give `session` its gateway URL and keys (naming `task`, for the gateway's warnings)."""
        expires = int(time.time() + ttl_s)

        def mint(model: str, agent: str) -> str:
            return self.signer.mint(Claims(session.episode_id, session.tag, model, agent, expires, task))

        session.openai_base_url, session.mint_key = self.base_url, mint
        session.openai_api_key = mint(session.model, session.agent)
        if self.standalone:
            key = self.keys.calls(session.episode_id, session.tag)
            with translated(self.url):
                async with self.r.pipeline(transaction=True) as p:
                    p.xadd(key, codec.encode(OPEN, {"episode_id": session.episode_id, "expires": expires}))
                    p.expire(key, max(1, int(ttl_s)))
                    await p.execute()

    async def collect(self, session: Session) -> None:
        """Add the calls the standalone gateway recorded to `session.calls`, and close the stream."""
        if not self.standalone:
            return
        key = self.keys.calls(session.episode_id, session.tag)
        with translated(self.url):
            async with self.r.pipeline(transaction=True) as p:
                p.xrange(key)
                p.delete(key)
                entries, _ = await p.execute()
        gone = undelivered_ids(entries)
        for entry_id, fields in entries:
            found = decode_call(fields)
            if found is not None:
                (session.undelivered.append if entry_id in gone else session.record)(found[0])

    async def close(self, session: Session) -> None:
        """Best effort: refuse further calls of a finished episode (the stream's TTL is the backstop)."""
        if self.standalone:
            with contextlib.suppress(QueueError), translated(self.url):
                await self.r.delete(self.keys.calls(session.episode_id, session.tag))


class Sessions(Protocol):
    """Where a key's calls are recorded: `LocalSessions` (embedded in an env worker) or `RecordingSessions`
    (a standalone gateway). The app calls `get` before a call, `recorded` once its answer exists (before
    it is sent: a refusal there is a 401) and `undelivered` when the client went away before the whole
    answer went out."""

    async def get(self, claims: Claims) -> Session: ...

    async def recorded(self, claims: Claims, request: ChatRequest, done: ChatCompletion,
                       response: tuple[str, list[dict]] | None = None) -> Any: ...

    async def undelivered(self, claims: Claims, done: ChatCompletion, recorded: Any) -> None: ...


class LocalSessions:
    """Embedded: keys reach the live sessions of this process's LLM client; calls record themselves."""

    def __init__(self, client: LLMClient):
        self.client = client

    async def get(self, claims: Claims) -> Session:
        s = self.client.sessions.get(claims.episode_id)
        if s is None or s.tag != claims.tag:
            raise InvalidKey("the episode of this API key is not running (it is over)", "episode_over")
        return s

    async def recorded(self, claims: Claims, request: ChatRequest, done: ChatCompletion,
                       response: tuple[str, list[dict]] | None = None) -> None:
        """Refuse the answer of a call that outlived its episode (the merge had already read the calls),
        as a standalone gateway does."""
        if self.client.sessions.get(claims.episode_id) is None:
            raise InvalidKey("the episode ended before this call finished: it was not recorded", "episode_over")

    async def undelivered(self, claims: Claims, done: ChatCompletion, recorded: Any) -> None:
        s = self.client.sessions.get(claims.episode_id)
        if s is not None and s.tag == claims.tag:
            s.withdraw(done.call)


class _GatewaySession(Session):
    """A standalone gateway's session: its calls go to Redis, not to a list in memory."""

    def record(self, call: Call) -> None:
        pass


class RecordingSessions:
    """Standalone: a Session per episode run (LRU), each answered call appended to the run's calls stream."""

    def __init__(self, client: LLMClient, r, keys: Keys, url: str):
        self.client, self.r, self.keys, self.url = client, r, keys, url
        self._live: OrderedDict[str, Session] = OrderedDict()

    async def get(self, claims: Claims) -> Session:
        key = self.keys.calls(claims.episode_id, claims.tag)
        with translated(self.url):  # the stream exists while the episode runs (see Episodes)
            entries = [] if key in self._live else await self.r.xrange(key)
            alive = await self.r.exists(key) if key in self._live else bool(entries)
        if not alive:
            self._live.pop(key, None)
            raise InvalidKey("the episode of this API key is over or unknown", "episode_over")
        if key not in self._live:
            s = _GatewaySession(self.client, claims.episode_id, claims.model, claims.agent)
            await anyio.to_thread.run_sync(restore, s, entries)
            self._live.setdefault(key, s)
        self._live.move_to_end(key)
        while len(self._live) > MAX_SESSIONS:
            self._live.popitem(last=False)
        return self._live[key]

    async def recorded(self, claims: Claims, request: ChatRequest, done: ChatCompletion,
                       response: tuple[str, list[dict]] | None = None) -> bytes:
        """Append the call to the episode's calls stream; its entry id. `response`: (id, conversation)
        of a Responses API call."""
        key = self.keys.calls(claims.episode_id, claims.tag)
        with translated(self.url):
            added = await self.r.xadd(key, call_fields(request.messages, request.tools, done, response),
                                      nomkstream=True)
        if added is None:
            self._live.pop(key, None)
            raise InvalidKey("the episode ended before this call finished: it was not recorded", "episode_over")
        return added

    async def undelivered(self, claims: Claims, done: ChatCompletion, recorded: bytes) -> None:
        """Mark the call of entry `recorded` as never received (best effort: an episode already collected
        has it as delivered)."""
        key = self.keys.calls(claims.episode_id, claims.tag)
        with translated(self.url):
            await self.r.xadd(key, codec.encode(UNDELIVERED, {"call": recorded.decode()}), nomkstream=True)


def undelivered_ids(entries: list) -> set[bytes]:
    """Entry ids of the calls a calls stream marks as never received."""
    out = set()
    for _, fields in entries:
        p = codec.decode(fields, max_bytes=1 << 62)
        if p.kind == UNDELIVERED:
            out.add(str(p.meta["call"]).encode())
    return out


def call_fields(messages: list[dict], tools: list[dict] | None, done: ChatCompletion,
                response: tuple[str, list[dict]] | None = None) -> dict[bytes, bytes]:
    """A calls-stream entry: the Call, and the kept turn it leaves (for `restore`)."""
    c = done.call
    meta = {"model": c.model, "agent": c.agent, "version": c.version, "finish_reason": c.finish_reason,
            **settings_of(c),
            "keys": [message_key(m) for m in [*messages, done.message]], "tools": tools_key(tools)}
    if response is not None:
        meta["response"] = {"id": response[0], "conversation": response[1]}
    return codec.encode(CALL, meta, ints={"prompt": c.prompt_ids, "completion": c.completion_ids},
                        floats={"logprobs": c.completion_logprobs}, max_bytes=1 << 62)


def decode_call(fields: dict) -> tuple[Call, dict] | None:
    """(Call, metadata) of a calls-stream entry; None for the other entries. Raises CodecError."""
    p = codec.decode(fields, max_bytes=1 << 62)
    if p.kind in (OPEN, UNDELIVERED):
        return None
    if p.kind != CALL:
        raise CodecError(f"expected a {CALL!r} entry, got {p.kind!r}")
    m = p.meta
    try:
        call = Call(tuple(p.arrays["prompt"]), tuple(p.arrays["completion"]), tuple(p.arrays["logprobs"]),
                    int(m["version"]), str(m["model"]), str(m["agent"]), str(m["finish_reason"]),
                    **{name: float(m.get(name, neutral)) for name, neutral in NEUTRAL.items()})
    except (KeyError, TypeError, ValueError) as e:
        raise CodecError(f"malformed {CALL!r} entry: {e}") from None
    return call, m


def restore(session: Session, entries: list) -> None:
    """Rebuild a session's kept turns and Responses conversations from its calls stream (blocking: loads
    tokenizers). Calls the client never received leave no turn."""
    gone = undelivered_ids(entries)
    for entry_id, fields in entries:
        found = decode_call(fields)
        if found is None or entry_id in gone:
            continue
        call, m = found
        if isinstance(m.get("response"), dict):
            remember(session, str(m["response"]["id"]), list(m["response"]["conversation"]))
        conv = session.conversation(call.model, call.agent)
        conv.turns.append(Turn(keys=tuple(m["keys"]), tools=m["tools"], ids=call.ids,
                               completion=call.completion_ids, finish_reason=call.finish_reason))
        del conv.turns[: -conv.max_turns]
