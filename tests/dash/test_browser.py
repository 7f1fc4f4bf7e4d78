"""The dashboard in a real headless browser (Debian's chromium, driven by Playwright) while a real `jet up`
trains: every page loads without a console error, the curves gain points, an episode shows its decoded
conversation, a dead letter is requeued and another dropped from the page. With JET_DASH_SCREENSHOTS=DIR
the screenshots of the pages are written there (docs/dashboard.md's come from `JET_DASH_SCREENSHOTS=docs`)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
# Optimiser steps of the run: the curves need two at least, and the run must outlast the browser's visit
# (its end ends the dashboard too): on an idle machine 5 steps of the tiny model ended before the training
# page was opened. A screenshot run (JET_DASH_SCREENSHOTS) may ask for more with JET_DASH_STEPS and
# shoots the curves once they are all in.
STEPS = int(os.environ.get("JET_DASH_STEPS", "60"))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")]


def wait_for(fn, timeout: float, what: str, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log and log.is_file() else ""
            raise AssertionError(f"timed out waiting for {what}\n{tail}")
        time.sleep(0.25)


def write_config(tmp_path: Path) -> Path:
    from jet.config import default_config_path

    cfg = yaml.safe_load(default_config_path().read_text())
    cfg["run"] = "dash"
    cfg["runs_dir"] = str(tmp_path / "runs")
    cfg["models"][0]["path"] = str(tmp_path / ".jet" / "models" / "tiny")
    cfg["tasks"][0].update(concurrency=4, episode_timeout_s=120)  # CI machines are shared: give episodes time
    cfg["trainer"].update(steps=STEPS, checkpoint_every=2)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def write_study(root: Path) -> None:
    s = root / "staleness"
    s.mkdir(parents=True)
    rows = ["arm,seed,step,eval_reward"] + [f"{arm},{seed},{step},{base + 0.03 * seed + 0.002 * step:.4f}"
                                            for arm, base in (("ppo", 0.25), ("decoupled", 0.5))
                                            for seed in range(4) for step in (10, 20, 30)]
    (s / "results.csv").write_text("\n".join(rows) + "\n")
    (s / "decisions.jsonl").write_text('{"time": 1, "kind": "ask", "arm": "ppo"}\n'
                                       '{"time": 2, "kind": "verdict", "hypothesis": "H1", "verdict": "supported"}\n')
    (s / "report.md").write_text("# Staleness study\n\nH1 (decoupled beats ppo at staleness 4): supported.\n")


@pytest.fixture
def swarm(tmp_path):
    """A real `jet up` (embedded Redis, inference, env worker, trainer, dashboard) in tmp_path."""
    config = write_config(tmp_path)
    write_study(tmp_path / "studies")
    err = tmp_path / "up.err"
    env = {k: v for k, v in os.environ.items() if k not in ("JET_REDIS_URL", "JET_DASH_TOKEN")}
    with open(err, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "jet.cli", "up", "--config", str(config), "--no-live",
                                 "--dash-port", "0", "--run-dir", str(tmp_path / ".jet")], cwd=tmp_path, env=env,
                                stdout=subprocess.DEVNULL, stderr=f)
    try:
        text = lambda: err.read_text()
        url = wait_for(lambda: re.search(r"dashboard at (http://\S+/)", text()), 180, "the dashboard URL", err)[1]
        redis_url = re.search(r"embedded Redis at (redis://\S+)", text())[1]
        yield {"url": url, "redis_url": redis_url, "proc": proc, "err": err, "tmp": tmp_path}
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_the_pages_live_in_a_browser_while_jet_up_trains(swarm):
    import redis
    from playwright.sync_api import sync_playwright
    from transformers import AutoTokenizer

    from jet.keys import Keys

    shots = Path(os.environ.get("JET_DASH_SCREENSHOTS") or swarm["tmp"] / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    url, err, keys = swarm["url"], swarm["err"], Keys("dash")
    r = redis.Redis.from_url(swarm["redis_url"])
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1360, "height": 900})
        page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on("response", lambda res: problems.append(f"HTTP {res.status} {res.url}") if res.status >= 400 else None)
        try:
            # -- swarm: streams, groups, workers; a dead letter requeued, then one dropped, from the page
            page.goto(url + "#/swarm")
            page.wait_for_selector("text=tasks:guess", timeout=60_000)
            wait_for(lambda: r.xlen(keys.traj("tiny")) > 0, 240, "the first trajectory", err)
            page.wait_for_selector("td:text-is('trainer')", timeout=60_000)
            # poison on gen:tiny, which the inference worker reads at once (tasks:guess has a backlog)
            garbage = r.xadd(keys.gen("tiny"), {b"junk": b"not a request"}).decode()
            row = page.wait_for_selector("tr[data-id]:has-text('no schema version')", timeout=60_000)
            dead_id = row.get_attribute("data-id")
            page.screenshot(path=str(shots / "dash-swarm.png"), full_page=True)
            page.click(f"tr[data-id='{dead_id}'] button.requeue")
            page.wait_for_selector("#notice:has-text('requeued 1 dead letter')", timeout=20_000)
            assert not r.xrange(keys.dead, dead_id, dead_id), "the dead letter left the dead stream"
            # The original, acked when it was dead-lettered, may already be trimmed from gen:tiny (the
            # reaper's safe trim); the copy is on gen:tiny, or the inference worker already read it and
            # dead-lettered it again (a new letter: the first one left the dead stream above).
            junk = [i.decode() for i, f in r.xrange(keys.gen("tiny")) if f == {b"junk": b"not a request"}]
            copies = [i for i in junk if i != garbage]
            assert copies or r.xlen(keys.dead) == 1, f"its entry is back on gen:tiny (junk there: {junk})"
            sid = lambda i: tuple(map(int, i.split("-")))  # noqa: E731
            assert all(sid(i) > sid(garbage) for i in copies), f"the copy is a new entry: {copies} vs {garbage}"
            again = page.wait_for_selector(f"tr[data-id]:not([data-id='{dead_id}']):has-text('no schema version')",
                                           timeout=60_000)  # the inference worker dead-letters the requeued copy
            page.click(f"tr[data-id='{again.get_attribute('data-id')}'] button.drop")
            page.wait_for_selector("#notice:has-text('dropped 1 dead letter')", timeout=20_000)
            assert r.xlen(keys.dead) == 0

            # -- training: the curves gain points as the trainer logs
            page.goto(url + "#/training")
            reward = ".chart[data-title='Reward']"
            points = lambda: int(page.get_attribute(reward, "data-points") or 0)
            wait_for(lambda: page.query_selector(reward) and points() > 0, 240, "a first reward point", err)
            first = points()
            wait_for(lambda: points() > first, 240, "the reward curve to gain points", err)
            if os.environ.get("JET_DASH_SCREENSHOTS"):
                # 2 series; all steps but the last, which ends the run (and the dashboard with it)
                wait_for(lambda: points() >= 2 * (STEPS - 1), 120 * STEPS, "the steps but the last", err)
            page.screenshot(path=str(shots / "dash-training.png"), full_page=True)

            # -- episodes: a list, then one episode with its conversation decoded from the token ids
            from jet.queues import codec
            from jet.wire import Trajectory

            # The trainer consumes trajectories as the run goes and the consumed ones are trimmed from
            # traj:tiny (every few seconds): the test reads the episode as soon as the page lists it, and
            # when it is already gone, reloads the page and takes its first row again.
            page.goto(url + "#/episodes")
            for _ in range(5):
                page.wait_for_selector("tr.click", timeout=30_000)
                page.screenshot(path=str(shots / "dash-episodes.png"), full_page=True)
                entry = page.get_attribute("tr.click", "data-id")
                if found := r.xrange(keys.traj("tiny"), entry, entry):
                    break
                page.reload()
            assert found, "every episode the page listed was trimmed before the test could read it"
            page.click(f"tr.click[data-id='{entry}']")
            page.wait_for_selector(".tokens .tok.m1", state="attached", timeout=30_000)
            shown = page.text_content(".tokens")
            traj = Trajectory.from_payload(codec.decode(found[0][1]))
            tok = AutoTokenizer.from_pretrained(swarm["tmp"] / ".jet" / "models" / "tiny")
            assert shown == tok.decode(list(traj.samples[0].tokens), skip_special_tokens=False)
            assert "<|im_start|>" in shown and "Guess a number" in shown
            assert page.query_selector_all(".tokens .tok.m0") and page.inner_text("dl.meta").count("code version")
            page.screenshot(path=str(shots / "dash-episode.png"), full_page=True)
            page.click("text=behaviour logprob")
            page.wait_for_selector(".tokens.lp .tok.m1[style*='background']", state="attached", timeout=10_000)
            page.screenshot(path=str(shots / "dash-episode-logprob.png"), full_page=True)

            # -- studies: a study folder's results, intervals per arm, decisions and report
            page.goto(url + "#/studies")
            page.click("td:text-is('staleness')")
            page.wait_for_selector("text=eval_reward: mean and 95% interval per arm", timeout=10_000)
            page.wait_for_selector("pre.report:has-text('supported')")
            page.screenshot(path=str(shots / "dash-studies.png"), full_page=True)
        finally:
            browser.close()
    assert not problems, problems
    proc = swarm["proc"]
    try:
        code = proc.wait(600)
    except subprocess.TimeoutExpired:
        logs = "".join(f"\n--- {f.name}\n" + f.read_text()[-1500:] for f in (swarm["tmp"] / "runs" / "dash" / "logs").glob("*.log"))
        raise AssertionError(f"jet up did not end:\n{err.read_text()[-2000:]}{logs}") from None
    assert code == 0, err.read_text()[-3000:]
    out = err.read_text()
    n = min(10, STEPS)
    assert re.search(rf"tiny: {STEPS} steps; reward first {n} steps [\d.]+, last {n} [\d.]+", out), out[-2000:]
    assert "plots: " in out and "dashboard was at " + url in out
