"""`jet bench trl`: Jet against TRL's GRPOTrainer on the same model, task, settings and wall-clock budget.

What it is: the arms of `jet.bench.trl_arms` (`jet`: Jet as a user gets it; `jet-flat`: Jet with one
training sample per LLM call; `trl`: TRL's GRPOTrainer; `jet-lora`: `jet` training a LoRA adapter at
`--lora-lr`), each trained for `--budget-s` seconds from its launch, `--repeats` times in alternating
order (repeat 1: jet, jet-flat, trl; repeat 2: trl, jet-flat, jet; ...), so a machine that slows down
during the bench weighs on every arm alike. Every setting the sides share comes from one `Shared`
(`jet.bench.trl_arms`); what they cannot share is listed (`UNMATCHED`); jet-lora's adapter settings are
Jet's alone (`Lora`). Then the base model and every run's final weights (jet-lora's: its adapter version
on the base) are evaluated greedily on the same held-out rows (`jet.eval.evaluate`; multi-turn tasks
play their dialogues).

Reported: each run (its order, trajectories per minute, completion / forwarded / prefilled tokens per
trajectory, reward curve, peak RSS, the load average while it ran, held-out result); per arm the means;
the ratios jet/trl, jet/jet-flat, jet-lora/jet, ... of trajectories per minute per repeat, their mean
and a 95% t interval over repeats; held-out results against the base and between arms with paired tests
on the same rows (exact McNemar for 0/1 results, Wilcoxon signed-rank for fractional ones; per row the
mean over repeats); the torch / transformers / trl versions of both sides. `--json` prints it all,
`--out DIR` keeps the runs, logs, report.json and a PNG.

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

from jet.bench import emit, progress
from jet.bench.trl_arms import ARMS, LORA_LR_FACTOR, MAPPING, Lora, Shared, run_arm, write_rows
from jet.convert import SMOLLM2_WHEEL

# ---- statistics


def sign_test(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value: the binomial(b + c, 1/2) sign test on the discordant pairs."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired(x: list[float], y: list[float]) -> dict:
    """A paired test of per-row results of the same rows: McNemar when every result is 0/1 (b = x right y
    wrong, c = x wrong y right), else Wilcoxon signed-rank on y - x."""
    if len(x) != len(y):
        raise ValueError(f"paired results differ in length ({len(x)} vs {len(y)})")
    if all(v in (0, 1) for v in (*x, *y)):
        b = sum(1 for i, j in zip(x, y) if i and not j)
        c = sum(1 for i, j in zip(x, y) if j and not i)
        return {"test": "mcnemar", "x_only": b, "y_only": c, "p": sign_test(b, c)}
    from jet.study.stats import wilcoxon_p

    diffs = [j - i for i, j in zip(x, y)]
    return {"test": "wilcoxon", "mean_diff": sum(diffs) / len(diffs), "p": wilcoxon_p(diffs)}


def mean_interval(values: list[float]) -> dict:
    """Mean and 95% t interval (None with fewer than two values)."""
    n = len(values)
    mean = sum(values) / n if n else None
    if n < 2:
        return {"mean": mean, "ci95": None, "n": n}
    from scipy import stats

    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    return {"mean": mean, "ci95": [mean - half, mean + half], "n": n}


def order_of(arms: list[str], repeat: int) -> list[str]:
    """Repeat 0 runs the arms in order, repeat 1 reversed, and so on."""
    return list(arms) if repeat % 2 == 0 else list(reversed(arms))


# ---- the bench


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


def default_model(cache: Path) -> str:
    """SmolLM2-135M-Instruct as a float32 folder: the package-index wheel's GGUF, converted once (jet/convert.py)."""
    from jet.convert import smollm2

    return str(smollm2(cache)[1])


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
}


