"""`jet study`: long, resumable RL studies on Jet's own swarm, with statistically honest verdicts.

The parts, in the order a study flows through them:
- `spec` / `studyfile`: the study file (question, base config, space, seeds, metric, hypotheses,
  budget, planner, pruner), validated like a run config;
- `plan`: the arms, asked of Optuna (grid, TPE, GP, random) in a JSON-lines journal; `llm_planner`
  lets an OpenAI-compatible model propose arms, each validated against the space and the budget;
- `runner` (state in `state`, durable parts in `ledger`): launches runs (arm x seed) as messages on the
  study's run stream, prunes (`prune`), judges (`analysis`, `stats`), starts confirmation stages, and
  writes the report (`report`, `status`);
- `worker` / `execution` / `keeper`: study workers run each request as an ordinary `jet up` in its own
  run namespace and folder, stream its metrics back (`messages`) and commit its result with the ack.
Built-in studies live in `builtin/` (`jet study run builtin:staleness`).
"""
