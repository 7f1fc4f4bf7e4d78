"""The prefix tree behind `merge_calls(..., mode="tree")`.

What it is: a trie over token ids, one per model. Every call walks its prompt
down the trie (sharing any existing path) and then its completion, claiming
the nodes it generated. Its output is flat preorder columns for
`jet.timeline._build`, one set per root.

What it is not: a sample type or a packer; `jet.timeline.Sample` is the tree's
wire form and `jet.trainer.packing` lays it out for a model.

Invariants:
- a node's context is the token path from its root, so any two calls that
  reach one node saw exactly the same tokens before it: sharing it changes no
  logprob;
- a node is trained by at most one call: when a completion token's node is
  already trained by another call (two members of a group sampled the same
  tokens), a sibling with the same token is created, so both are trained; a
  greedy call (temperature 0) claims no node, its tokens being context only;
- a call reuses the deepest existing path that spells its tokens (such
  siblings make several), so tree mode never stores more than exact mode;
- children keep creation order, so the output is deterministic.
"""

from __future__ import annotations

from typing import Sequence

from jet.timeline.model import Call

Columns = tuple[list[int], list[int], list[int], list[int]]  # tokens, parents, who, k


class _Trie:
    """Flat node store; node 0 is a virtual root above every model's roots."""

    __slots__ = ("token", "parent", "kids", "who", "k")

    def __init__(self) -> None:
        self.token = [-1]
        self.parent = [-1]
        self.kids: list[dict[int, list[int]]] = [{}]
        self.who = [-1]
        self.k = [0]

    def _new(self, parent: int, token: int) -> int:
        node = len(self.token)
        self.token.append(token)
        self.parent.append(parent)
        self.kids.append({})
        self.who.append(-1)
        self.k.append(0)
        self.kids[parent].setdefault(token, []).append(node)
        return node

    def _deepest(self, ids: tuple[int, ...], n_prompt: int) -> list[int]:
        """The longest existing path spelling a prefix of `ids` whose completion part is unclaimed.

        A depth-first search over matching nodes (each visited once), so a
        prompt reuses the deepest of several same-token branches, not the first.
        """
        best, best_depth = 0, 0
        stack = [(0, 0)]
        while stack:
            node, depth = stack.pop()
            if depth > best_depth:
                best, best_depth = node, depth
            if depth < len(ids):
                for child in reversed(self.kids[node].get(ids[depth], ())):
                    if depth < n_prompt or self.who[child] < 0:
                        stack.append((child, depth + 1))
        path = []
        while best:
            path.append(best)
            best = self.parent[best]
        return path[::-1]

    def insert(self, index: int, call: Call) -> None:
        ids, n_prompt = call.ids, len(call.prompt_ids)
        path = self._deepest(ids, n_prompt)
        for token in ids[len(path) :]:
            path.append(self._new(path[-1] if path else 0, token))
        if call.temperature == 0:  # a greedy call's tokens are context: they claim nothing (another call
            return                 # may train the same tokens at these nodes)
        for offset, node in enumerate(path[n_prompt:]):
            self.who[node] = index
            self.k[node] = offset

    def columns(self, root: int) -> Columns:
        """The subtree under `root` in depth-first preorder."""
        tokens, parents, who, k = [], [], [], []
        where: dict[int, int] = {}
        stack = [root]
        while stack:
            node = stack.pop()
            where[node] = len(tokens)
            tokens.append(self.token[node])
            parents.append(where.get(self.parent[node], -1))
            who.append(self.who[node])
            k.append(self.k[node])
            children = [c for ids in self.kids[node].values() for c in ids]
            stack.extend(sorted(children, reverse=True))
        return tokens, parents, who, k


def tree_columns(calls: Sequence[Call]) -> list[Columns]:
    """Preorder columns of every root of every model's trie, in first-seen order."""
    tries: dict[str, _Trie] = {}
    for index, call in enumerate(calls):
        tries.setdefault(call.model, _Trie()).insert(index, call)
    out: list[Columns] = []
    for trie in tries.values():
        roots = sorted(c for ids in trie.kids[0].values() for c in ids)
        out.extend(trie.columns(r) for r in roots)
    return out
