"""Fetch the tests of one vLLM release from its source distribution on PyPI (the wheel has none).

    python .ci/vllm_release_tests.py 0.33.0 DEST

leaves vLLM's ``tests/`` package in ``DEST/vllm-0.33.0/tests`` (a copy already there is reused) and prints that
release directory. The sdist is checked against the SHA-256 that PyPI's index gives for it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

INDEX = "https://pypi.org/simple/vllm/"


def sdist_url(version: str) -> tuple[str, str]:
    request = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        files = json.load(response)["files"]
    name = f"vllm-{version}.tar.gz"
    for f in files:
        if f["filename"] == name:
            return f["url"], f["hashes"]["sha256"]
    raise SystemExit(f"PyPI has no source distribution {name}")


def main() -> None:
    version, dest = sys.argv[1], Path(sys.argv[2])
    release = dest / f"vllm-{version}"
    if not (release / "tests" / "__init__.py").exists():
        url, sha256 = sdist_url(version)
        with tempfile.TemporaryDirectory() as tmp:
            archive = Path(tmp) / "sdist.tar.gz"
            with urllib.request.urlopen(url, timeout=600) as response, archive.open("wb") as out:
                shutil.copyfileobj(response, out)
            digest = hashlib.sha256(archive.read_bytes()).hexdigest()
            if digest != sha256:
                raise SystemExit(f"{url}: SHA-256 {digest}, the index says {sha256}")
            prefix = f"vllm-{version}/tests/"
            with tarfile.open(archive) as tar:
                members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
                tar.extractall(tmp, members=members, filter="data")
            # Moved into place whole, so an interrupted run leaves nothing that looks complete.
            release.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(release / "tests", ignore_errors=True)
            shutil.move(Path(tmp) / f"vllm-{version}" / "tests", release / "tests")
    print(release)


if __name__ == "__main__":
    main()
