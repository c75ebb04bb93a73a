"""What to install for an optional part of kvtier, read from kvtier's own metadata.

kvtier is installed from its source tree (``pip install ".[l3]"``), not from a package index, so a message that
says ``pip install "kvtier[l3]"`` sends a user to a package that is not there. The messages name the extra's own
requirements instead (``pip install "mooncake-transfer-engine>=0.3.13"``), as the installed kvtier's metadata lists
them: pyproject.toml's ``[project.optional-dependencies]`` is the one place they are written.
"""

from __future__ import annotations

import re
from importlib import metadata

_EXTRA = re.compile(r"""\bextra\s*==\s*['"]([^'"]+)['"]""")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(extra: str) -> list[str]:
    """The requirements of kvtier's extra ``extra`` (markers dropped), as its metadata lists them; empty when the
    metadata is not there or has no such extra."""
    try:
        listed = metadata.requires("kvtier") or []
    except metadata.PackageNotFoundError:
        return []
    out = []
    for line in listed:
        requirement, _, marker = line.partition(";")
        found = _EXTRA.search(marker)
        if found and _normal(found.group(1)) == _normal(extra):
            out.append(requirement.strip().replace(" ", ""))
    return out


def install_hint(extra: str) -> str:
    """``pip install "<requirement>" ...`` for kvtier's extra ``extra``; from a source tree without metadata,
    ``pip install ".[extra]"`` (run in kvtier's source tree)."""
    names = requirements(extra)
    if not names:
        return f'pip install ".[{extra}]" in kvtier\'s source tree'
    return "pip install " + " ".join(f'"{n}"' for n in names)


def l3_install_hint() -> str:
    """What to install for the L3 tier: Mooncake, whose CUDA builds import only beside their own CUDA release."""
    return (
        f"{install_hint('l3')} ({install_hint('l3-cuda13')} with CUDA 13; {install_hint('l3-cpu')} on a machine "
        "without CUDA)"
    )
