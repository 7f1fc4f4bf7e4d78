"""Adapter versions as the hf backend serves them: merged into the one model's weights, or added row by row.

What it is: the two ways `jet.workers.inference.hf.HFBackend` applies an adapter version (a `jet.adapters`
folder, what a trainer with `models[].adapter` publishes), behind one interface: `set(slot, adapter)`
serves a version on a slot from the next forward on, `select(slots, device)` says before each forward
which slot each row is, `nbytes()` is the memory held beside the base.
- `MergedAdapter(model)`: a backend serving one model. Each version is merged into the weights it updates
  (`jet.adapters.merged_weight`); the base's own values of those weights are kept aside the first time (a
  copy of the adapted layers only), so each version sets them to base + its update and versions never
  accumulate rounding. Every row sees the merged weights: `select` has nothing to do.
- `RowAdapters(model, slots)`: a backend serving several models on one base (a team of adapters of one
  base, `jet.config.serving_groups`). Merging would change the base every other model shares, so each
  slot's A and B are held beside it and each row's own update is added to the output of every adapted
  linear layer (a forward hook per layer): `y = base(x) + (x A^T) B^T * alpha / r`, in the order peft
  computes it while training (`jet.trainer.adapter`), so a slot's logprobs are what its trainer
  recomputes up to float noise. Rows of one slot are computed together. A slot without an adapter
  serves the base as it is. The cost is two thin matmuls per adapted layer and row group; the memory
  one base plus each adapter (~20 MB at r 16 on every projection of SmolLM2-135M), where one worker per
  model holds one base each.

What it is not: a file reader (`jet.adapters` reads and checks versions), a trainer (`jet.trainer.adapter`),
nor vLLM's way (`jet.workers.inference.vllm` hands versions to vLLM's own LoRA support).

Invariants: `set` changes nothing unless every adapted layer exists in the base with matching shapes
(else `AdapterError` naming the layer); only weight loads call `set`, under the engine's exclusive gate,
so no forward sees half a version.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jet import adapters
from jet.adapters import AdapterError

if TYPE_CHECKING:
    import torch


class MergedAdapter:
    """One model: each adapter version merged into the weights it updates."""

    def __init__(self, model):
        self.model = model
        self.base: dict[str, torch.Tensor] = {}  # the base's own values of the weights an adapter updates

    def set(self, slot: int, adapter: adapters.Adapter) -> None:
        """The weights `adapter` updates set to the base's + its update, those an earlier version updated and
        it does not back to the base's (`slot` is 0: there is one model)."""
        import torch

        live = self.model.state_dict()
        todo = adapters.updates(adapter, {name: tensor.shape for name, tensor in live.items()})  # checks all first
        adapted = {name for name, _, _ in todo}
        with torch.no_grad():  # layer by layer: no copy of the whole model is ever allocated at once
            for name in set(self.base) - adapted:
                live[name].copy_(self.base.pop(name))
            for name, a, b in todo:
                if name not in self.base:
                    self.base[name] = live[name].detach().clone()
                live[name].copy_(adapters.merged_weight(self.base[name], a, b, adapter.scale))

    def forget(self) -> None:
        """The weights were replaced whole (a full-weights version): there is no base to return to."""
        self.base = {}

    def keep_base_of(self, targets: list[str] | str) -> int:
        """Keep the base's own values of the weights adapter versions of `targets` ('all-linear': every linear
        layer but the output head; or module-name suffixes) will update, now: what the first version would
        copy, made at start so that version serves without the copy's cost (the memory is the same from the
        first version on). Returns the bytes kept."""
        import torch

        head = self.model.get_output_embeddings()
        kept = 0
        for name, module in self.model.named_modules():
            if not isinstance(module, torch.nn.Linear) or module is head:
                continue
            if targets != "all-linear" and not any(name == t or name.endswith(f".{t}") for t in targets):
                continue
            key = f"{name}.weight"
            if key not in self.base:
                self.base[key] = module.weight.detach().clone()
                kept += module.weight.numel() * module.weight.element_size()
        return kept

    def select(self, slots: list[int], device) -> None:
        """Nothing to do: every row sees the merged weights."""

    def nbytes(self) -> int:
        """Memory of the base's values kept aside (bytes)."""
        return sum(t.numel() * t.element_size() for t in self.base.values())


class RowAdapters:
    """Several models on one base: each slot's adapter added to its own rows, the base never changed."""

    def __init__(self, model, slots: int):
        self.model, self.slots = model, slots
        self.layers: dict[str, dict[int, tuple]] = {}  # module name -> slot -> (A, B, scale)
        self._hooks: dict[str, object] = {}
        self._groups: list[tuple[int, torch.Tensor | None]] = []  # (slot, its rows; None = every row)

    def set(self, slot: int, adapter: adapters.Adapter) -> None:
        """Serve `adapter` on `slot` from the next forward on (its previous adapter dropped)."""
        import torch

        modules = dict(self.model.named_modules())
        checked = {}
        for layer, (a, b) in adapters.pairs(adapter).items():
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
