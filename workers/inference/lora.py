"""Several LoRA adapters on one base model, each row of a batch with its own: one copy of the base for a team.

What it is: `RowLoRA(model, slots)` holds, for each slot (one model of a team, `jet.config.serving_groups`),
the A and B matrices of the adapter version that slot serves, and adds each row's own update to the
output of every adapted linear layer of the base (a forward hook per layer):
`y = base(x) + (x A^T) B^T * alpha / r`, in the order peft computes it while training
(`jet.trainer.adapter`), so a slot's logprobs are what its trainer recomputes up to float noise. Before
each forward the scheduler (`jet.workers.inference.hf_engine`) says which slot each row is (`select`);
rows of one slot are computed together. A slot without an adapter serves the base as it is.

Why hooks and not merging: merging (what a backend serving one adapter model does, `jet.workers.inference.hf`)
changes the base's weights, which every other model of the team shares. The cost is two thin matmuls
per adapted layer and row group; the memory is one base plus each adapter (~20 MB at r 16 on every
projection of SmolLM2-135M), where one worker per model holds one base each.

What it is not: a trainer, nor a file reader (`jet.adapters` reads and checks versions).

Invariants: `set` changes nothing unless every adapted layer exists in the base as a linear layer
with matching shapes (else `AdapterError` naming the layer); only the weight loader calls `set` or
`clear`, under the engine's exclusive gate, so no forward sees half a version.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jet import adapters
from jet.adapters import AdapterError

if TYPE_CHECKING:
    import torch


class RowLoRA:
    def __init__(self, model, slots: int):
        self.model, self.slots = model, slots
        self.layers: dict[str, dict[int, tuple]] = {}  # module name -> slot -> (A, B, scale)
        self._hooks: dict[str, object] = {}
        self._groups: list[tuple[int, torch.Tensor | None]] = []  # (slot, its rows; None = every row)

    def set(self, slot: int, adapter: adapters.Adapter) -> None:
        """Serve `adapter` on `slot` from the next forward on (its previous adapter dropped)."""
        import torch

        modules = dict(self.model.named_modules())
        found = adapters.pairs(adapter)
        checked = {}
        for layer, (a, b) in found.items():
            mod = modules.get(layer)
            if not isinstance(mod, torch.nn.Linear):
                raise AdapterError(f"the adapter updates {layer!r}, which is not a linear layer of the model")
            if a.shape[1] != mod.in_features or b.shape[0] != mod.out_features:
                raise AdapterError(f"the adapter's {layer!r} maps {a.shape[1]} -> {b.shape[0]} features, the "
                                   f"model's layer {mod.in_features} -> {mod.out_features}")
            w = mod.weight
            checked[layer] = (a.to(w.device, w.dtype).contiguous(), b.to(w.device, w.dtype).contiguous(),
                              adapter.scale)
        self.clear(slot)
        for layer, abs_ in checked.items():
            self.layers.setdefault(layer, {})[slot] = abs_
            if layer not in self._hooks:
                self._hooks[layer] = modules[layer].register_forward_hook(self._hook(layer))

    def clear(self, slot: int) -> None:
        """`slot` serves the base alone."""
        for layer in list(self.layers):
            self.layers[layer].pop(slot, None)
            if not self.layers[layer]:
                del self.layers[layer]
                self._hooks.pop(layer).remove()

    def select(self, slots: list[int], device) -> None:
        """The slot of each row of the next forward, in batch order."""
        import torch

        distinct = sorted(set(slots))
        if len(distinct) == 1:
            self._groups = [(distinct[0], None)]
            return
        self._groups = [(s, torch.tensor([i for i, x in enumerate(slots) if x == s], device=device))
                        for s in distinct]

    def nbytes(self) -> int:
        """Memory of the adapters held (bytes)."""
        return sum(t.numel() * t.element_size() for per in self.layers.values() for a, b, _ in per.values()
                   for t in (a, b))

    def _hook(self, layer: str):
        import torch.nn.functional as F

        def add_updates(module, args, out):
            per = self.layers.get(layer, {})
            x = args[0]
            for slot, rows in self._groups:
                if slot not in per:
                    continue
                a, b, scale = per[slot]
                if rows is None:
                    out = out + F.linear(F.linear(x, a), b) * scale
                else:
                    out = out.index_add(0, rows, F.linear(F.linear(x.index_select(0, rows), a), b) * scale)
            return out

        return add_updates
