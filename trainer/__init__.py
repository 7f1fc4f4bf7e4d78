"""`jet.trainer`: the trainer of one model, `jet train`. It never imports `jet.workers`: the wire is the contract.

Read in this order: `loop` (the main loop and the exactly-once contract), `intake` + `groups` (GRPO
group assembly, staleness) + `lineage` (staleness across resumes) + `screen` + `guard` (the poison
policy), `batch` + `advantages` (advantages and loss weights), `packing` + `losses` + `step`
(micro-batches and the objective; `jet.sampling` defines the sampled distribution), `backend_torch` /
`backend_deepspeed` + `dist` (optimisation on one or N processes; `cli` launches N), `link` (the only door to
Redis), `weights`, `checkpoint`, `metrics`, `cli`.
"""
