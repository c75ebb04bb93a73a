"""Cache settings: one registry (``REGISTRY``) from which the constructor arguments, the ``KVTIER_*`` variables,
the README's table, ``kvtier info`` and each adapter's settings (``for_scope``) are made.

A setting's value comes from an argument (``None`` means "not given"), else from its environment variable (an
empty variable counts as unset), else from its default. Arguments accept what the variables accept (``"64GiB"``,
``"true"``, ``"16"``) as well as plain Python values. Any bad value raises ``kvtier.BadArgument`` (a ``ValueError``)
naming the setting (and the variable it came from) at construction, never later. Each setting names the scopes
that take it (``SCOPES``: the cache and each engine adapter); the choices of a setting the Rust core parses are the
core's own lists. Adding a setting is one line in ``REGISTRY``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from kvtier._core import COPY_METHODS, EVICTION_POLICIES, HASH_KINDS, PIN_METHODS, BadArgument

INT32_MAX = 2**31 - 1
# The largest integer setting: every count and size crosses into the core as a 64-bit integer.
INT64_MAX = 2**63 - 1

# Kinds of value. ADDRESS: a Mooncake master's "host:port".
BYTES, INT, FLOAT, BOOL, TEXT, SECRET, ADDRESS = "bytes", "int", "float", "bool", "text", "secret", "address"

# Who takes settings, each from its own configuration: the cache (``HostPrefixCache``'s arguments, which the
# DeepInfer adapter ``kvtier.deepinfer.Cache`` passes through, and ``KVTIER_*``) takes every setting; the engine
# adapters take those of the parts they run.
CACHE, VLLM, VLLM_TIER, SGLANG = "cache", "vllm", "vllm_tier", "sglang"
SCOPES: Mapping[str, str] = {
    CACHE: "kvtier's cache (HostPrefixCache, kvtier.deepinfer.Cache)",
    VLLM: "kvtier.vllm.KvtierSpec (vLLM's kv_connector_extra_config)",
    VLLM_TIER: "kvtier.vllm.KvtierMooncakeTier (a secondary tier's config)",
    SGLANG: "kvtier.sglang.KvtierStore (SGLang's HiCache extra config)",
}
# What every user of the L3 tier is told without a master (the tier needs one).
L3_MASTER_MISSING = "setting l3='mooncake' needs l3_master (KVTIER_L3_MASTER=host:port)"
_WITH_VLLM = frozenset({CACHE, VLLM})
_WITH_L3_ADAPTERS = frozenset({CACHE, VLLM_TIER, SGLANG})

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*$")
_INT = re.compile(r"^\s*[+-]?[0-9][0-9_]*\s*$")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    """One setting: its name (the constructor argument), kind, default, meaning, bounds and variable."""

    name: str
    kind: str
    default: Any
    help: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    shown: str | None = None  # the default as the README and `kvtier info` show it
    env: str | None = None  # default: KVTIER_<NAME>
    scopes: frozenset[str] = frozenset({CACHE})  # who takes it (SCOPES)
    required_in: frozenset[str] = frozenset()  # the scopes that refuse to start without it
    required_why: str = ""  # why they do (said in the error)

    @property
    def variable(self) -> str:
        return self.env or f"KVTIER_{self.name.upper()}"

    @property
    def default_text(self) -> str:
        return self.shown if self.shown is not None else self.show(self.default)

    def show(self, value: Any) -> str:
        """A value as the README and ``kvtier info`` write it (secrets hidden)."""
        if value is None:
            return "unset"
        if self.kind == SECRET:
            return "<set>"
        if self.kind == BYTES:
            return format_bytes(value)
        if self.kind == BOOL:
            return str(value).lower()
        return str(value)

    def parse(self, value: Any) -> Any:
        """The value as this setting holds it; ``ValueError`` (without the setting's name) when it is bad."""
        if self.kind in (TEXT, SECRET, ADDRESS):
            ok = (str, bytes) if self.kind == SECRET else (str,)
            if not isinstance(value, ok):
                raise ValueError(f"must be a string, got {type(value).__name__} {value!r}")
            if self.choices and value not in self.choices:
                raise ValueError(f"must be one of {', '.join(map(repr, self.choices))}, got {value!r}")
            if self.kind == ADDRESS and not (isinstance(value, str) and is_address(value)):
                raise ValueError(f"must be 'host:port' (a port from 1 to 65535), got {value!r}")
            return value
        if self.kind == BOOL:
            if isinstance(value, (bool, np.bool_)):
                return bool(value)
            if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
                return value.strip().lower() in _TRUE
            raise ValueError(f"must be a boolean (true/false, 1/0, yes/no, on/off), got {value!r}")
        number = self._number(value)
        if self.minimum is not None and number < self.minimum:
            raise ValueError(f"must be >= {_num(self.minimum)}, got {_shown(number)}")
        maximum = self.maximum if self.maximum is not None or self.kind == FLOAT else INT64_MAX
        if maximum is not None and number > maximum:
            raise ValueError(f"must be <= {_num(maximum)}, got {_shown(number)}")
        return number

    def _number(self, value: Any) -> int | float:
        if isinstance(value, (bool, np.bool_)):
            raise ValueError(f"must be a number, got {value!r}")
        if self.kind == FLOAT:
            if isinstance(value, str):
                try:
                    value = float(value)
                except ValueError:
                    raise ValueError(f"not a number: {value!r}") from None
            if isinstance(value, (int, float, np.integer, np.floating)):
                try:
                    number = float(value)
                except OverflowError:  # an int beyond any float
                    number = math.inf
                if math.isfinite(number):
                    return number
            raise ValueError(f"must be a finite number, got {_shown(value)}")
        if isinstance(value, (int, np.integer)):
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            if self.kind == BYTES:
                return parse_bytes(value)
            if _INT.match(value):
                return int(value)
        what = "a size in bytes (an int or text such as '64GiB')" if self.kind == BYTES else "an integer"
        raise ValueError(f"must be {what}, got {_shown(value)}")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _shown(value: Any) -> str:
    """A value in an error message; a long one by its start and length (the message stays one line)."""
    if isinstance(value, int) and abs(value) >= 10**40:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return f"{text[:24]}... ({len(text)} characters)" if len(text) > 60 else text


def parse_bytes(text: str) -> int:
    """``123``, ``64MiB``, ``1.5GiB``, ``2GB``, ``16m`` (no exponents, no negative sizes), exactly: as many digits
    as given (the setting's bounds refuse sizes too large)."""
    m = _SIZE.match(text.lower())
    if m is None or m.group(2) not in _UNITS:
        raise ValueError(f"not a size in bytes: {_shown(text)} (e.g. 4096, 512MiB, 64GiB)")
    return int(Fraction(m.group(1).replace("_", "")) * _UNITS[m.group(2)])


def is_address(text: str) -> bool:
    """Whether ``text`` is ``host:port`` with a port from 1 to 65535."""
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536)


