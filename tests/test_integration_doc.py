"""docs/INTEGRATION.md's code blocks, run in order in one namespace: the documented round trip works as written."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "INTEGRATION.md"


def blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", DOC.read_text(), re.S | re.M)


def test_the_integration_guide_runs_as_written():
    code = blocks()
    assert len(code) >= 6, "the guide lost its examples"
    namespace: dict = {"__name__": "integration_doc"}
    for i, block in enumerate(code):
        exec(compile(block, f"{DOC.name} block {i + 1}", "exec"), namespace)  # noqa: S102 - our own documentation
    stats = namespace["cache"].stats()
    assert stats["hits"] == 2 and stats["errors"] == 0
