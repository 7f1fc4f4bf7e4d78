"""API keys of the gateway: signed, expiring tokens that name one run of one episode.

A key is `jet-` + base64url (no padding) of a binary payload and its MAC:

    payload = u8 version | u32 expiry (unix s) | str episode id | str tag | str model | str agent
              | str task (version 2; str = u8 length + UTF-8 bytes)
    mac     = HMAC-SHA256(secret, b"jet-gateway-v1\\0" + run + b"\\0" + payload)

It is a compact binary layout, not JSON: the fields are not secret (ids and
names), but a key is opaque to agent code and cannot be edited without the
secret. The MAC covers the run name, so a key of one run is refused by another
run's gateway even when both share $JET_GATEWAY_SECRET. `Signer.verify`
compares the MAC in constant time (`hmac.compare_digest`) before it reads any
field, then checks the version and the expiry. Version 1 keys (no task) are
still read, as task "". The tag is the Session's
`tag`: a re-run of a redelivered task gets a new one, so keys handed to an
earlier (crashed) run of the same episode never reach the new run.

The secret: $JET_GATEWAY_SECRET when set (at least 32 characters), else 32
random bytes made once per run and kept in Redis under the run's hash tag
(`Keys.gateway_secret`, SET NX, so processes starting together agree). Whoever
can read the run's keys can then mint API keys, but they could write
GenRequests directly as well: access to a run's Redis is already full access
to the run. Set the variable to keep the secret out of Redis.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
import struct
import time
from dataclasses import dataclass

from jet.errors import JetError
from jet.keys import Keys
from jet.queues.connect import translated

SECRET_ENV = "JET_GATEWAY_SECRET"
MIN_SECRET = 32  # characters of $JET_GATEWAY_SECRET
PREFIX = "jet-"
VERSION = 2
FIELDS = {1: 4, 2: 5}  # str fields per key version
MAC_BYTES = 32
MAX_KEY_CHARS = 2048  # longer Authorization values are refused before decoding
_CONTEXT = b"jet-gateway-v1\0"
_HEAD = struct.Struct(">BI")  # version, expiry


class InvalidKey(JetError):
    """An API key the gateway refuses (HTTP 401); `code` is the OpenAI-style error code."""

    def __init__(self, message: str, code: str = "invalid_api_key"):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Claims:
    """What a verified key says: whose calls these are, and until when."""

    episode_id: str
    tag: str  # the Session's tag: one run of the episode
    model: str  # the model calls go to unless the request names another configured one
    agent: str  # the agent name the calls are recorded under
    expires: int  # unix seconds
    task: str = ""  # the episode's task name (what the gateway's warnings name)


def _field(value: str) -> bytes:
    raw = value.encode()
    if len(raw) > 255:
        raise ValueError(f"{value[:40]!r}...: key fields are at most 255 bytes")
    return bytes([len(raw)]) + raw


class Signer:
    """Mints and verifies the API keys of one run."""

    def __init__(self, secret: bytes, run: str):
        if len(secret) < 16:
            raise ValueError("the gateway secret must be at least 16 bytes")
        self._secret, self._context = secret, _CONTEXT + run.encode() + b"\0"

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self._secret, self._context + payload, hashlib.sha256).digest()

    def mint(self, claims: Claims) -> str:
        payload = _HEAD.pack(VERSION, max(0, min(claims.expires, 2**32 - 1))) + b"".join(
            _field(v) for v in (claims.episode_id, claims.tag, claims.model, claims.agent, claims.task))
        return PREFIX + base64.urlsafe_b64encode(payload + self._mac(payload)).rstrip(b"=").decode()

    def key(self, episode_id: str, tag: str, model: str, agent: str, ttl_s: float, task: str = "") -> str:
        return self.mint(Claims(episode_id, tag, model, agent, int(time.time() + ttl_s), task))

    def verify(self, key: str, now: float | None = None) -> Claims:
        """The claims of a genuine, unexpired key; InvalidKey otherwise."""
        if not key.startswith(PREFIX) or len(key) > MAX_KEY_CHARS:
            raise InvalidKey("invalid API key")
        body = key[len(PREFIX):]
        try:
            raw = base64.b64decode(body + "=" * (-len(body) % 4), altchars=b"-_", validate=True)
        except (binascii.Error, ValueError):
            raise InvalidKey("invalid API key") from None
        if base64.urlsafe_b64encode(raw).rstrip(b"=").decode() != body:  # one spelling per key
            raise InvalidKey("invalid API key")
        payload, mac = raw[:-MAC_BYTES], raw[-MAC_BYTES:]
        if len(raw) <= MAC_BYTES + _HEAD.size or not hmac.compare_digest(mac, self._mac(payload)):
            raise InvalidKey("invalid API key")
        version, expires = _HEAD.unpack_from(payload)
        if version not in FIELDS:
            raise InvalidKey(f"API key of unsupported version {version}")
        fields, at = [], _HEAD.size
        for _ in range(FIELDS[version]):
            n = payload[at] if at < len(payload) else len(payload)
            fields.append(payload[at + 1:at + 1 + n])
            at += 1 + n
        if at != len(payload):
            raise InvalidKey("invalid API key")
        try:
            episode_id, tag, model, agent, *task = (f.decode() for f in fields)
        except UnicodeDecodeError:
            raise InvalidKey("invalid API key") from None
        if (now if now is not None else time.time()) >= expires:
            raise InvalidKey("expired API key: the episode it was made for is over", "expired_api_key")
        return Claims(episode_id, tag, model, agent, expires, task[0] if task else "")


async def load_secret(r, keys: Keys, url: str = "") -> bytes:
    """$JET_GATEWAY_SECRET, else the run's secret in Redis (made on first use)."""
    env = os.environ.get(SECRET_ENV)
    if env:
        if len(env) < MIN_SECRET:
            raise JetError(f"${SECRET_ENV} must be at least {MIN_SECRET} characters")
        return env.encode()
    with translated(url):
        await r.set(keys.gateway_secret, secrets.token_bytes(32), nx=True)
        return bytes(await r.get(keys.gateway_secret))
