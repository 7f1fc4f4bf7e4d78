"""Group prefix trees: the samples of one training step that share a prefix, merged into prefix trees.

What it is: `share_prefixes(samples)` puts every sample of a step (linear ones and trees, from any
episode of any group) into one trie per model, so a token path several samples share (the system prompt
and task of a GRPO group, a common multi-turn history) becomes one node: the trainer forwards and
backpropagates it once instead of once per sample. It returns the trees and, for each, which entries of
the input (its (sample, episode) entries, numbered sample by sample as `jet.trainer.packing` numbers
them) its own episodes are, so per-entry values (advantages, loss weights) follow the tokens.

The rule at each token, walking a sample from its root (the trie's node of the token's parent, then the
child spelling the token):
- no such child: a new node;
- an untrained token (prompt, tool output, a greedy call): shares the child, whatever the child is;
- a trained token on an untrained child: shares it and claims it (the child now carries this token's
  behaviour columns, `jet.timeline.model.CARRIED`: logprob, version, sampling settings, episode);
- a trained token on a child another token already claims (two members of a group sampled the same
  tokens): the sample's later tokens still descend through that child (same context), and the claim
  goes to a new leaf beside it, the same token under the same parent with no children. The leaf's logits
  come from the same parent, so its logprob is the one its own branch would give; it costs one position.
So every trained token of the input appears exactly once, with exactly its context (its ancestors spell
the same token path), its own behaviour columns and its own entry: the loss and every gradient equal
those of the unmerged samples (tests/timeline/test_share.py, on a real transformer).

What it is not: a packer (`jet.trainer.packing`, which splits a tree larger than a micro-batch with
`split_sample`, re-copying ancestors as context) or an episode merge (`jet.timeline.merge`).

Invariants: outputs are valid `Sample`s in depth-first preorder, children in creation order, so the
result is deterministic in the input order; one model per output; a root is never trained.
"""

from __future__ import annotations

from typing import Sequence

from jet.timeline.model import CARRIED, Sample


class _Trie:
    __slots__ = ("token", "parent", "kids", "children", "claim")

    def __init__(self) -> None:
        self.token = [-1]  # node 0: a virtual root above every root token
        self.parent = [-1]
        self.kids: list[dict[int, int]] = [{}]  # token -> the node a path through it shares
        self.children: list[list[int]] = [[]]  # every child in creation order (claim leaves too)
        self.claim: list[tuple[int, int] | None] = [None]  # (sample, token index) trained at the node

    def node(self, parent: int, token: int, shared: bool) -> int:
        n = len(self.token)
        self.token.append(token)
        self.parent.append(parent)
        self.kids.append({})
        self.children.append([])
        self.claim.append(None)
        self.children[parent].append(n)
        if shared:
            self.kids[parent][token] = n
        return n

    def insert(self, si: int, s: Sample) -> set[int]:
        """Walk sample `si` into the trie; returns the roots (children of node 0) it touched."""
        at = [0] * len(s.tokens)
        roots = set()
        for i, (token, p) in enumerate(zip(s.tokens, s.parents)):
            parent = at[p] if p >= 0 else 0
            child = self.kids[parent].get(token)
            if child is None:
                child = self.node(parent, token, shared=True)
            if s.mask[i]:
                if self.claim[child] is None:
                    self.claim[child] = (si, i)
                else:  # claimed already: the same token, trained again, as a leaf of its own
                    self.claim[self.node(parent, token, shared=False)] = (si, i)
            at[i] = child
            if p < 0:
                roots.add(child)
        return roots

    def preorder(self, root: int) -> tuple[list[int], list[int]]:
        """(nodes, parent index within the list) of the subtree under `root`."""
        nodes, parents, where = [], [], {}
        stack = [root]
        while stack:
            n = stack.pop()
            where[n] = len(nodes)
            nodes.append(n)
            parents.append(where.get(self.parent[n], -1))
            stack.extend(reversed(self.children[n]))
        return nodes, parents


def share_prefixes(samples: Sequence[Sample]) -> list[tuple[Sample, list[int]]]:
    """Samples merged into prefix trees: [(tree, the input entry of each of its episodes)], in the order of
    first appearance. Entries are numbered sample by sample (`sum(len(s.episode_ids) for s in
    samples[:k]) + e`); an input sample with several roots may put its entries in several trees."""
    first_entry, n = [], 0
    for s in samples:
        first_entry.append(n)
        n += len(s.episode_ids)
    tries: dict[str, _Trie] = {}
    order: list[tuple[str, int]] = []  # (model, root) in first-seen order
    seen: set[tuple[str, int]] = set()
    for si, s in enumerate(samples):
        trie = tries.setdefault(s.model, _Trie())
        for root in sorted(trie.insert(si, s)):
            if (s.model, root) not in seen:
                seen.add((s.model, root))
                order.append((s.model, root))
    return [_tree(tries[model], root, model, samples, first_entry) for model, root in order]


def _tree(trie: _Trie, root: int, model: str, samples: Sequence[Sample],
          first_entry: list[int]) -> tuple[Sample, list[int]]:
    nodes, parents = trie.preorder(root)
    claims = [trie.claim[n] for n in nodes]
    members = sorted({si for c in claims if c is not None for si in (c[0],)})
    local_first, entries, episode_ids, rewards, agents = {}, [], [], [], {}
    for si in members:
        s = samples[si]
        local_first[si] = len(episode_ids)
        entries += range(first_entry[si], first_entry[si] + len(s.episode_ids))
        episode_ids += s.episode_ids
        rewards += s.rewards
        agents.update(dict.fromkeys(s.agents))
    cols: dict[str, list] = {c.name: [] for c in CARRIED}
    for claim in claims:
        if claim is None:
            for c in CARRIED:
                cols[c.name].append(c.unset)
            continue
        si, i = claim
        s = samples[si]
        for c in CARRIED:
            cols[c.name].append(getattr(s, c.name)[i])
        cols["episodes"][-1] += local_first[si]  # the sample's episodes are numbered after the earlier members'
    tree = Sample(tokens=tuple(trie.token[n] for n in nodes), parents=tuple(parents), model=model,
                  agents=tuple(agents), episode_ids=tuple(episode_ids), rewards=tuple(rewards),
                  **{name: tuple(values) for name, values in cols.items()})
    return tree, entries
