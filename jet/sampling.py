"""The sampling distribution, defined once: its settings (`PARAMS`), what inference draws from and what
the trainer recomputes.

What it is: `PARAMS`, the one declaration of the settings that shape the distribution a completion token
is drawn from (temperature, top_p): each one's name, per-token column, neutral value and valid range.
Every carrier derives its handling from it: a request's fields are checked with `Param.error` (the
inference backends), copied with `settings_of` (the LLM client, the inference worker, the evaluator, the
gateway's calls log), offered on the gateway's request bodies, recorded per token in a `jet.timeline`
Sample column (`Param.column`), sent with the sample, packed into the trainer's rows, and recomputed
by `sampled_logprobs`. The hf sampler and the trainer share the math below (torch imported inside); they
may not import each other. A completion token drawn with temperature T > 0 and nucleus mass top_p is
drawn from

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

A setting either reshapes the logits (temperature: `transformed`) or narrows the
support, the draw then renormalised over what is kept (top_p: `support`); a new
one is a `PARAMS` entry and its line in one of those two functions.

What it is not: a sampler (the draw itself is `jet.workers.inference.hf_engine.sample_row`)
and it knows nothing of greedy decoding: temperature 0 is handled by callers
(the sampler takes the argmax, with every other setting at its neutral value:
`GREEDY`; `jet.timeline` never trains such tokens). Top-k is not supported
anywhere in Jet.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    import torch

MASK_CHUNK_ELEMENTS = 1 << 26  # float64 elements sorted at once when finding nuclei (512 MB)


@dataclass(frozen=True, slots=True)
class Param:
    """One setting of the sampling distribution (an entry of `PARAMS`)."""

    name: str  # the field of GenRequest, SamplingParams, Call and the OpenAI request body
    column: str  # the per-token column of a Sample (and the packed row's tensor) that records it
    neutral: float  # the default, at which it changes nothing; untrained tokens carry it
    low: float  # valid values: [low, high], or (low, high] with low_open; finite ones only
    high: float  # may be math.inf (no bound)
    low_open: bool = False
    api_high: float | None = None  # a lower upper bound that the OpenAI API sets (the gateway's)
    narrows: bool = False  # it cuts the support (the draw is renormalised over what is kept)

    @property
    def rule(self) -> str:
        if self.high == math.inf:
            return f"a finite number {'>' if self.low_open else '>='} {self.low:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"

    def ok(self, value: float) -> bool:
        """Whether a number is a valid setting (NaN and infinities never are)."""
        return (value > self.low if self.low_open else value >= self.low) and value <= self.high and value != math.inf

    def error(self, value: Any) -> str | None:
        """Why `value` is not a valid setting; None when it is."""
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        return None if number and self.ok(value) else f"{self.name} must be {self.rule}, got {value}"


PARAMS: tuple[Param, ...] = (
    Param("temperature", "temperatures", 1.0, 0.0, math.inf, api_high=2.0),  # 0 = greedy (never trained)
    Param("top_p", "top_ps", 1.0, 0.0, 1.0, low_open=True, narrows=True),  # the nucleus mass kept
)
NAMES: tuple[str, ...] = tuple(p.name for p in PARAMS)
BY_NAME: dict[str, Param] = {p.name: p for p in PARAMS}
NEUTRAL: dict[str, float] = {p.name: p.neutral for p in PARAMS}
GREEDY: dict[str, float] = {**NEUTRAL, "temperature": 0.0}  # what a greedy request is decoded with


def settings_of(obj: Any) -> dict[str, float]:
    """{name: value} of every setting of `obj` (a GenRequest, SamplingParams or Call: they carry them all)."""
    return {p.name: getattr(obj, p.name) for p in PARAMS}


def drawn_with(obj: Any) -> dict[str, float]:
    """The settings a request's tokens are drawn and scored with: its own, or all neutral when greedy
    (a greedy token's logprob is under temperature 1 and the whole vocabulary)."""
    return settings_of(obj) if obj.temperature else dict(NEUTRAL)


def errors(obj: Any) -> str | None:
    """The first invalid setting of `obj` (see `settings_of`), as a message; None when all are valid."""
    return next((e for p in PARAMS if (e := p.error(getattr(obj, p.name))) is not None), None)


def narrows(settings: Mapping[str, float]) -> bool:
    """Whether one token's settings cut the support (a nucleus smaller than the vocabulary)."""
    return any(settings.get(p.name, p.neutral) != p.neutral for p in PARAMS if p.narrows)


def table(rows: Sequence[Mapping[str, float]], device: Any = None) -> dict[str, "torch.Tensor"]:
    """{name: [N] float32 tensor} of the settings of N tokens (a missing setting: neutral)."""
    import torch

    return {p.name: torch.tensor([r.get(p.name, p.neutral) for r in rows], dtype=torch.float32, device=device)
            for p in PARAMS}


def special(settings: Mapping[str, "torch.Tensor"]) -> "torch.Tensor":
    """bool, shaped like the settings ({name: tensor}, at least one): tokens whose distribution is not plain
    softmax(logits), some setting not neutral."""
    return _off(settings, PARAMS)


def narrowed(settings: Mapping[str, "torch.Tensor"]) -> "torch.Tensor":
    """bool, shaped like the settings: rows whose support is cut (a `Param.narrows` setting not neutral)."""
    return _off(settings, tuple(p for p in PARAMS if p.narrows))


def _off(settings: Mapping[str, "torch.Tensor"], params: Sequence[Param]) -> "torch.Tensor":
    import torch

    first = next(iter(settings.values()))
    out = torch.zeros(first.shape, dtype=torch.bool, device=first.device)
    for p in params:
        if p.name in settings:
            out |= settings[p.name].to(first.device) != p.neutral
    return out


def transformed(logits: "torch.Tensor", settings: Mapping[str, "torch.Tensor"]) -> "torch.Tensor":
    """[N, V] float32 log-probabilities of the reshaped logits: every setting that is not a `Param.narrows`
    one, applied (grads kept). Today: the temperature."""
    return tempered_logprobs(logits, settings["temperature"])


def support(logp: "torch.Tensor", settings: Mapping[str, "torch.Tensor"],
            keep: "torch.Tensor | None" = None) -> "torch.Tensor":
    """[N, V] bool: the ids each row may draw (every `Param.narrows` setting's cut, intersected); `keep` [N]
    forces those ids in. Today: the top-p nucleus."""
    return nucleus_mask(logp, settings["top_p"], keep)


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


def renormalised(logp: "torch.Tensor", tokens: "torch.Tensor", cut: "torch.Tensor",
                 mask: "torch.Tensor") -> "torch.Tensor":
    """[N] log q(token): logp[token], minus the log of the support's mass on the rows `cut` ([N] bool, see
    `narrowed`; `mask` is the support). Grads kept.

    Rows not cut are exactly logp[token] (no logsumexp over a full mask, which
    would add float noise).
    """
    import torch

    out = logp.gather(-1, tokens[:, None])[:, 0]
    rows = cut.nonzero().flatten()
    if rows.numel() == 0:
        return out
    sub = logp[rows]
    mass = torch.logsumexp(sub.masked_fill(~mask[rows], float("-inf")), dim=-1)
    return out - torch.zeros_like(out).index_copy(0, rows, mass)


def sampled_logprobs(logits: "torch.Tensor", tokens: "torch.Tensor",
                     settings: Mapping[str, "torch.Tensor"]) -> "torch.Tensor":
    """[N] float32 log q(token) of each row of `logits` [N, V] under its own settings ({name: [N]}, a
    missing one neutral).

    The trainer's side of the definition: the sampled token is kept in the
    replayed support. Gradients flow through the logits (the mask is constant).
    """
    import torch

    full = {p.name: settings[p.name].to(logits.device) if p.name in settings
            else torch.full((len(tokens),), p.neutral, device=logits.device) for p in PARAMS}
    logp = transformed(logits, full)
    cut = narrowed(full)
    if not bool(cut.any()):
        return logp.gather(-1, tokens[:, None])[:, 0]
    return renormalised(logp, tokens, cut, support(logp, full, keep=tokens))
