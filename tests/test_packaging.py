"""The repository's folders install as one namespace, `jet`, in both install modes."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import jet, jet.queues.consumer, jet.workers, jet.trainer, jet.bench, jet.cli;"
         "print(jet.queues.consumer.__file__)")


def test_editable_install_maps_top_level_folders():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                         cwd="/").stdout
    assert Path(out.strip()) == ROOT / "queues" / "consumer.py"


@pytest.mark.slow
def test_regular_wheel_install_imports_every_subpackage(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "wheel"), str(ROOT)], check=True)
    [wheel] = (tmp_path / "wheel").glob("*.whl")
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
