"""Make a virtual environment that sees, after its own packages, every package the running Python sees.

    python3 .ci/linked_venv.py DIR

`python3 -m venv --system-site-packages` links the site directories of the *base* interpreter: run from inside a
virtualenv, it hides that virtualenv's own packages (the kvtier under test, torch), and the new venv downloads
them again or fails to import them. This links the site directories of the running interpreter instead, whatever
made it (a virtualenv, with or without its base's packages, pyenv, the system's Python): a `.pth` file in the new
venv adds each with `site.addsitedir`, after the venv's own site-packages, so their own `.pth` files (editable
installs) are read too and what is installed into the new venv comes first. pip in the new venv counts the linked
packages as installed and does not fetch them again.

A venv already at DIR is kept when it was made from this Python (the same version and base interpreter), so a
later run reuses what was installed into it; the link file is written anew each time. Prints DIR's interpreter.
"""

from __future__ import annotations

import os
import platform
import site
import sys
import sysconfig
import venv
from pathlib import Path

LINK = "caller-site.pth"


def site_dirs() -> list[str]:
    """The site directories this interpreter reads packages from (its virtualenv's, its base's when it sees them,
    the user's when enabled), in its own order."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(os.path.realpath(d) for d in dirs) if os.path.isdir(d)]


def made_from_this_python(env: Path) -> bool:
    """Whether the venv at ``env`` runs this interpreter's version on the same base interpreter."""
    try:
        lines = (env / "pyvenv.cfg").read_text().splitlines()
    except OSError:
        return False
    cfg = dict(line.split("=", 1) for line in lines if "=" in line)
    cfg = {k.strip(): v.strip() for k, v in cfg.items()}
    home = os.path.dirname(getattr(sys, "_base_executable", sys.executable))
    return (
        cfg.get("version", cfg.get("version_info")) == platform.python_version()
        and os.path.realpath(cfg.get("home", "")) == os.path.realpath(home)
        and (env / "bin" / "python").exists()
    )


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python3 .ci/linked_venv.py DIR")
    env = Path(sys.argv[1]).absolute()
    if not made_from_this_python(env):
        venv.EnvBuilder(with_pip=True, clear=True, symlinks=os.name != "nt").create(env)
    own = Path(sysconfig.get_path("purelib", vars={"base": str(env), "platbase": str(env)}))
    dirs = [d for d in site_dirs() if os.path.realpath(d) != os.path.realpath(own)]
    # One line: a .pth line that starts with `import` runs; any other names one directory, without its .pth files.
    (own / LINK).write_text("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
    print(env / "bin" / "python")


if __name__ == "__main__":
    main()