def format_bytes(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


S = Setting
REGISTRY: tuple[Setting, ...] = (
    S("host_bytes", BYTES, 4 << 30, "host page pool (`64GiB`, `512MiB` ... accepted)", minimum=1, scopes=_WITH_VLLM),
    S("state_slots", INT, 0, "host state slots (required > 0 for models with state)", minimum=0, maximum=INT32_MAX),
    S(
        "keep_tokens",
        INT,
        1,
        "prompt suffix always recomputed; a hit is capped at `floor((n - keep) / bs) * bs`",
        minimum=1,
        maximum=INT32_MAX,
    ),
    S("min_hit_tokens", INT, None, "shorter hits are misses", minimum=0, maximum=INT32_MAX, shown="2 blocks"),
    S(
        "state_lookback_blocks",
        INT,
        4,
        "states kept at this many deepest boundaries of a prompt",
        minimum=0,
        maximum=INT32_MAX,
        env="KVTIER_STATE_LOOKBACK",
    ),
    S(
        "ring_slack",
        INT,
        0,
        "a state at `b` needs `b >= seq_len - ring_slack`",
        minimum=0,
        maximum=INT32_MAX,
        shown="0 (the adapter reads `engine.ring_slack`)",
    ),
    S(
        "hash_kind",
        TEXT,
        "blake3",
        "`blake3` (keyed, cryptographic) or `xxh3` (faster; collisions can be crafted: single tenant only)",
        choices=tuple(HASH_KINDS),
    ),
    S(
        "hash_key",
        SECRET,
        None,
        "per-deployment secret key of the block hash",
        shown="public default",
        scopes=_WITH_L3_ADAPTERS,
    ),
    S(
        "eviction_policy",
        TEXT,
        "lru",
        "`lru`, or `adaptive`: scan-resistant, keeps pages used twice over one-off prompts (docs/EVICTION.md)",
        choices=tuple(EVICTION_POLICIES),
        scopes=_WITH_VLLM,
    ),
    S(
        "event_buffer",
        INT,
        0,
        "KV events kept for `take_events()`; the oldest are dropped beyond it (`events_dropped`); 0: none recorded",
        minimum=0,
        maximum=INT32_MAX,
        scopes=_WITH_VLLM,
    ),
    S("staging_slots", INT, 16, "GPU staging buffers for state copies", minimum=1, maximum=4096),
    S(
        "pin_step_bytes",
        BYTES,
        256 << 20,
        "host pools are pinned in pin steps of this size off the engine loop (the vLLM worker's at its start)",
        minimum=1,
        scopes=_WITH_VLLM,
    ),
    S(
        "pin_method",
        TEXT,
        "auto",
        "`driver`: host memory made by the CUDA driver, step by step into one range; `register`: the process's pages "
        "registered with CUDA a step at a time (copies cut at steps; each registration holds up the engine's "
        "launches); `auto`: `driver` where the driver can",
        choices=tuple(PIN_METHODS),
        scopes=_WITH_VLLM,
    ),
    S("preallocate", BOOL, False, "pin the whole host pool at construction instead of lazily"),
    S("max_errors", INT, 3, "kvtier's own failures after which the cache disables itself", minimum=1),
    S("l3", TEXT, None, "`mooncake` enables the L3 tier", choices=("mooncake",)),
    S(
        "model_version",
        TEXT,
        None,
        "the model's revision (a checkpoint hash or commit the deployment vouches for): every key is derived under "
        "it; without it the adapter digests every weight byte",
        scopes=_WITH_L3_ADAPTERS,
        required_in=frozenset({VLLM_TIER, SGLANG}),
        required_why="a revision of the model the deployment vouches for: the engine's model name says where the "
        "weights came from, not what they are",
    ),
    S("l3_master", ADDRESS, None, "Mooncake master `host:port`", scopes=_WITH_L3_ADAPTERS),
    S("l3_metadata_server", TEXT, "P2PHANDSHAKE", "Mooncake metadata server", scopes=_WITH_L3_ADAPTERS),
    S("l3_protocol", TEXT, "tcp", "Mooncake transfer protocol", choices=("tcp", "rdma"), scopes=_WITH_L3_ADAPTERS),
    S(
        "l3_segment_bytes",
        BYTES,
        0,
        "host bytes this instance contributes to the Store (0: none)",
        minimum=0,
        scopes=_WITH_L3_ADAPTERS,
    ),
    S("l3_buffer_bytes", BYTES, 64 << 20, "Mooncake's local transfer buffer", minimum=0, scopes=_WITH_L3_ADAPTERS),
    S("l3_group_pages", INT, 4, "pages per L3 object", minimum=1, maximum=4096),
    S("l3_deadline_ms", FLOAT, 50.0, "how long a request waits for an L3 fetch", minimum=0),
    S("l3_seen_keys", INT, 1 << 20, "L3 keys remembered as already in the Store", minimum=1, maximum=INT32_MAX),
    S(
        "l3_local_hostname",
        TEXT,
        "127.0.0.1",
        "address this instance's Mooncake transfer engine is reached at and binds to",
        scopes=_WITH_L3_ADAPTERS,
    ),
    S(
        "l3_zero_copy",
        BOOL,
        False,
        "register the host pools with Mooncake and move objects straight from and into them (trusted Mooncake "
        "network only: any transfer-engine peer can write registered memory)",
        scopes=frozenset({CACHE, SGLANG}),
    ),
    S(
        "l3_staging_bytes",
        BYTES,
        128 << 20,
        "each of the two registered staging buffers L3 objects move through when not zero-copy",
        minimum=1,
        scopes=_WITH_L3_ADAPTERS,
    ),
    S(
        "l3_trusted_store",
        BOOL,
        False,
        "everyone who can write to the Store is trusted: allows L3 with the public default hash_key, under which "
        "objects can be forged",
        scopes=_WITH_L3_ADAPTERS,
    ),
    S(
        "copy_method",
        TEXT,
        "auto",
        "`auto`: the copy engine for pieces >= copy_crossover_bytes, the kernel below; `kernel`; `dma`",
        choices=tuple(COPY_METHODS),
        scopes=_WITH_VLLM,
    ),
    S(
        "copy_crossover_bytes",
        BYTES,
        64 << 10,
        "piece size from which `auto` takes the copy engine",
        minimum=16,
        scopes=_WITH_VLLM,
    ),
    S(
        "copy_piece_bytes",
        BYTES,
        None,
        "the most bytes one copy-engine copy takes (contiguous blocks merge up to it; unset: no bound), for copy "
        "engines shared with the engine's own copies; 2 MiB did not steady the copy engine's loads under vLLM "
        "(docs/VLLM.md)",
        minimum=1,
        scopes=_WITH_VLLM,
    ),
    S(
        "copy_ctas",
        INT,
        8,
        "CUDA thread blocks the copy kernel uses at most (fewer leave more SMs to the model)",
        minimum=1,
        maximum=65535,
        scopes=_WITH_VLLM,
    ),
    S(
        "store_copy_method",
        TEXT,
        None,
        "the copy method of stores (GPU to host) when it is not copy_method's (`dma` leaves the SMs to the model)",
        choices=tuple(COPY_METHODS),
        scopes=_WITH_VLLM,
    ),
    S(
        "store_copy_ctas",
        INT,
        None,
        "the copy kernel's CTA bound for stores (GPU to host) when it is not copy_ctas (stores run beside the model, "
        "loads on a request's critical path)",
        minimum=1,
        maximum=65535,
        scopes=_WITH_VLLM,
    ),
    S(
        "copy_streams",
        BOOL,
        True,
        "copies on kvtier's own streams ordered by events; false: on the engine's stream",
        scopes=_WITH_VLLM,
    ),
    S("layerwise_loads", BOOL, False, "loads issued layer by layer; the engine calls `wait_layer(l)` before layer l"),
)
SETTINGS: Mapping[str, Setting] = {s.name: s for s in REGISTRY}


class CacheSettings:
    """Every setting of a cache, resolved and checked: ``settings.host_bytes`` etc. (see ``REGISTRY``).

    ``CacheSettings(**arguments)`` uses arguments and defaults; ``CacheSettings.resolve(env, **arguments)`` also
    reads the environment (``os.environ`` when ``env`` is None). ``sources[name]`` says where each value came
    from: ``"argument"``, ``"env"`` or ``"default"``."""

    def __init__(self, **arguments: Any) -> None:
        self._init(arguments, {})

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None, **arguments: Any) -> CacheSettings:
        out = cls.__new__(cls)
        out._init(arguments, os.environ if env is None else env)
        return out

    def _init(self, arguments: dict[str, Any], env: Mapping[str, str]) -> None:
        unknown = set(arguments) - set(SETTINGS)
        if unknown:
            raise BadArgument(f"unknown cache settings: {sorted(unknown)} (known: {', '.join(SETTINGS)})")
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for s in REGISTRY:
            value = arguments.get(s.name)
            if value is None:
                values[s.name], sources[s.name] = _from_env(s, env)
                continue
            if s.kind == TEXT and s.default is None and value == "":
                values[s.name], sources[s.name] = s.default, "default"
                continue
            try:
                values[s.name] = s.parse(value)
            except ValueError as e:
                raise BadArgument(f"bad setting {s.name}: {e}") from None
            sources[s.name] = "argument"
        if values["l3"] == "mooncake" and not values["l3_master"]:
            raise BadArgument(L3_MASTER_MISSING)
        if values["l3"] == "mooncake" and values["hash_key"] is None and not values["l3_trusted_store"]:
            raise BadArgument(
                "setting l3='mooncake' with the public default hash_key: anyone who can write to the Store could "
                "forge objects this cache accepts. Set hash_key (KVTIER_HASH_KEY) to a secret of the deployment, "
                "or l3_trusted_store=true (KVTIER_L3_TRUSTED_STORE) if everyone who can write to the Store is trusted"
            )
        if values["model_version"] == "":
            raise BadArgument("setting model_version must not be empty (leave it unset instead)")
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "sources", sources)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(f"no setting {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("CacheSettings are read-only: build new ones with replace()")

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self.__dict__["_values"].items())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheSettings) and dict(self) == dict(other)

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, repr(v)) for k, v in self)))

    def __repr__(self) -> str:
        shown = (f"{k}={'<secret>' if SETTINGS[k].kind == SECRET and v else repr(v)}" for k, v in self)
        return f"CacheSettings({', '.join(shown)})"

    def replace(self, **changes: Any) -> CacheSettings:
        """These settings with some changed (checked like arguments)."""
        given = {k: v for k, v in self if self.sources[k] != "default"}
        return CacheSettings(**{**given, **changes})

    def explain(self) -> list[tuple[str, str, str, str]]:
        """``(name, value, source, variable)`` of every setting, secrets hidden: what ``kvtier info`` prints."""
        return [
            (s.name, s.default_text if v is None else s.show(v), self.sources[s.name], s.variable)
            for s, v in ((s, getattr(self, s.name)) for s in REGISTRY)
        ]


