"""The CI scripts' own machinery: the engine venvs of .ci/sglang see what the calling Python sees, even when that
Python is a virtualenv's (`venv --system-site-packages` would show them the base interpreter's packages only)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINKED_VENV = ROOT / ".ci" / "linked_venv.py"


def run(python: Path | str, *args: str) -> str:
    # No PYTHONPATH: only what the interpreters' own site directories hold counts.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(python), *args], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def site_packages(env: Path) -> Path:
    return Path(sysconfig.get_path("purelib", vars={"base": str(env), "platbase": str(env)}))


def test_a_venv_made_from_a_virtualenv_sees_the_virtualenvs_packages(tmp_path):
    caller = tmp_path / "caller"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(caller)], check=True)
    own = site_packages(caller).resolve()
    (own / "marker_own").mkdir()
    (own / "marker_own" / "__init__.py").write_text("")
    # An editable-style install: a .pth file in the virtualenv names a folder elsewhere.
    (tmp_path / "src" / "marker_pth").mkdir(parents=True)
    (tmp_path / "src" / "marker_pth" / "__init__.py").write_text("")
    (own / "marker_pth.pth").write_text(str(tmp_path / "src") + "\n")
    python = Path(run(caller / "bin" / "python", str(LINKED_VENV), str(tmp_path / "engine")))
    assert python == tmp_path / "engine" / "bin" / "python"
    seen = run(python, "-c", "import sys, marker_own, marker_pth; print(marker_own.__file__); print(sys.path)")
    assert os.path.realpath(seen.splitlines()[0]).startswith(str(own)), seen
    # The engine venv's own packages come first: what is installed into it wins over the caller's.
    path = [os.path.realpath(p) for p in ast.literal_eval(seen.splitlines()[1])]
    assert path.index(str(site_packages(tmp_path / "engine").resolve())) < path.index(str(own)), path
    # Whatever the caller sees through its base interpreter (kvtier under test, when installed there), the engine
    # venv sees as the very same files.
    probe = "import importlib.util as u; print(getattr(u.find_spec('kvtier'), 'origin', None))"
    assert run(python, "-c", probe) == run(caller / "bin" / "python", "-c", probe)
    # A second run keeps the venv (what was installed into it) and links again.
    marker = site_packages(tmp_path / "engine") / "kept"
    marker.mkdir()
    run(caller / "bin" / "python", str(LINKED_VENV), str(tmp_path / "engine"))
    assert marker.is_dir()
