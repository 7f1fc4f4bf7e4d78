"""Small weight versions through Redis: a version's files in chunks on `wblob:<model>`.

What it is: the way an adapter version (`models[].adapter`, a few MB) reaches an inference worker that
shares nothing with the trainer but the Redis URL. `put` appends the files of one version folder to the
stream `Keys.weight_blobs(model)` in chunks of `chunk_bytes` (raw bytes, never pickled), one entry per
chunk with fields `v` (version), `f` (file name), `i` (chunk index in the version), `n` (chunks in the
version), `sha` (sha256 of the chunk) and `data`; it returns the id of the version's first entry and the
count, which the trainer's `WeightVersion` announcement carries (`blob`, `blob_chunks`). Every append
trims the stream to the newest `keep_versions` versions' chunks (exact MAXLEN), so Redis holds at most
`keep_versions` x the version size. `fetch` reads one version's chunks from that id, a page at a time
(memory: one page), checks each (version, index, count, chunk hash; a chunk missing means trimmed or
truncated) and writes the files into a folder; the loader then checks the file hash the announcement
carries, as it does for a version on disk. A failed check raises `BlobError` with the reason, which the
weights follower treats as a failed load (retried, then dead-lettered; the old version keeps serving).

What it is not: a file store for full weights (those stay on the shared run folder: a 135M model is
540 MB), and no retention logic beyond the trim.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Sequence

from jet.errors import WeightsError
from jet.keys import Keys

CHUNK_BYTES = 1 << 20
PAGE = 8  # chunks read per XRANGE


class BlobError(WeightsError):
    """A version's chunks in Redis are missing, out of order or corrupted; the message says which. `gone`:
    missing (trimmed), not corrupted."""

    def __init__(self, message: str, gone: bool = False):
        super().__init__(message)
        self.gone = gone


def _chunks(folder: Path, files: Sequence[str], chunk_bytes: int):
    for name in files:
        data = (folder / name).read_bytes()
        for start in range(0, max(len(data), 1), chunk_bytes):
            yield name, data[start:start + chunk_bytes]


def version_bytes(folder: str | Path, files: Sequence[str]) -> int:
    return sum((Path(folder) / f).stat().st_size for f in files)


async def put(client, keys: Keys, model: str, version: int, folder: str | Path, files: Sequence[str],
              chunk_bytes: int = CHUNK_BYTES, keep_versions: int = 3) -> tuple[str, int]:
    """Append version `version`'s `files` (names in `folder`) as chunks; (first entry id, chunk count)."""
    folder = Path(folder)
    chunks = list(_chunks(folder, files, chunk_bytes))
    n = len(chunks)
    stream = keys.weight_blobs(model)
    async with client.pipeline(transaction=True) as p:  # a version's chunks are contiguous in the stream
        for i, (name, data) in enumerate(chunks):
            fields = {"v": str(version), "f": name, "i": str(i), "n": str(n),
                      "sha": hashlib.sha256(data).hexdigest(), "data": data}
            p.xadd(stream, fields, maxlen=n * keep_versions, approximate=False)
        ids = await p.execute()
    first = ids[0].decode() if isinstance(ids[0], bytes) else ids[0]
    return first, n


def _s(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


async def fetch(client, keys: Keys, model: str, version: int, first_id: str, count: int, out: str | Path) -> Path:
    """Write version `version`'s files from the stream into folder `out` (created); BlobError if any check fails."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stream, start, seen = keys.weight_blobs(model), first_id, 0
    handles: dict[str, object] = {}
    try:
        while seen < count:
            page = await client.xrange(stream, start, "+", count=min(PAGE, count - seen))
            if not page or (seen == 0 and _s(page[0][0]) != first_id):
                raise BlobError(f"version {version} of {model}: {count - seen} of its {count} chunks are not in "
                                f"{keys.short(stream)} (trimmed, or never written whole)", gone=True)
            for entry_id, fields in page:
                f = {_s(k): v for k, v in fields.items()}
                try:
                    v, i, n, name, sha, data = (int(_s(f["v"])), int(_s(f["i"])), int(_s(f["n"])), _s(f["f"]),
                                                _s(f["sha"]), f["data"])
                except (KeyError, ValueError) as e:
                    raise BlobError(f"version {version} of {model}: malformed chunk {_s(entry_id)}: {e!r}") from None
                if (v, i, n) != (version, seen, count):
                    raise BlobError(f"version {version} of {model}: entry {_s(entry_id)} is chunk {i} of {n} of "
                                    f"version {v}, expected chunk {seen} of {count}")
                if hashlib.sha256(data).hexdigest() != sha:
                    raise BlobError(f"version {version} of {model}: chunk {i} of {n} fails its sha256")
                if name != os.path.basename(name) or name in ("", ".", ".."):
                    raise BlobError(f"version {version} of {model}: chunk {i} names file {name!r}")
                if name not in handles:
                    handles[name] = open(out / name, "wb")
                handles[name].write(data)
                seen += 1
            start = "(" + _s(page[-1][0])
    finally:
        for h in handles.values():
            h.close()
    return out