def evaluate_all(model: str, runs: list[dict], s: Shared, eval_n: int, say) -> dict:
    """Greedy results of the base model and of every run's weights on the same `eval_n` held-out rows."""
    from jet.eval import evaluate

    def one(spec: str, name: str) -> dict:
        say(f"eval: {name} on {eval_n} held-out rows")
        r = evaluate(spec, s.task, eval_n, device=s.device, max_tokens=s.max_tokens)
        return {k: r[k] for k in ("n", "correct", "accuracy", "ci95", "results", "seconds")}

    base = one(model, "base")
    for run in runs:
        run["eval"] = one(run["weights"], f"{run['arm']} (repeat {run['repeat'] + 1})")
    return base


def summarise(runs: list[dict], base: dict, arms: list[str]) -> dict:
    """Per-arm means, ratios per repeat with intervals, paired held-out tests (per row: mean over repeats)."""
    by_arm = {a: [r for r in runs if r["arm"] == a] for a in arms}
    keys = ("trajectories_per_min", "steady_trajectories_per_min", "completion_tokens_per_trajectory",
            "forward_tokens_per_trajectory", "prefill_tokens_per_trajectory", "peak_rss_mib", "load_mean")
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
    tests = {f"{a}_vs_base": paired(base["results"], per_row[a]) for a in per_row}
    for x, y in [("trl", "jet"), ("jet-flat", "jet"), ("trl", "jet-flat"), ("jet", "jet-lora")]:
        if x in per_row and y in per_row:
            tests[f"{y}_vs_{x}"] = paired(per_row[x], per_row[y])
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

    for label, key, f in [("trajectories/min", "trajectories_per_min", "{:.1f}"),
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
    lines.append(f"base held-out: {report['base']['accuracy']:.3f} (95% CI {report['base']['ci95'][0]:.3f}-"
                 f"{report['base']['ci95'][1]:.3f}) on {report['base']['n']} rows")
    lines += [f"paired {k}: {v}" for k, v in summary["paired"].items()]
    lines += [f"run {r['repeat'] + 1}.{r['position'] + 1} {r['arm']}: {r['trajectories_per_min']:.1f} traj/min, "
              f"held-out {r['eval']['accuracy']:.3f}, load {r['load_mean']:.2f}" for r in report["runs"]]
    lines += [f"unmatched {k}: jet {j}; trl {r}" for k, (j, r) in report["unmatched"].items()]
    if report.get("lora"):
        lines.append(f"jet-lora: adapter r {report['lora']['r']}, alpha {report['lora']['alpha']:g} on every linear "
                     f"layer, lr {report['lora']['lr']:g}")
    lines += [f"versions: {report['versions']}", f"threads: {report['threads']}", *report.get("skipped", [])]
    return Group(t, "\n".join(lines))


@click.command("trl")
@click.option("--task", type=click.Choice(["add", "tally"]), default="add", show_default=True,
              help="A built-in task with a held-out split: add (one turn) or tally (four turns).")
@click.option("--arms", default=None, help=f"Comma-separated, of {', '.join(ARMS)} (default: jet,trl for add, "
                                           "jet,jet-flat,trl for tally).")
@click.option("--repeats", type=click.IntRange(1), default=1, show_default=True,
              help="Runs per arm, the order alternating from repeat to repeat.")
@click.option("--model", "model_spec", default=None,
              help=f"Model folder or Hub id. Default: {SMOLLM2_WHEEL}'s SmolLM2-135M-Instruct, converted once "
                   "into --cache.")
@click.option("--cache", default="~/.cache/jet-bench/smollm2", show_default=True, help="Where the default model goes.")
@click.option("--budget-s", type=click.FloatRange(min=1), default=600, show_default=True,
              help="Wall-clock seconds per run, from its launch to its stop.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, ... (every arm and the evals).")
@click.option("--seed", type=int, default=0, show_default=True, help="Training seed of every arm.")
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
@click.option("--max-staleness", type=click.IntRange(0), default=1, show_default=True,
              help="Jet's trainer.max_staleness (TRL is on-policy).")
@click.option("--jet-threads", type=click.IntRange(1), default=None,
              help="OMP_NUM_THREADS of each of jet up's two torch processes (default: half the cores each; TRL's one "
                   "process gets all of them).")
@click.option("--trl-python", default=None, help="A python with trl, torch and jet (default: this one if it has trl).")
@click.option("--trl-generation", type=click.Choice(["generate", "continuous"]), default="generate", show_default=True,
              help="TRL's generation: transformers generate, or its continuous batching "
                   "(use_transformers_continuous_batching).")
@click.option("--out", "out_dir", default=None, help="Keep runs, logs, report.json and reward.png here.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def cli(task, arms, repeats, model_spec, cache, budget_s, device, seed, eval_n, group_size, batch_groups, lr,
        lora_r, lora_alpha, lora_lr, max_tokens, temperature, max_staleness, jet_threads, trl_python, trl_generation,
        out_dir, as_json) -> None:
    """Jet against TRL's GRPOTrainer: same model, task, settings and wall-clock budget, repeated."""
    import tempfile

    import jet.eval

    say = progress(as_json)
    out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="jet-bench-trl-"))
    out.mkdir(parents=True, exist_ok=True)
    model = model_spec or default_model(Path(cache).expanduser())
    model = str(Path(model).expanduser().resolve()) if Path(model).expanduser().is_dir() else model
    module = jet.eval.task_module(task)
    chosen = [a.strip() for a in arms.split(",")] if arms else (["jet", "trl"] if task == "add"
                                                                else ["jet", "jet-flat", "trl"])
    unknown = [a for a in chosen if a not in ARMS]
    if unknown:
        raise click.BadParameter(f"unknown arm(s) {unknown}; expected some of {list(ARMS)}", param_hint="--arms")
    s = Shared(task=task, group_size=group_size, batch_groups=batch_groups, lr=lr, temperature=temperature,
               max_tokens=max_tokens or getattr(module, "MAX_TOKENS", 24), max_turns=getattr(module, "TURNS", 1),
               seed=seed, device=device)
    lora = Lora(r=lora_r, alpha=lora_alpha, lr=lora_lr if lora_lr is not None else LORA_LR_FACTOR * lr)
    from jet.cli.up import cpu_count

    cores = cpu_count()  # the cores this process may use, as jet up counts them for its thread shares
    threads = {"cores": cores, "jet_per_process": jet_threads or max(1, cores // 2), "trl": cores,
               "note": "OMP_NUM_THREADS of each torch process: TRL is one process with all cores; "
                       "jet up's inference worker and trainer split them"}
    python, skipped = trl_interpreter(trl_python) if "trl" in chosen else (None, None)
    if python is None and "trl" in chosen:
        chosen.remove("trl")
    rows = write_rows(s, out / "rows.jsonl")
    runs = []
    for repeat in range(repeats):
        for position, arm in enumerate(order_of(chosen, repeat)):
            run = run_arm(arm, s, model, rows, out / f"r{repeat + 1}-{arm}", budget_s, threads=threads,
                          max_staleness=max_staleness, trl_python=python, generation=trl_generation, say=say,
                          lora=lora)
            runs.append({"arm": arm, "repeat": repeat, "position": position, **run})
    runs.sort(key=lambda r: (r["repeat"], r["position"]))
    base = evaluate_all(model, runs, s, eval_n, say)
    versions = {"jet": versions_of(sys.executable), **({"trl": versions_of(python)} if python else {})}
    report = {"model": model, "task": task, "shared": s.as_dict(), "mapping": MAPPING, "budget_s": budget_s,
              "repeats": repeats, "arms": chosen, "max_staleness": max_staleness, "threads": threads,
              "lora": lora.as_dict() if "jet-lora" in chosen else None,
              "trl_generation": trl_generation, "versions": versions, "runs": runs, "base": base,
              "summary": summarise(runs, base, chosen), "unmatched": UNMATCHED,
              "skipped": [f"trl arm skipped: {skipped}"] if skipped else []}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    try:
        plot(report, out / "reward.png")
        report["plot"] = str(out / "reward.png")
    except Exception as e:  # noqa: BLE001 - a plot that fails must not hide the numbers
        say(f"plot not written: {e}")
    report["out"] = str(out)
    emit(report, as_json, table)
