"""`jet eval --model PATH_OR_ID --task NAME [--n 100] [--json]`: greedy accuracy on a task's held-out problems.

The command only; what it runs lives in `jet.eval` (no click there): the model loaded as an inference
worker loads it, the task's held-out rows played and scored (`jet.eval.evaluate`), the mean with a 95%
interval. With `--json` the whole report, each row's result included, in eval order.
"""

from __future__ import annotations

import click

from jet.errors import ConfigError


@click.command("eval")
@click.option("--model", "spec", required=True,
              help="A model folder, a Hub id (owner/name[@revision]), or runs/<run>/weights/<model>/v<N>.")
@click.option("--task", default="add", show_default=True, help="A built-in task with an evaluation split.")
@click.option("--n", type=click.IntRange(1), default=100, show_default=True, help="Evaluation rows.")
@click.option("--seed", type=int, default=0, show_default=True, help="Which evaluation rows (their order).")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:1, ...")
@click.option("--batch", type=click.IntRange(1), default=16, show_default=True, help="Prompts generated at once.")
@click.option("--max-tokens", type=click.IntRange(1), default=None,
              help="Completion tokens per turn (default: the task's MAX_TOKENS, else 24).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (with each row's 0/1).")
def cli(spec, task, n, seed, device, batch, max_tokens, as_json) -> None:
    """Greedy accuracy (mean reward) of a model on a task's held-out problems, with a 95% interval."""
    import orjson

    from jet.eval import evaluate

    try:
        report = evaluate(spec, task, n, seed=seed, device=device, batch=batch, max_tokens=max_tokens)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        return
    lo, hi = report["ci95"]
    click.echo(f"{report['model']} on {task}: {report['correct']:g}/{report['n']} = {report['accuracy']:.3f} "
               f"(95% CI {lo:.3f}-{hi:.3f}), greedy, {report['seconds']:.0f} s")
