"""`jet bench trl`: Jet against TRL's GRPOTrainer on the same model, task, settings and wall-clock budget.

What it is: the arms of `jet.bench.trl_arms` (`jet`: Jet as a user gets it; `jet-flat`: Jet with one
training sample per LLM call; `trl`: TRL's GRPOTrainer; `jet-lora`: `jet` training a LoRA adapter at
`--lora-lr`), each trained for `--budget-s` seconds from its launch, `--repeats` times in alternating
order (repeat 1: jet, jet-flat, trl; repeat 2: trl, jet-flat, jet; ...), so a machine that slows down
during the bench weighs on every arm alike. Repeat r runs every arm with seed `--seed` + r (the rows'
order, TRL's sampling, the adapter's initial weights): the comparison is paired by seed. Every setting
the sides share comes from one `Shared` (`jet.bench.trl_arms`); what they cannot share is listed
(`UNMATCHED`); jet-lora's adapter settings are Jet's alone (`Lora`).

Time to accuracy (`jet.bench.trl_curves`): while a run is timed, its weights are kept at marks every
`--mark-every-s` seconds (Jet: the version published by then; TRL: a callback); after every run, the base
model and every mark are evaluated greedily on the same held-out rows (`jet.eval.evaluate`; multi-turn
tasks play their dialogues), so no evaluation perturbs a timed run.

Reported: each run (its order and seed, trajectories per minute, completion / forwarded / prefilled
tokens per trajectory, reward curve, peak RSS, the load average while it ran, its accuracy curve); per
arm the means; the ratios jet/trl, jet/jet-flat, jet-lora/jet, ... of trajectories per minute per repeat,
their mean and a 95% t interval over repeats; time to accuracy per seed and over seeds (the time each
side took to reach TRL's final accuracy and the base plus half of TRL's gain, the accuracy at TRL's
budget and the area under the accuracy-against-time curve, each paired by seed: mean differences with t
intervals and Wilcoxon p over seeds, median time ratios with bootstrap intervals), per arm the mean curve
with a 95% band; and, as a second line, the held-out results at the budget against the base and between
arms with paired tests on the same rows (exact McNemar for 0/1 results, Wilcoxon signed-rank for
fractional ones; per row the mean over repeats); the torch / transformers / trl versions of both sides.
`--json` prints it all, `--out DIR` keeps the runs, logs, report.json and the PNGs.

What it is not: a study. The interval is over the repeats run here, on this machine.

TRL is the optional extra `compare`; it pins its own torch/transformers, so it usually lives in its own
venv: `python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 -e '.[compare]'`, then
`--trl-python .venv-trl/bin/python`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import click

from jet.bench import emit, progress, write_json
from jet.config import TrainerConfig, load
from jet.errors import ConfigError
from jet.stats import mean_interval, rows_paired
from jet.bench.trl_arms import ARMS, LORA_LR_FACTOR, MAPPING, Lora, Shared, jet_config, run_arm, write_rows

def order_of(arms: list[str], repeat: int) -> list[str]:
    """Repeat 0 runs the arms in order, repeat 1 reversed, and so on."""
    return list(arms) if repeat % 2 == 0 else list(reversed(arms))


# ---- the bench


RUN_FILE = "run.json"  # a finished run's report, written before anything after it can fail


def finished_run(folder: Path) -> dict | None:
    """The report a finished run left in `folder` (`--resume`), or None: it must run (again)."""
    try:
        return json.loads((folder / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None


def trl_interpreter(given: str | None) -> tuple[str | None, str | None]:
    """(python that has trl, None) or (None, why the TRL arm is skipped)."""
    if given:
        probe = subprocess.run([given, "-P", "-c", "import trl, transformers, jet.bench.trl_side"],
                               capture_output=True, text=True)
        if probe.returncode:
            raise click.ClickException(f"--trl-python {given}: cannot import trl, transformers and jet "
                                       f"({(probe.stderr.strip().splitlines() or ['?'])[-1]})")
        return given, None
    if importlib.util.find_spec("trl") is None:
        return None, ("trl is not importable here and --trl-python was not given (python3 -m venv .venv-trl && "
                      ".venv-trl/bin/pip install torch==2.13.0 -e '.[compare]')")
    return sys.executable, None


def versions_of(python: str) -> dict:
    code = ("import json, torch, transformers\ntry:\n import trl; v = trl.__version__\nexcept ImportError:\n v = None\n"
            "print(json.dumps({'torch': torch.__version__, 'transformers': transformers.__version__, 'trl': v}))")
    out = subprocess.run([python, "-P", "-c", code], capture_output=True, text=True)
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr.strip()[-200:]}


UNMATCHED = {  # setting: (Jet, TRL), printed as the difference between the sides
    "staleness": ("asynchronous: a trajectory may be up to max_staleness versions old, decoupled objective "
                  "(trainer.objective) with a capped importance weight", "on-policy: each step trains on "
                  "completions of the current weights (num_iterations=1), the PPO ratio is 1"),
    "advantage eps": ("(r - mean) / (std + 1e-6) (trainer/advantages.py)", "(r - mean) / (std + 1e-4)"),
    "training rows": ("the rows file in the feeder's order", "the rows file shuffled by the sampler"),
    "generation": ("inference worker, continuous batching with prefix reuse (workers/inference/hf_engine.py)",
                   "transformers generate (or generate_batch), the whole prompt prefilled every turn"),
    "episode token budget": ("max_tokens per model turn", "max_tokens per turn, and max_completion_length over "
                             "the whole episode (trl_side.completion_budget)"),
    "top_p below 1": ("the trainer's logprobs renormalised over the sampled nucleus (jet.sampling)",
                      "the trainer's logprobs at the temperature alone: the updates differ (the bench keeps top_p 1)"),
    "seeded sampling": ("each inference request samples from fresh entropy (which version generates which episode "
                        "depends on timing anyway)", "sampling seeded by the repeat's seed"),
}


def summarise(runs: list[dict], base: dict, arms: list[str]) -> dict:
    """Per-arm means, ratios per repeat with intervals, paired held-out tests (per row: mean over repeats)."""
    by_arm = {a: [r for r in runs if r["arm"] == a] for a in arms}
    keys = ("steps", "first_step_s", "trajectories_per_min", "steady_trajectories_per_min",
            "completion_tokens_per_trajectory", "forward_tokens_per_trajectory", "prefill_tokens_per_trajectory",
            "peak_rss_mib", "load_mean")
    arm_means = {a: {k: mean_interval([r[k] for r in rs if r.get(k) is not None]) for k in keys}
                 for a, rs in by_arm.items()}
    for a, rs in by_arm.items():
        arm_means[a]["heldout"] = mean_interval([r["eval"]["accuracy"] for r in rs])
    ratios = {}
    for num, den in [("jet", "trl"), ("jet", "jet-flat"), ("jet-flat", "trl"), ("jet-lora", "jet"),
                     ("jet-lora", "trl")]:
        if num in by_arm and den in by_arm:
            pairs = {k: [a[k] / b[k] for a, b in zip(by_arm[num], by_arm[den])
                         if a.get(k) is not None and b.get(k)]
                     for k in ("trajectories_per_min", "forward_tokens_per_trajectory",
                               "prefill_tokens_per_trajectory")}
            ratios[f"{num}/{den}"] = {k: {"per_repeat": v, **mean_interval(v)} for k, v in pairs.items() if v}
    per_row = {a: [sum(col) / len(col) for col in zip(*[r["eval"]["results"] for r in rs])]
               for a, rs in by_arm.items() if rs}
    tests = {f"{a}_vs_base": rows_paired(base["results"], per_row[a]) for a in per_row}
    for x, y in [("trl", "jet"), ("jet-flat", "jet"), ("trl", "jet-flat"), ("jet", "jet-lora")]:
        if x in per_row and y in per_row:
            tests[f"{y}_vs_{x}"] = rows_paired(per_row[x], per_row[y])
    return {"arms": arm_means, "ratios": ratios, "paired": tests}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colours = {"jet": "C0", "jet-flat": "C2", "trl": "C1", "jet-lora": "C3"}
    for run in report["runs"]:
        if not run["reward_curve"]:
            continue
        t, r = zip(*run["reward_curve"])
        ax1.plot(t, r, ".-", color=colours.get(run["arm"]), alpha=0.7,
                 label=run["arm"] if run["repeat"] == 0 else None)
    names = list(report["summary"]["arms"])
    held = [report["summary"]["arms"][a]["heldout"] for a in names]
    ax2.bar(names, [h["mean"] for h in held], color=[colours.get(a) for a in names])
    for i, h in enumerate(held):
        if h["ci95"]:
            ax2.errorbar([i], [h["mean"]], yerr=[[h["mean"] - h["ci95"][0]], [h["ci95"][1] - h["mean"]]],
                         color="k", capsize=4)
    ax2.axhline(report["base"]["accuracy"], color="grey", ls="--", label="base")
    ax1.set(xlabel="wall time since launch (s)", ylabel="mean reward per step", title="training reward")
    ax2.set(ylabel="greedy held-out result", title=f"held-out ({report['repeats']} repeats, 95% CI)")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(report: dict):
    from rich.console import Group
    from rich.table import Table

    summary = report["summary"]
    t = Table(title=f"jet bench trl: {report['task']} on {Path(report['model']).name}, "
                    f"{report['budget_s']:.0f} s per run, {report['repeats']} repeats")
    t.add_column("")
    for arm in summary["arms"]:
        t.add_column(arm, justify="right")

    def fmt(v, f="{:.1f}"):
        return "-" if v is None or v.get("mean") is None else f.format(v["mean"])

    for label, key, f in [("optimiser steps", "steps", "{:.1f}"), ("first step (s after launch)", "first_step_s", "{:.0f}"),
                          ("trajectories/min", "trajectories_per_min", "{:.1f}"),
                          ("after the first step", "steady_trajectories_per_min", "{:.1f}"),
                          ("completion tokens/trajectory", "completion_tokens_per_trajectory", "{:.1f}"),
                          ("trainer forward tokens/trajectory", "forward_tokens_per_trajectory", "{:.0f}"),
                          ("prefill tokens/trajectory", "prefill_tokens_per_trajectory", "{:.0f}"),
                          ("held-out result", "heldout", "{:.3f}"), ("peak RSS (MiB)", "peak_rss_mib", "{:.0f}"),
                          ("load average", "load_mean", "{:.2f}")]:
        t.add_row(label, *[fmt(m.get(key), f) for m in summary["arms"].values()])
    lines = []
    for pair, values in summary["ratios"].items():
        for key, v in values.items():
            ci = f", 95% CI {v['ci95'][0]:.2f}-{v['ci95'][1]:.2f}" if v["ci95"] else ""
            lines.append(f"{pair} {key}: {v['mean']:.2f}x{ci} (per repeat {[round(x, 2) for x in v['per_repeat']]})")
    lines += time_to_accuracy_lines(report)
    if report.get("jet_set"):
        lines.append(f"Jet arms' own settings (--jet-set): {', '.join(report['jet_set'])}")
    lines.append(f"base held-out: {report['base']['accuracy']:.3f} (95% CI {report['base']['ci95'][0]:.3f}-"
                 f"{report['base']['ci95'][1]:.3f}) on {report['base']['n']} rows")
    lines += [f"paired {k}: {v}" for k, v in summary["paired"].items()]
    lines += [f"run {r['repeat'] + 1}.{r['position'] + 1} {r['arm']}: {r['trajectories_per_min']:.1f} traj/min, "
              f"held-out {r['eval']['accuracy']:.3f}, load "
              f"{'-' if r.get('load_mean') is None else format(r['load_mean'], '.2f')}" for r in report["runs"]]
    lines += [f"unmatched {k}: jet {j}; trl {r}" for k, (j, r) in report["unmatched"].items()]
    if report.get("lora"):
        lines.append(f"jet-lora: adapter r {report['lora']['r']}, alpha {report['lora']['alpha']:g} on every linear "
                     f"layer, lr {report['lora']['lr']:g}")
    trl = [r for r in report["runs"] if r["arm"] == "trl" and r.get("micro_batches")]
    if trl:
        lines.append(f"trl micro-batches: {trl[0]['micro_batches']} ({trl[0].get('micro_batches_why')}); marks "
                     f"kept off TRL's clock: {max(r.get('excluded_s') or 0 for r in trl):.1f} s at most")
    lines += [f"versions: {report['versions']}", f"threads: {report['threads']}", *report.get("skipped", [])]
    return Group(t, "\n".join(lines))


def time_to_accuracy_lines(report: dict) -> list[str]:
    """The time-to-accuracy comparisons, a few lines each (over seeds; intervals 95%)."""
    def ci(v: dict) -> str:
        return f"95% CI {v['ci95'][0]:+.3f} to {v['ci95'][1]:+.3f}" if v.get("ci95") else "no interval"

    def share(v: dict) -> str:
        lo, hi = v.get("ci95") or (None, None)
        fmt = lambda x: "not reached" if x is None or x == math.inf else f"{x:.2f}"  # noqa: E731
        return f"{fmt(v.get('median'))} (95% CI {fmt(lo)} to {fmt(hi)})"

    out = []
    for name, c in (report.get("time_to_accuracy") or {}).items():
        if name == "bands" or not c.get("pairs"):
            continue
        arm = name.removesuffix("_vs_trl")
        out += [f"time to accuracy, {arm} vs trl over {c['pairs']} seeds:",
                f"  accuracy at TRL's budget, {arm} - trl: {c['final_diff']['mean']:+.3f} ({ci(c['final_diff'])}, "
                f"Wilcoxon p {c['final_diff']['wilcoxon_p']:.3g})",
                f"  area under accuracy-against-time, {arm} - trl: {c['area_diff']['mean']:+.3f} "
                f"({ci(c['area_diff'])}, Wilcoxon p {c['area_diff']['wilcoxon_p']:.3g})"]
        gained = c["pairs"] - c.get("no_gain", 0)
        if c.get("no_gain"):
            out.append(f"  {c['no_gain']} of {c['pairs']} seed(s) set apart from the times to a target: TRL ended "
                       "at or below the base, so no target lies above it")
        for target, words in (("final", "TRL's final accuracy"), ("half_gain", "base + half of TRL's gain")):
            if not gained:
                out.append(f"  time to {words}: undefined on every seed")
                continue
            out.append(f"  time to {words}: {arm} takes {share(c[f'time_share_of_budget_{target}'])} of the budget; "
                       f"{arm}/trl time {share(c[f'time_ratio_{target}'])} (median over {gained} seed(s); "
                       f"{c[f'not_reached_{target}']} not reached)")
    return out


@click.command("trl")
@click.option("--task", type=click.Choice(["add", "tally"]), default="add", show_default=True,
              help="A built-in task with a held-out split: add (one turn) or tally (four turns).")
@click.option("--arms", default=None, help=f"Comma-separated, of {', '.join(ARMS)} (default: jet,trl for add, "
                                           "jet,jet-flat,trl for tally).")
@click.option("--repeats", type=click.IntRange(1), default=4, show_default=True,
              help="Runs per arm, the order alternating from repeat to repeat; repeat r uses seed --seed + r.")
@click.option("--model", "model_spec", default="builtin:smollm2", show_default=True,
              help="Model folder, Hub id, or builtin:smollm2 (SmolLM2-135M-Instruct from the package index, "
                   "converted once).")
@click.option("--budget-s", type=click.FloatRange(min=1), default=600, show_default=True,
              help="Wall-clock seconds per run, from its launch to its stop.")
@click.option("--mark-every-s", type=click.FloatRange(min=1), default=None,
              help="Keep each run's weights every this many seconds for the accuracy curve (default: a tenth "
                   "of --budget-s); the budget's end is always a mark.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, ... (every arm and the evals).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the first repeat (rows' order, sampling, initial adapter); repeat r uses seed + r.")
@click.option("--eval-n", type=click.IntRange(1), default=100, show_default=True, help="Held-out rows evaluated.")
@click.option("--group-size", type=click.IntRange(2), default=8, show_default=True,
              help="Completions per prompt (TRL's num_generations).")
@click.option("--batch-groups", type=click.IntRange(1), default=4, show_default=True, help="Groups per optimiser step.")
@click.option("--lr", type=float, default=2e-5, show_default=True, help="AdamW learning rate (constant).")
@click.option("--lora-r", type=click.IntRange(1), default=16, show_default=True, help="The jet-lora arm's LoRA rank.")
@click.option("--lora-alpha", type=click.FloatRange(min=0, min_open=True), default=32.0, show_default=True,
              help="The jet-lora arm's LoRA alpha (updates scaled by alpha / r).")
@click.option("--lora-lr", type=click.FloatRange(min=0, min_open=True), default=None,
              help=f"The jet-lora arm's learning rate (default: {LORA_LR_FACTOR:g}x --lr; an adapter needs a higher "
                   "one than full training).")
@click.option("--max-tokens", type=click.IntRange(1), default=None,
              help="Completion tokens per model turn (default: the task's, 24 for add).")
@click.option("--temperature", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True)
@click.option("--max-staleness", type=click.IntRange(0), default=None,
              help="Jet's trainer.max_staleness (default: Jet's own default, as a user gets it; TRL is on-policy).")
@click.option("--jet-set", "jet_set", multiple=True, metavar="KEY=VALUE",
              help="A Jet-only config override for the Jet arms, e.g. trainer.skip_no_signal=true (not a setting "
                   "both sides share); repeatable, recorded in the report.")
@click.option("--jet-threads", type=click.IntRange(1), default=None,
              help="OMP_NUM_THREADS of each of jet up's two torch processes (default: half the cores each; TRL's one "
                   "process gets all of them).")
@click.option("--trl-python", default=None, help="A python with trl, torch and jet (default: this one if it has trl).")
@click.option("--trl-generation", type=click.Choice(["generate", "continuous"]), default="generate", show_default=True,
              help="TRL's generation: transformers generate, or its continuous batching "
                   "(use_transformers_continuous_batching).")
@click.option("--trl-micro-batches", type=click.IntRange(1), default=None,
              help="TRL's gradient accumulation steps per optimiser step (default: 1 on a single-turn task, "
                   "one per group on a multi-turn one, where the whole batch in one forward does not fit in 24 GB).")
@click.option("--out", "out_dir", default=None, help="Keep runs, logs, report.json and reward.png here.")
@click.option("--resume", is_flag=True,
              help="Continue an earlier invocation with the same --out and options: keep each run that finished "
                   "(its run.json), run only the missing ones; evaluations already made are reused either way.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def cli(task, arms, repeats, model_spec, budget_s, mark_every_s, device, seed, eval_n, group_size, batch_groups, lr,
        lora_r, lora_alpha, lora_lr, max_tokens, temperature, max_staleness, jet_set, jet_threads, trl_python,
        trl_generation, trl_micro_batches, out_dir, resume, as_json) -> None:
    """Jet against TRL's GRPOTrainer: same model, task, settings and wall-clock budget, repeated on paired seeds."""
    import dataclasses
    import tempfile

    from jet.bench import trl_curves
    from jet.sources import resolve_model
    from jet.tasks import held_out_task

    say = progress(as_json)
    out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="jet-bench-trl-"))
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_model(model_spec, "--model")
    model = str(Path(model).expanduser().resolve()) if Path(model).expanduser().is_dir() else model
    marks = trl_curves.mark_times(budget_s, mark_every_s or budget_s / 10)
    held = held_out_task(task)
    chosen = [a.strip() for a in arms.split(",")] if arms else (["jet", "trl"] if task == "add"
                                                                else ["jet", "jet-flat", "trl"])
    unknown = [a for a in chosen if a not in ARMS]
    if unknown:
        raise click.BadParameter(f"unknown arm(s) {unknown}; expected some of {list(ARMS)}", param_hint="--arms")
    s = Shared(task=task, group_size=group_size, batch_groups=batch_groups, lr=lr, temperature=temperature,
               max_tokens=max_tokens or held.max_tokens, max_turns=held.turns,
               seed=seed, device=device)
    lora = Lora(r=lora_r, alpha=lora_alpha, lr=lora_lr if lora_lr is not None else LORA_LR_FACTOR * lr)
    for arm in chosen:  # a bad --jet-set fails here, naming its key, not in the first run's jet up
        if arm != "trl":
            try:
                load(jet_config(s, arm, model, out / "rows.jsonl", out, max_staleness, lora, jet_set))
            except ConfigError as e:
                raise click.BadParameter(str(e), param_hint="--jet-set") from None
    from jet.cli.up import cpu_count

    cores = cpu_count()  # the cores this process may use, as jet up counts them for its thread shares
    threads = {"cores": cores, "jet_per_process": jet_threads or max(1, cores // 2), "trl": cores,
               "note": "OMP_NUM_THREADS of each torch process: TRL is one process with all cores; "
                       "jet up's inference worker and trainer split them"}
    python, skipped = trl_interpreter(trl_python) if "trl" in chosen else (None, None)
    if python is None and "trl" in chosen:
        chosen.remove("trl")
    runs = []
    for repeat in range(repeats):
        sr = dataclasses.replace(s, seed=seed + repeat)  # every arm of this repeat: the same seed
        rows = write_rows(sr, out / f"rows-seed{sr.seed}.jsonl")
        for position, arm in enumerate(order_of(chosen, repeat)):
            folder = out / f"r{repeat + 1}-{arm}"
            run = finished_run(folder) if resume else None
            if run is None:
                run = run_arm(arm, sr, model, rows, folder, budget_s, threads=threads, max_staleness=max_staleness,
                              trl_python=python, generation=trl_generation, say=say, lora=lora, marks_s=marks,
                              micro_batches=trl_micro_batches, jet_set=jet_set)
                write_json(folder / RUN_FILE, run)
            else:
                say(f"{arm} (repeat {repeat + 1}): kept from {folder / RUN_FILE}")
            runs.append({"arm": arm, "repeat": repeat, "position": position, "seed": sr.seed, **run})
    runs.sort(key=lambda r: (r["repeat"], r["position"]))
    base = trl_curves.evaluate_marks(model, runs, task, eval_n, device, s.max_tokens, say, cache=out / "evals")
    versions = {"jet": versions_of(sys.executable), **({"trl": versions_of(python)} if python else {})}
    report = {"model": model, "task": task, "shared": s.as_dict(), "mapping": MAPPING, "budget_s": budget_s,
              "repeats": repeats, "seeds": [seed + r for r in range(repeats)], "marks_s": marks, "arms": chosen,
              "max_staleness": TrainerConfig().max_staleness if max_staleness is None else max_staleness,
              "jet_set": list(jet_set),
              "threads": threads,
              "lora": lora.as_dict() if "jet-lora" in chosen else None,
              "trl_generation": trl_generation, "versions": versions, "runs": runs, "base": base,
              "summary": summarise(runs, base, chosen), "unmatched": UNMATCHED,
              "time_to_accuracy": {"bands": trl_curves.bands(runs, chosen),
                                   **{f"{a}_vs_trl": trl_curves.compare(runs, base, a, budget_s)
                                      for a in chosen if a != "trl" and "trl" in chosen}},
              "skipped": [f"trl arm skipped: {skipped}"] if skipped else []}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    for name, draw in (("reward.png", plot), ("accuracy.png", trl_curves.plot)):
        try:
            draw(report, out / name)
            report.setdefault("plots", []).append(str(out / name))
        except Exception as e:  # noqa: BLE001 - a plot that fails must not hide the numbers
            say(f"{name} not written: {e}")
    report["out"] = str(out)
    emit(report, as_json, table)
