"""What validating wire metadata costs: one small GenRequest decoded (`codec.decode`) and then
validated (`GenRequest.from_payload`) 100k times in process, best of 5.

Run it with two checkouts' interpreters back to back to compare their validation code
(the README's Queue throughput section compares msgspec with the hand-written checks it replaced):

    .venv/bin/python scripts/wire-validate-bench.py LABEL
"""

import sys
import time

from jet.queues import codec
from jet.wire import GenRequest

N = 100_000


def main(label: str) -> None:
    req = GenRequest(reply_to="jet:{run}:reply:abc", model="tiny", prompt_ids=tuple(range(12)), episode_id="ep-1",
                     agent="main", max_tokens=32)
    fields = req.to_fields()
    size = sum(len(k) + len(v) for k, v in fields.items())
    best_decode = best_both = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(N):
            codec.decode(fields)
        decode = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(N):
            GenRequest.from_payload(codec.decode(fields))
        both = time.perf_counter() - t
        best_decode, best_both = min(best_decode, decode), min(best_both, both)
    print(f"{label}: entry {size} B; decode {best_decode / N * 1e6:.2f} us, decode+validate "
          f"{best_both / N * 1e6:.2f} us, validation alone {(best_both - best_decode) / N * 1e6:.2f} us per message")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "this checkout")
