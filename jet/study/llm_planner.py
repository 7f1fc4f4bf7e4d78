"""`planner: llm`: an OpenAI-compatible model proposes the next arms, and every proposal is checked.

What it is: `LLMPlanner.propose(runner, n)` sends the question, the space,
the hypotheses, the results so far (each arm's params, mean summary, seeds
and run statuses), the failures and the budget left to any OpenAI-compatible
chat endpoint (base URL and API key from the environment variables the
study file names) and asks for JSON: `{"arms": [{<config path>: value}],
"rationale": "..."}`. A proposal is accepted only if it parses, every arm
sets exactly the space's paths with values inside the space, is not an arm
already run, and the calls stay within `budget.max_planner_tokens`
(counted in Redis from the endpoint's reported usage, or estimated at 4
characters a token when it reports none). Anything else is refused, and the
runner falls back to the default sampler (`planner.fallback`); every call,
its rationale, and every refusal with its reason go to decisions.jsonl.

Safety: the model gets text and gives text. Nothing it returns is executed,
imported or used as a path; only values that are points of the declared
space reach a run's `--set`, and the endpoint sees only what the prompt says.

What it is not: a planner of its own; Optuna records every arm it proposes
(`Plan.ask(params)`), exactly like sampled ones.
"""

from __future__ import annotations

import json
import logging
import os
import re

from jet.study.analysis import summaries
from jet.study.spec import Study

log = logging.getLogger(__name__)

SYSTEM = ("You plan reinforcement-learning experiments. Propose the next configurations to run, as JSON only: "
          '{"arms": [{"<config path>": <value>, ...}], "rationale": "<one paragraph>"}. Every arm must set exactly '
          "the paths of the search space, to values inside it.")


def space_text(study: Study) -> dict:
    if study.arms is not None:
        return {"arms": study.arms}
    out = {}
    for k, p in study.space.items():
        out[k] = ({"choices": p.choices} if p.categorical else
                  {"low": p.low, "high": p.high, "log": p.log, "int": p.int_, **({"step": p.step} if p.step else {})})
    return out


def prompt(runner, n: int) -> str:
    s = runner.study
    sums = summaries(s, list(runner.arms.values()), list(runner.results.values()))
    arms = [{"params": a.params, "mean_summary": a.mean(), "seeds": len(a.values), "runs": a.statuses}
            for a in sums.values()]
    failures = [r for a in sums.values() for r in a.reasons]
    budget = {"runs_left": runner.runs_left(), "seeds_per_arm": len(s.seeds)}
    body = {"question": s.question, "metric": {"name": s.metric.name, "mode": s.metric.mode,
                                                "summary": s.metric.summary},
            "search_space": space_text(s),
            "hypotheses": [{"name": h.name, "statement": h.statement} for h in s.hypotheses],
            "arms_so_far": arms, "failures": failures, "budget": budget, "arms_wanted": n}
    return json.dumps(body, default=str)


def parse(text: str) -> dict:
    """The JSON object in a reply (a ```json fence or the first {...} span); ValueError otherwise."""
    fenced = re.search(r"```(?:json)?\s*(\{.*?\})\s*```", text, re.S)
    candidates = [fenced.group(1)] if fenced else []
    start, end = text.find("{"), text.rfind("}")
    if start >= 0 and end > start:
        candidates.append(text[start:end + 1])
    for c in candidates:
        try:
            data = json.loads(c)
        except ValueError:
            continue
        if isinstance(data, dict):
            return data
    raise ValueError("the reply holds no JSON object")


def normal(study: Study, arm: dict) -> dict:
    """Range values as the range's type (an int range gets ints, a float range floats)."""
    out = {}
    for k, v in arm.items():
        p = study.space.get(k)
        out[k] = v if p is None or p.categorical else (int(v) if p.int_ else float(v))
    return out


def validate(study: Study, data: dict, taken: list[dict], n: int) -> tuple[list[dict], str]:
    """(accepted arms, why the rest were refused)."""
    arms = data.get("arms")
    if not isinstance(arms, list) or not arms:
        return [], "no 'arms' list in the reply"
    good, why = [], []
    for i, arm in enumerate(arms):
        if not isinstance(arm, dict):
            why.append(f"arm {i} is not a mapping")
            continue
        if not study.contains(arm):
            why.append(f"arm {i} {arm} is off the space")
            continue
        arm = normal(study, arm)
        if arm in taken or arm in good:
            why.append(f"arm {i} {arm} was run already")
        elif len(good) >= n:
            why.append(f"arm {i} is more than the {n} asked for")
        else:
            good.append(arm)
    return good, "; ".join(why)


class LLMPlanner:
    def __init__(self, study: Study):
        self.study = study
        self.tokens_used = 0

    async def _spend(self, runner, tokens: int) -> int:
        self.tokens_used = int(await runner.r.hincrby(runner.keys.study_state, "planner_tokens", tokens))
        return self.tokens_used

    async def propose(self, runner, n: int) -> list[tuple[dict, str]]:
        """Up to `n` validated arms with the model's rationale; [] means: use the default sampler."""
        cfg, budget = self.study.planner.llm, self.study.budget.max_planner_tokens
        call = int(await runner.r.hincrby(runner.keys.study_state, "planner_calls", 1))
        self.tokens_used = int(await runner.r.hget(runner.keys.study_state, "planner_tokens") or 0)
        text = prompt(runner, n)
        estimate = (len(SYSTEM) + len(text)) // 4 + cfg.max_tokens
        decide = runner.decisions.log
        if self.tokens_used + estimate > budget:
            decide(f"llm:{call}", "planner_refused", why=f"planner token budget: {self.tokens_used} used + about "
                   f"{estimate} for this call > max_planner_tokens {budget}; the default sampler plans")
            return []
        base_url, key = os.environ.get(cfg.base_url_env), os.environ.get(cfg.api_key_env)
        if not base_url:
            decide(f"llm:{call}", "planner_refused", why=f"${cfg.base_url_env} is not set; the default sampler plans")
            return []
        import openai

        try:
            async with openai.AsyncOpenAI(base_url=base_url, api_key=key or "none", timeout=cfg.timeout_s,
                                          max_retries=1) as client:
                reply = await client.chat.completions.create(
                    model=cfg.model, max_tokens=cfg.max_tokens, temperature=0.0,
                    messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}])
        except openai.OpenAIError as e:
            await self._spend(runner, estimate)
            decide(f"llm:{call}", "planner_refused", tokens=estimate, why=f"the endpoint failed ({type(e).__name__}: {e}); "
                   "the default sampler plans")
            return []
        usage = getattr(reply, "usage", None)
        spent = int(getattr(usage, "total_tokens", 0) or 0) or estimate
        await self._spend(runner, spent)
        content = (reply.choices[0].message.content or "") if reply.choices else ""
        try:
            data = parse(content)
        except ValueError as e:
            decide(f"llm:{call}", "planner_refused", tokens=spent, reply=content[:500],
                   why=f"LLM proposal refused ({e}); the default sampler plans")
            return []
        good, why = validate(self.study, data, [a.params for a in runner.arms.values()], n)
        rationale = str(data.get("rationale", ""))[:2000]
        if not good:
            decide(f"llm:{call}", "planner_refused", tokens=spent, reply=content[:500],
                   why=f"LLM proposal refused ({why}); the default sampler plans")
            return []
        decide(f"llm:{call}", "planner", tokens=spent, arms=good, rationale=rationale, refused=why,
               why=f"LLM proposed {good}: {rationale[:200]}")
        return [(arm, rationale) for arm in good]
