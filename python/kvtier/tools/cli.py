"""The `kvtier` command: `kvtier demo`, `kvtier bench <benchmark>` (BENCHMARKS), `kvtier soak`, `kvtier info`.

Also the argument parsing every subcommand shares: `parser()` shows each option's default in `--help` and ends a
bad option in one line and exit status 2; `at_least`, `at_most`, `between` and `plot_file` check arguments, and
`cache_settings` and `engine_config` the settings and the engine they give, before any work runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from kvtier.extras import install_hint, l3_install_hint

if TYPE_CHECKING:
    from kvtier.settings import CacheSettings
    from kvtier.tools.engine import EngineConfig

BENCHMARKS = {
    "index": "the Rust index against plain-Python bookkeeping on one trace",
    "copy": "the copy kernel and the copy engine against contiguous memcpy, and their cost to a GEMM (needs CUDA)",
    "overlap": "time to first token with whole and layer-wise loads; decode while a store streams (needs CUDA)",
    "l3": "the L3 tier against raw Mooncake Store calls",
    "sglang": "SGLang HiCache's zero-copy calls: kvtier's backend against SGLang's Mooncake one (needs SGLang)",
    "vllm": "kvtier's vLLM offloading manager against vLLM's CPUOffloadingManager, 2048 keys (needs vLLM)",
    "pin": "pin a large host pool while the engine serves; time every cache call (needs CUDA)",
    "trace": "token hit rate of each eviction policy on a request trace (Mooncake format), by pool size",
    "loop": "host time of each engine-loop call (store, poll, resume) at an 8B model's geometry (needs CUDA)",
    "serve": "real vLLM serving a model: no offloading, vLLM's CPU offloading and kvtier (needs vLLM and CUDA)",
}
# Each command's module (its main(argv) runs it); `kvtier bench <name>` is kvtier.tools.bench.<name>.
COMMANDS = {
    "demo": "kvtier.tools.demo",
    "soak": "kvtier.tools.soak",
    **{f"bench {name}": f"kvtier.tools.bench.{name}" for name in BENCHMARKS},
}
BENCH_USAGE = (
    "usage: kvtier bench <benchmark> [options]\n\nbenchmarks:\n"
    + "".join(f"  {name:<13}{text}\n" for name, text in BENCHMARKS.items())
    + "\n`kvtier bench <benchmark> --help` for its options and their defaults."
)
USAGE = (
    "usage: kvtier <command> [options]\n\ncommands:\n"
    "  demo           multi-turn conversations through the reference engine, cache off vs on\n"
    + "".join(f"  bench {name:<9}{text}\n" for name, text in BENCHMARKS.items())
    + "  soak           randomized fault and load driver: cache on must equal cache off\n"
    "  info           what this build has (CUDA kernel, runtime, devices) and the settings the environment gives\n"
    "\n`kvtier <command> --help` for its options and their defaults."
)

# What to install for the L3 tier (Mooncake), as kvtier's metadata names it.
L3_EXTRA = l3_install_hint()


# ---- argument parsing shared by the subcommands ---------------------------------------------------------------


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default, except a None default: its help text says what the default depends on."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An argument parser whose `--help` shows every default and whose errors are one line (exit status 2)."""

    def __init__(self, prog: str, description: str | None = None, **kw: Any) -> None:
        kw.setdefault("formatter_class", DefaultsHelp)
        super().__init__(prog=prog, description=description, **kw)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` for the options)\n")


def parser(prog: str, doc: str | None = None) -> Parser:
    """A command's parser; its description is the first paragraph of ``doc`` (the command module's docstring)."""
    return Parser(prog, " ".join((doc or "").split("\n\n")[0].split()) or None)


def _number(kind: Callable[[str], Any], text: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def between(low: float | None, high: float | None, kind: Callable[[str], Any] = int) -> Callable[[str], Any]:
    """An argparse ``type``: a number of ``kind`` in ``[low, high]`` (None: unbounded on that side)."""

    def check(text: str) -> Any:
        value = _number(kind, text)
        if low is not None and value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {text}")
        return value

    check.__name__ = kind.__name__
    return check


def at_least(low: float, kind: Callable[[str], Any] = int) -> Callable[[str], Any]:
    return between(low, None, kind)


def at_most(high: float, kind: Callable[[str], Any] = int) -> Callable[[str], Any]:
    return between(None, high, kind)


def positive(kind: Callable[[str], Any] = float) -> Callable[[str], Any]:
    """An argparse ``type``: a number > 0."""

    def check(text: str) -> Any:
        value = _number(kind, text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    check.__name__ = kind.__name__
    return check


def mode_options(ap: argparse.ArgumentParser, args: argparse.Namespace, mode: str, on: bool, **defaults: Any) -> None:
    """Options that only ``mode`` reads (parsed with a None default, their help naming the real one): each given
    without the mode is refused in one line; with it, each not given takes its default from ``defaults``."""
    for name, default in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
        elif not on:
            ap.error(f"argument --{name.replace('_', '-')}: only {mode} reads it")


def plot_file(text: str) -> str:
    """An argparse ``type``: a file matplotlib can write, checked before any work: matplotlib is importable, the
    extension names a format it saves, the folder exists and the file can be written there (by writing it: a
    permission check says yes to root where nothing can be written, as in /proc)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise argparse.ArgumentTypeError(f"{text!r} needs matplotlib: {install_hint('plot')}") from None
    formats = FigureCanvasBase.get_supported_filetypes()
    ext = os.path.splitext(text)[1].lstrip(".").lower()
    if ext not in formats:
        raise argparse.ArgumentTypeError(
            f"{text!r}: matplotlib writes no {'.' + ext if ext else 'extension-less'} files "
            f"(it writes {', '.join(sorted(formats))})"
        )
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text!r}: no folder {folder}")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder")
    existed = os.path.exists(text)
    try:
        with open(text, "ab"):  # appends nothing: an existing file is left as it is
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written: {e.strerror or e}") from None
    if not existed:
        os.remove(text)
    return text


def cache_settings(
    ap: argparse.ArgumentParser, *, page_bytes: int, state_bytes: int = 0, **arguments: Any
) -> CacheSettings:
    """The settings a command's caches get (its arguments over the KVTIER_* variables), with host pools of pages of
    ``page_bytes`` (and states of ``state_bytes``) that fit in this machine: a bad value, any KVTIER_* variable's
    included, ends the command in one line (exit status 2) before any work."""
    from kvtier.settings import CacheSettings, check_fits

    check_environment(ap)
    try:
        s = CacheSettings.resolve(None, **arguments)
        check_fits(s, page_slots=s.host_bytes // page_bytes, page_bytes=page_bytes, state_bytes=state_bytes)
    except ValueError as e:
        ap.error(str(e))
    return s


def check_environment(ap: argparse.ArgumentParser) -> None:
    """Every KVTIER_* variable, those a command's own arguments override included (a bad one is a mistake to report,
    not to ignore): the first bad one ends the command in one line (exit status 2)."""
    from kvtier.settings import read_environment

    errors = read_environment()[1]
    if errors:
        ap.error(errors[0])


def engine_config(ap: argparse.ArgumentParser, model: str, **fields: Any) -> EngineConfig:
    """The reference engine's config of a model preset (its device, dtype, pool... from the arguments); a bad one
    ends the command in one line (exit status 2) before any work."""
    from kvtier.tools.engine import EngineConfig

    try:
        return EngineConfig.preset(model, **fields)
    except ValueError as e:
        message = str(e)
        # The field a command's option sets is named as that option (num_gpu_blocks: --gpu-blocks).
        options = {a.dest: a.option_strings[-1] for a in ap._actions if a.option_strings}
        for field in fields:
            option = options.get(field) or options.get(field.removeprefix("num_"))
            if option:
                message = message.replace(f"EngineConfig.{field} ", f"{option} ")
        ap.error(message)


def log_to_stderr() -> None:
    """kvtier's log records on stderr as ``<logger>: <message>`` (``kvtier: ...``, ``kvtier.l3: ...``): the
    commands' way of showing what the library logs (at WARNING and above, unless a command sets another level)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logging.getLogger("kvtier").addHandler(handler)


# ---- kvtier info --------------------------------------------------------------------------------------------------


def _runtime(version: Any) -> str | None:
    """13000 -> '13.0' (the CUDA runtime's integer version)."""
    if isinstance(version, int) and version > 0:
        return f"{version // 1000}.{version % 1000 // 10}"
    return None if version is None else str(version)


def info() -> dict[str, Any]:
    """What `kvtier info` reports: the build, the devices visible, the optional parts and the settings."""
    from kvtier import build_info
    from kvtier.settings import CacheSettings, read_environment

    b = dict(build_info())
    out: dict[str, Any] = {
        "version": b["version"],
        "cuda_kernel": bool(b["cuda"]),
        "cuda_runtime": _runtime(b.get("cuda_runtime_version")),
        "nvcc": b.get("nvcc"),
        "nvcc_source": b.get("nvcc_source"),
        "cuda_devices": b.get("cuda_devices", 0),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "devices": [],
    }
    try:
        import torch

        out["torch"] = torch.__version__
        if torch.cuda.is_available():
            out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        out["torch"] = None
    try:
        from kvtier.l3.store import import_mooncake

        import_mooncake()
        out["mooncake"] = True
    except ImportError:
        out["mooncake"] = False
    rows, errors = read_environment()
    if not errors:
        try:
            CacheSettings.resolve()  # the settings that do not go together
        except ValueError as e:
            errors.append(str(e))
    out["settings"] = [{"name": n, "value": v, "source": src, "variable": var} for n, v, src, var in rows]
    out["settings_errors"] = errors
    return out


def print_info(r: dict[str, Any]) -> None:
    print(f"kvtier {r['version']}")
    if r["cuda_kernel"]:
        print(
            f"CUDA copy kernel: compiled in (CUDA runtime {r['cuda_runtime'] or 'unknown'}, "
            f"by nvcc {r['nvcc']} from {r['nvcc_source']})"
        )
    else:
        print(
            "CUDA copy kernel: NOT compiled in (built without nvcc): a cache over a CUDA pool raises CopyError "
            "at construction; CPU pools work (memcpy)"
        )
    visible = r["cuda_visible_devices"]
    print(f"CUDA devices visible: {r['cuda_devices']}" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else ""))
    for i, name in enumerate(r["devices"]):
        print(f"  cuda:{i}  {name}")
    print(f"torch: {r['torch'] or 'not installed'}")
    print(f"mooncake (L3 tier): {'importable' if r['mooncake'] else f'not installed ({L3_EXTRA})'}")
    print("settings (an argument wins over its KVTIER_* variable, the variable over the default):")
    width = max(len(s["name"]) for s in r["settings"])
    vwidth = max(len(str(s["value"])) for s in r["settings"])
    for s in r["settings"]:
        print(f"  {s['name']:<{width}}  {s['value']:<{vwidth}}  {s['source']:<7}  {s['variable']}")


def main_info(argv: Sequence[str]) -> int:
    ap = parser("kvtier info", "What this build has and the settings the environment gives.")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    r = info()
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print_info(r)
    # Every setting is listed, a bad variable's among them (source "bad"); each error is one line on stderr.
    for error in r["settings_errors"]:
        print(f"{ap.prog}: error: {error}", file=sys.stderr)
    return 2 if r["settings_errors"] else 0


# ---- dispatch -----------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # the command line, not a caller in this process: the library's log goes to stderr
        log_to_stderr()
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if args[0] == "info":
        return main_info(args[1:])
    if args[0] == "bench" and (len(args) == 1 or args[1] in ("-h", "--help")):
        print(BENCH_USAGE)
        return 0
    for n in (2, 1):
        name = " ".join(args[:n])
        if name in COMMANDS:
            module = importlib.import_module(COMMANDS[name])
            return int(module.main(args[n:]) or 0)
    what = " ".join(args[:2]) if args[0] == "bench" else args[0]
    print(f"kvtier: unknown command {what!r}\n\n{BENCH_USAGE if args[0] == 'bench' else USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