def from_environment(name: str, env: Mapping[str, str] | None = None) -> tuple[Any, str]:
    """Setting ``name``'s value from its variable alone, and where it came from (``"env"``, or ``"default"`` when the
    variable is unset or empty); ``BadArgument`` naming the setting and the variable when the variable's value is
    bad."""
    return _from_env(SETTINGS[name], os.environ if env is None else env)


def _from_env(s: Setting, env: Mapping[str, str]) -> tuple[Any, str]:
    text = env.get(s.variable, "")
    if not text.strip():
        return s.default, "default"
    try:
        return s.parse(text), "env"
    except ValueError as e:
        raise BadArgument(f"bad setting {s.name} (from {s.variable}={_shown(text)}): {e}") from None


def scope_names(scope: str) -> tuple[str, ...]:
    """The settings ``scope`` takes (``SCOPES``), in registry order."""
    if scope not in SCOPES:
        raise BadArgument(f"scope must be one of {', '.join(map(repr, SCOPES))}, got {scope!r}")
    return tuple(s.name for s in REGISTRY if scope in s.scopes)


def for_scope(
    scope: str, config: Mapping[str, Any], env: Mapping[str, str] | None = None, **fixed: Any
) -> CacheSettings:
    """The settings of one adapter (``scope``, see ``SCOPES``): ``config`` may give only settings the scope takes
    (any other key is refused, naming those it takes); the ``KVTIER_*`` variables of those settings fill in what
    it leaves out, every other setting keeps its default (a variable for another part of kvtier changes nothing
    here); ``fixed`` are the adapter's own choices (e.g. ``l3="mooncake"``). A setting the scope requires that is
    still unset is refused, saying why it is required."""
    names = scope_names(scope)
    unknown = sorted(set(config) - set(names))
    if unknown:
        raise BadArgument(f"config keys {unknown} are not settings of {SCOPES[scope]} (it takes {', '.join(names)})")
    env = os.environ if env is None else env
    variables = {SETTINGS[n].variable: env[SETTINGS[n].variable] for n in names if SETTINGS[n].variable in env}
    settings = CacheSettings.resolve(variables, **config, **fixed)
    for s in REGISTRY:
        if scope in s.required_in and getattr(settings, s.name) is None:
            raise BadArgument(f"{SCOPES[scope]} needs {s.name} (or {s.variable}): {s.required_why}")
    return settings


