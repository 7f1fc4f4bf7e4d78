"""The sampling distribution, defined once: what inference draws from and what the trainer recomputes.

What it is: pure tensor functions (torch imported inside) shared by the hf
inference backend (`jet.workers.inference.hf`) and the trainer
(`jet.trainer.losses`), which may not import each other. A completion token
drawn with temperature T > 0 and nucleus mass top_p is drawn from

    p_T   = softmax(logits / T)                               (float32 log_softmax)
    N     = the nucleus of p_T: every id whose probability is >= that of the last
            id kept when ids are taken in decreasing probability until the mass
            taken before it reaches top_p (ties are all kept; the whole
            vocabulary when top_p = 1)
    q(t)  = p_T(t) / sum_{i in N} p_T(i)   for t in N, else 0

and its behaviour logprob is log q(t): `log_softmax(logits / T)[t] - logsumexp`
of that log_softmax over N. The trainer evaluates the current weights under the
same q (the temperature of that token, the nucleus replayed on the current
logits), so on the weights that sampled it the ratio current/behaviour is 1 up
to float noise. The nucleus is found in float64 from the float32 log_softmax,
as the sampler does; the trainer always keeps the sampled token in its replay
(a token at the nucleus boundary can fall out by float noise in the logits).

What it is not: a sampler (the draw itself is `jet.workers.inference.hf._sample`)
and it knows nothing of greedy decoding: temperature 0 is handled by callers
(the sampler takes the argmax; `jet.timeline` never trains such tokens).
Top-k is not supported anywhere in Jet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MASK_CHUNK_ELEMENTS = 1 << 26  # float64 elements sorted at once when finding nuclei (512 MB)


def tempered_logprobs(logits: "torch.Tensor", temperature: "torch.Tensor") -> "torch.Tensor":
    """[N, V] logits, [N] temperatures (> 0) -> [N, V] float32 log_softmax(logits / T) (grads kept)."""
    import torch

    return torch.log_softmax(logits.float() / temperature.float()[:, None], dim=-1)


def nucleus_mask(logp: "torch.Tensor", top_p: "torch.Tensor", keep: "torch.Tensor | None" = None) -> "torch.Tensor":
    """[N, V] bool: the nucleus of each row of `logp` (float32 log-probabilities) at its `top_p` [N].

    Rows with top_p >= 1 keep the whole vocabulary. `keep` [N] (token ids)
    forces those ids in. Computed without grad, in chunks of rows.
    """
    import torch

    with torch.no_grad():
        mask = torch.ones(logp.shape, dtype=torch.bool, device=logp.device)
        rows = (top_p < 1).nonzero().flatten().tolist()
        step = max(1, MASK_CHUNK_ELEMENTS // max(1, logp.shape[-1]))
        for i in range(0, len(rows), step):
            idx = torch.tensor(rows[i:i + step], dtype=torch.long, device=logp.device)
            probs = logp.detach()[idx].double().exp()
            ordered = torch.sort(probs, dim=-1, descending=True).values
            before = torch.cumsum(ordered, dim=-1) - ordered
            kept = (before < top_p[idx].double()[:, None]).sum(-1).clamp(min=1)
            floor = ordered.gather(-1, (kept - 1)[:, None])
            mask[idx] = probs >= floor
        if keep is not None:
            mask[torch.arange(len(keep), device=logp.device), keep] = True
    return mask


def renormalised(logp: "torch.Tensor", tokens: "torch.Tensor", top_p: "torch.Tensor",
                 mask: "torch.Tensor") -> "torch.Tensor":
    """[N] log q(token): logp[token], minus the log of the nucleus mass on rows with top_p < 1. Grads kept.

    Rows at top_p = 1 are exactly log_softmax(logits / T)[token] (no logsumexp
    over a full mask, which would add float noise).
    """
    import torch

    out = logp.gather(-1, tokens[:, None])[:, 0]
    rows = (top_p < 1).nonzero().flatten()
    if rows.numel() == 0:
        return out
    sub = logp[rows]
    mass = torch.logsumexp(sub.masked_fill(~mask[rows], float("-inf")), dim=-1)
    return out - torch.zeros_like(out).index_copy(0, rows, mass)


def sampled_logprobs(logits: "torch.Tensor", tokens: "torch.Tensor", temperature: "torch.Tensor",
                     top_p: "torch.Tensor") -> "torch.Tensor":
    """[N] float32 log q(token) of each row of `logits` [N, V] under its own (temperature, top_p) [N].

    The trainer's side of the definition: the sampled token is kept in the
    replayed nucleus. Gradients flow through the logits (the mask is constant).
    """
    logp = tempered_logprobs(logits, temperature)
    if not bool((top_p < 1).any()):
        return logp.gather(-1, tokens[:, None])[:, 0]
    return renormalised(logp, tokens, top_p, nucleus_mask(logp, top_p, keep=tokens))
