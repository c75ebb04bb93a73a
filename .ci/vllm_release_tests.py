"""Fetch the tests of one vLLM release from its source distribution (the wheel has none).

    python .ci/vllm_release_tests.py 0.33.0 DEST

leaves vLLM's ``tests/`` package in ``DEST/vllm-0.33.0/tests`` (a copy already there is reused) and prints that
release directory.

The sdist is found and fetched the way ``pip download --no-deps --no-binary :all: vllm==X`` finds and fetches it,
through pip's own configuration (``index-url``, ``extra-index-url``, ``find-links``, ``no-index``, ``cert``,
``trusted-host``, ``proxy``, credentials: pip's config files and ``PIP_*`` variables), so a machine behind a mirror
or an internal index fetches it from there. ``pip download`` itself cannot be used: after fetching an sdist it
builds the sdist's metadata, which for vLLM needs torch and a CUDA build setup. So this runs the first half of
``pip download`` in process: pip's own ``download`` command parses its configuration and builds its session and
package finder (pip's internal API, ``pip._internal``: what ``pip download`` runs, stable since pip 20.3; a pip
that changes it fails here by name), the finder picks the sdist, the session fetches it, and nothing is built. The
sdist is checked against the SHA-256 the index gives for it; an index that gives none is refused.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any


def find_sdist(version: str) -> tuple[Any, str, str]:
    """pip's session, and the URL and SHA-256 of vLLM ``version``'s sdist on the indexes pip is configured with."""
    from pip._internal.commands import create_command
    from pip._vendor.packaging.specifiers import SpecifierSet

    download = create_command("download")
    options, _ = download.parse_args(["--no-deps", "--no-binary", ":all:", f"vllm=={version}"])
    # pip's own download command's session and finder (see the docstring).
    session = download._build_session(options)
    finder = download._build_package_finder(options=options, session=session, ignore_requires_python=True)
    found = finder.find_best_candidate("vllm", SpecifierSet(f"=={version}")).best_candidate
    indexes = " ".join(finder.index_urls) or "none (no-index)"
    if found is None or not found.link.filename.endswith(".tar.gz"):
        raise SystemExit(f"no source distribution of vllm=={version} on the configured indexes ({indexes})")
    if found.link.hash_name != "sha256" or not found.link.hash:
        raise SystemExit(f"{found.link.url_without_fragment}: the index gives no SHA-256 to check the sdist against")
    return session, found.link.url_without_fragment, found.link.hash


def main() -> None:
    version, dest = sys.argv[1], Path(sys.argv[2])
    release = dest / f"vllm-{version}"
    if not (release / "tests" / "__init__.py").exists():
        session, url, sha256 = find_sdist(version)
        with tempfile.TemporaryDirectory() as tmp:
            archive = Path(tmp) / "sdist.tar.gz"
            # The file's own bytes, as pip fetches them: no content encoding undone or applied.
            headers = {"Accept-Encoding": "identity"}
            with session.get(url, stream=True, timeout=600, headers=headers) as response, archive.open("wb") as out:
                response.raise_for_status()
                for chunk in response.iter_content(1 << 20):
                    out.write(chunk)
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