def read_environment(env: Mapping[str, str] | None = None) -> tuple[list[tuple[str, str, str, str]], list[str]]:
    """Every setting as the ``KVTIER_*`` variables alone give it, each variable read on its own, so that a bad one
    hides none of the others: ``(name, value, source, variable)`` of every setting (what ``kvtier info`` prints;
    source ``"env"``, ``"default"``, or ``"bad"`` for a bad variable, whose value is shown as it was given) and the
    ``ValueError`` message of each bad variable. (Settings that do not go together are ``CacheSettings``'
    business: arguments may complete them.)"""
    env = os.environ if env is None else env
    rows, errors = [], []
    for s in REGISTRY:
        try:
            value, source = _from_env(s, env)
        except ValueError as e:
            errors.append(str(e))
            rows.append((s.name, env[s.variable], "bad", s.variable))
            continue
        rows.append((s.name, s.default_text if value is None else s.show(value), source, s.variable))
    return rows, errors


def markdown_table() -> str:
    """The README's settings table, made from the registry (a test keeps README.md equal to it)."""
    rows = ["| setting | variable | default | taken by | meaning |", "| --- | --- | --- | --- | --- |"]
    for s in REGISTRY:
        scopes = ", ".join(scope for scope in SCOPES if scope in s.scopes)
        rows.append(f"| {s.name} | {s.variable} | {s.default_text} | {scopes} | {s.help} |")
    return "\n".join(rows)


