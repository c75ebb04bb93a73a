"""docs/INTEGRATION.md's code blocks, run in order in one namespace: the documented round trip works as written, and
every message the page quotes (a `print(...)  # text` line) is what the code prints."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "INTEGRATION.md"


def blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", DOC.read_text(), re.S | re.M)


def quoted(block: str) -> list[str]:
    """The texts a block's comments say its prints print (a trailing "..." stands for the rest of the line)."""
    comments = [line.split("#", 1)[1] for line in block.splitlines() if "print(" in line and "#" in line]
    return [text.strip().removesuffix("...").strip() for text in comments]


def test_the_integration_guide_runs_as_written():
    code = blocks()
    assert len(code) >= 6, "the guide lost its examples"
    namespace: dict = {"__name__": "integration_doc"}
    for i, block in enumerate(code):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, f"{DOC.name} block {i + 1}", "exec"), namespace)  # noqa: S102 - our own documentation
        printed = out.getvalue().splitlines()
        for text in quoted(block):
            assert any(line.startswith(text) for line in printed), f"block {i + 1} quotes {text!r}, prints {printed}"
    stats = namespace["cache"].stats()
    assert stats["hits"] == 2 and stats["errors"] == 0
