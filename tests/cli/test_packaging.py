"""The repository's folders install as one namespace, `jet`, in both install modes; a wheel carries
the default config and the starter templates, so `jet up` trains from an empty folder after an install."""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = ("import jet, jet.queues.consumer, jet.workers, jet.trainer, jet.bench, jet.cli.main;"
         "print(jet.queues.consumer.__file__)")


@pytest.mark.slow
def test_editable_install_maps_top_level_folders():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                         cwd="/").stdout
    assert Path(out.strip()) == ROOT / "queues" / "consumer.py"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(ROOT)], check=True)
    [built] = out.glob("*.whl")
    return built


@pytest.mark.slow
def test_regular_wheel_install_imports_every_subpackage(tmp_path, wheel):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    str(wheel)], check=True)
    # -S without site-packages' editable finder: only the wheel's copy can be imported
    # (dependencies are added back from this venv's site-packages by path).
    deps = [p for p in sys.path if p.endswith("site-packages")]
    code = f"import sys; sys.path[:0] = [{str(target)!r}] + {deps!r}; {PROBE}"
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(target / "jet" / "queues"))


@pytest.mark.slow
def test_jet_up_from_an_empty_folder_after_a_wheel_install(tmp_path, wheel):
    # A fresh venv with only the wheel installed; its dependencies (torch...) come from this venv's
    # site-packages by a .pth line, which does not run this venv's editable-install hook.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "-q", str(wheel)], check=True)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("JET_REDIS_URL", "JET_CONFIG", "PYTHONPATH")}
    where = subprocess.run([str(python), "-c", "import jet.config as c; print(c.default_config_path())"],
                           cwd=empty, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where) == site / "jet" / "configs" / "default.yaml"  # the wheel's copy, not the checkout's
    res = subprocess.run([str(venv / "bin" / "jet"), "up", "--steps", "2", "--set", "trainer.batch_groups=2",
                          "--no-live"], cwd=empty, env=env, capture_output=True, text=True, timeout=500)
    assert res.returncode == 0, res.stderr[-3000:]
    # The model went to the folder jet ran in, never into the installed package.
    assert (empty / ".jet" / "models" / "tiny" / "config.json").is_file()
    assert not (site / "jet" / "configs" / ".jet").exists() and not (site / ".jet").exists()
    lines = (empty / "runs" / "demo" / "trainer" / "tiny" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert all(json.loads(line)["rollout/trajectories"] > 0 for line in lines)
    # The starter templates ship too.
    res = subprocess.run([str(venv / "bin" / "jet"), "init", "proj"], cwd=empty, env=env, capture_output=True,
                         text=True, check=True)
    assert sorted(p.name for p in (empty / "proj").iterdir()) == ["agent.py", "config.yaml", "rows.jsonl"]