def machine_memory() -> int | None:
    """Bytes of memory this process can have: physical memory, lowered by a cgroup limit (None if unknown)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


# Bytes of index bookkeeping per host slot at most (entry, list links, key map), counted against memory; the
# adaptive policy adds up to two ghost keys a slot (one per list, with their links and map entries).
BOOKKEEPING_BYTES_PER_SLOT = 128
GHOST_BYTES_PER_SLOT = 200


def check_fits(
    settings: CacheSettings, *, page_slots: int, page_bytes: int, state_bytes: int, memory: int | None = None
) -> None:
    """Raises ``BadArgument`` naming the setting when the host pools, their bookkeeping and the L3 buffers cannot
    fit in this machine's memory: checked before anything is allocated, so no setting aborts the process."""
    if page_slots > INT32_MAX:
        raise BadArgument(
            f"setting host_bytes={settings.host_bytes} makes {page_slots} page slots of {page_bytes} "
            f"bytes; at most {INT32_MAX} are supported"
        )
    memory = machine_memory() if memory is None else memory
    if memory is None:
        return
    state_slots = settings.state_slots
    per_slot = BOOKKEEPING_BYTES_PER_SLOT + (GHOST_BYTES_PER_SLOT if settings.eviction_policy == "adaptive" else 0)
    pages = page_slots * (page_bytes + per_slot)
    states = state_slots * (state_bytes + per_slot)
    l3 = 0
    if settings.l3:  # the Store's segment and buffer, a group's scratch buffer, the staging, the seen-set
        l3 = settings.l3_segment_bytes + settings.l3_buffer_bytes + settings.l3_group_pages * page_bytes
        l3 += 0 if settings.l3_zero_copy else 2 * settings.l3_staging_bytes
        l3 += settings.l3_seen_keys * BOOKKEEPING_BYTES_PER_SLOT
    have = f"this machine has {format_bytes(memory)} ({memory} bytes) of memory"
    if pages > memory:
        raise BadArgument(f"setting host_bytes={settings.host_bytes} needs {pages} bytes with its bookkeeping; {have}")
    if pages + states > memory:
        raise BadArgument(
            f"setting state_slots={state_slots} needs {states} bytes ({state_bytes} per state with its "
            f"bookkeeping) beside host_bytes={settings.host_bytes}; {have}"
        )
    if pages + states + l3 > memory:
        raise BadArgument(
            f"settings l3_segment_bytes, l3_buffer_bytes, l3_group_pages, l3_staging_bytes and l3_seen_keys need "
            f"{l3} bytes beside the host pools; {have}"
        )
