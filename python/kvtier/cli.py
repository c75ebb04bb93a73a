"""The `kvtier` command: `kvtier demo`, `kvtier bench {index,copy,l3,pin,overlap}`, `kvtier info`."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Sequence

COMMANDS = {
    "demo": "kvtier.demo",
    "bench index": "kvtier.bench.index",
    "bench copy": "kvtier.bench.copy",
    "bench l3": "kvtier.bench.l3",
    "bench pin": "kvtier.bench.pin",
    "bench overlap": "kvtier.bench.overlap",
    "soak": "kvtier.soak",
}

USAGE = """usage: kvtier <command> [options]

commands:
  demo           multi-turn conversations through the reference engine, cache off vs on
  bench index    the Rust index against plain-Python bookkeeping on one trace
  bench copy     the copy kernel and the copy engine against contiguous memcpy, and their cost to a GEMM (CUDA)
  bench overlap  time to first token with whole and layer-wise loads; decode while a store streams (CUDA)
  bench l3       the L3 tier against raw Mooncake Store calls
  bench pin      pin a large host pool while the engine serves; time every cache call
  soak           randomized fault and load driver: cache on must equal cache off
  info           what this build has (CUDA compiled in, devices visible)

`kvtier <command> --help` for its options."""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if args[0] == "info":
        from kvtier import build_info

        print(json.dumps(build_info(), indent=2))
        return 0
    for n in (2, 1):
        name = " ".join(args[:n])
        if name in COMMANDS:
            module = importlib.import_module(COMMANDS[name])
            return int(module.main(args[n:]) or 0)
    print(f"kvtier: unknown command {' '.join(args[:2])!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
