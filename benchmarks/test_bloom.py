"""dedupcore's Bloom filter against what users would pick instead (benchmarks/README.md).

Every benchmark stores its per-key figures in ``extra_info`` (library,
operation, n_keys, ns_per_key from the fastest round, ns_per_key_median,
bits_per_key, fpr) and ``python -m benchmarks.report bloom`` turns the JSON
into ratios and verdicts. These are measurements, not tests: the only
assertions are sanity checks (no false negatives), never timings.

Every benchmark of one run probes the same keys, generated once per run
from fixed seeds. Sizes come from the environment (``--quick``: the second
figure)::

    DEDUPCORE_BENCH_N       keys per batch benchmark and filter capacity (10_000_000; 200_000)
    DEDUPCORE_BENCH_BIG     pre-hashed uint64 keys of the memory-bound benchmark
                            (100_000_000; 2_000_000)
    DEDUPCORE_BENCH_PURE_N  keys for the pure-Python pybloom-live (200_000; 20_000)
    DEDUPCORE_BENCH_FPR_N   absent keys of the false-positive measurement (1_000_000; 100_000)
    DEDUPCORE_BENCH_SEED    seed of every generated key set (20240601)
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import pytest

from benchmarks._support import SEED, env_int, random_keys, record

ROUNDS = 3


@dataclass(frozen=True)
class BenchConfig:
    n: int
    big: int
    pure_n: int
    fpr_n: int
    seed: int
    error_rate: float = 0.001
    key_bytes: int = 16


CONFIG = BenchConfig(
    n=env_int("DEDUPCORE_BENCH_N", 10_000_000, quick=200_000),
    big=env_int("DEDUPCORE_BENCH_BIG", 100_000_000, quick=2_000_000),
    pure_n=env_int("DEDUPCORE_BENCH_PURE_N", 200_000, quick=20_000),
    fpr_n=env_int("DEDUPCORE_BENCH_FPR_N", 1_000_000, quick=100_000),
    seed=SEED,
)
_record = functools.partial(record, bloom_bench=asdict(CONFIG))


@pytest.fixture(scope="module")
def cfg() -> BenchConfig:
    return CONFIG


@pytest.fixture(scope="module")
def keys(cfg: BenchConfig) -> list[bytes]:
    """N keys that are added to every filter (the present keys)."""
    return random_keys(cfg.n, cfg.seed)


@pytest.fixture(scope="module")
def absent_keys(cfg: BenchConfig) -> list[bytes]:
    """N keys never added (a different seed; a 128-bit collision is not a concern)."""
    return random_keys(cfg.n, cfg.seed + 1)


@pytest.fixture(scope="module")
def fpr_keys(cfg: BenchConfig) -> list[bytes]:
    """The absent keys of the false-positive-rate measurement."""
    return random_keys(cfg.fpr_n, cfg.seed + 2)


# ---------------------------------------------------------------- peers --


def _in_all(f: Any, keys: list[bytes]) -> list[bool]:
    return [k in f for k in keys]


def _add_each(f: Any, keys: list[bytes]) -> list[Any]:
    add = f.add
    return [add(k) for k in keys]


def _add_loop(f: Any, keys: list[bytes]) -> None:
    add = f.add
    for k in keys:
        add(k)


def _fastbloom_add_each(f: Any, keys: list[bytes]) -> list[Any]:
    add = f.add_bytes
    return [add(k) for k in keys]


def _fastbloom_contains_each(f: Any, keys: list[bytes]) -> list[bool]:
    contains = f.contains_bytes
    return [contains(k) for k in keys]


@dataclass(frozen=True)
class Lib:
    """How one library does each operation, as its users would write it (by default:
    ``in`` and ``add`` per key)."""

    name: str
    module: str
    make: Callable[[Any, int, float], Any]  # (module, capacity, error_rate) -> filter
    add_batch: Callable[[Any, list[bytes]], Any]
    nbytes: Callable[[Any], int]
    add_batch_call: str
    contains_batch: Callable[[Any, list[bytes]], Sequence[bool]] = _in_all
    add_single: Callable[[Any, list[bytes]], Any] = _add_each
    contains_single: Callable[[Any, list[bytes]], Sequence[bool]] = _in_all
    contains_batch_call: str = "[k in f for k in keys]"
    add_single_call: str = "[f.add(k) for k in keys]"
    contains_single_call: str = "[k in f for k in keys]"
    pure_python: bool = False  # benchmarked on DEDUPCORE_BENCH_PURE_N keys
    is_filter: bool = True  # False for the exact set (a reference, not a peer)


LIBS: dict[str, Lib] = {
    lib.name: lib
    for lib in [
        Lib(
            "dedupcore",
            "dedupcore",
            make=lambda m, cap, er: m.BloomFilter(cap, er),
            add_batch=lambda f, keys: f.add_many(keys),
            contains_batch=lambda f, keys: f.contains_many(keys),
            nbytes=lambda f: f.nbytes,
            add_batch_call="f.add_many(keys)",
            contains_batch_call="f.contains_many(keys)",
        ),
        Lib(
            "abloom",
            "abloom",
            make=lambda m, cap, er: m.BloomFilter(cap, er),
            add_batch=lambda f, keys: f.update(keys),
            nbytes=lambda f: f.byte_count,
            add_batch_call="f.update(keys)",
        ),
        Lib(
            "rbloom",
            "rbloom",
            make=lambda m, cap, er: m.Bloom(cap, er),
            add_batch=lambda f, keys: f.update(keys),
            nbytes=lambda f: f.size_in_bits // 8,
            add_batch_call="f.update(keys)",
        ),
        Lib(
            # check_type=False skips the wrapper's Python-level isinstance loop:
            # the fastest public form of the call (about 50 ns/key faster).
            "fastbloom-rs",
            "fastbloom_rs",
            make=lambda m, cap, er: m.BloomFilter(cap, er),
            add_batch=lambda f, keys: f.add_bytes_batch(keys),
            contains_batch=lambda f, keys: f.contains_bytes_batch(keys, check_type=False),
            add_single=_fastbloom_add_each,
            contains_single=_fastbloom_contains_each,
            nbytes=lambda f: f.config().size() // 8,
            add_batch_call="f.add_bytes_batch(keys)",
            contains_batch_call="f.contains_bytes_batch(keys, check_type=False)",
            add_single_call="[f.add_bytes(k) for k in keys]",
            contains_single_call="[f.contains_bytes(k) for k in keys]",
        ),
        Lib(
            "pybloomfiltermmap3",
            "pybloomfilter",
            make=lambda m, cap, er: m.BloomFilter(cap, er),  # in memory, no file
            add_batch=lambda f, keys: f.update(keys),
            nbytes=lambda f: f.num_bits // 8,
            add_batch_call="f.update(keys)",
        ),
        Lib(
            "pybloom-live",
            "pybloom_live",
            make=lambda m, cap, er: m.BloomFilter(cap, er),
            add_batch=_add_loop,  # no batch API
            nbytes=lambda f: f.num_bits // 8,
            add_batch_call="for k in keys: f.add(k)",
            pure_python=True,
        ),
        Lib(
            "set",
            "builtins",
            make=lambda m, cap, er: set(),
            add_batch=lambda f, keys: f.update(keys),
            nbytes=sys.getsizeof,  # the hash table only, not the key objects
            add_batch_call="s.update(keys)",
            contains_batch_call="[k in s for k in keys]",
            add_single_call="[s.add(k) for k in keys]",
            contains_single_call="[k in s for k in keys]",
            is_filter=False,
        ),
    ]
}

LIB_NAMES = list(LIBS)


class Peer:
    """A library ready to run: its module imported (or the test skipped)."""

    def __init__(self, lib: Lib, cfg: BenchConfig) -> None:
        self.lib = lib
        self.module = pytest.importorskip(lib.module)
        self.cfg = cfg
        self.n = cfg.pure_n if lib.pure_python else cfg.n
        self.n = min(self.n, cfg.n)

    def fresh(self) -> Any:
        return self.lib.make(self.module, self.n, self.cfg.error_rate)

    def bits_per_key(self, f: Any) -> float:
        return self.lib.nbytes(f) * 8 / self.n


_filled: dict[str, Any] = {}


@pytest.fixture(scope="module")
def filled(cfg: BenchConfig, keys: list[bytes]) -> Callable[[Peer], Any]:
    """A filter per library holding its n present keys, built once per run."""

    def get(peer: Peer) -> Any:
        name = peer.lib.name
        if name not in _filled:
            f = peer.fresh()
            peer.lib.add_batch(f, keys[: peer.n])
            _filled[name] = f
        return _filled[name]

    yield get
    _filled.clear()


# ----------------------------------------------------------- 16-byte keys --


@pytest.mark.parametrize("name", LIB_NAMES)
@pytest.mark.parametrize("form", ["batch", "single"])
def test_add(benchmark: Any, cfg: BenchConfig, keys: list[bytes], form: str, name: str) -> None:
    """Adding n keys into a fresh filter sized for them (allocation excluded): the
    library's batch call, or one call per key (``[f.add(k) for k in keys]``)."""
    peer = Peer(LIBS[name], cfg)
    lib = peer.lib
    add, call = (
        (lib.add_batch, lib.add_batch_call)
        if form == "batch"
        else (lib.add_single, lib.add_single_call)
    )
    batch = keys[: peer.n]
    operation = f"add_{form}"
    benchmark.group = operation
    made: list[Any] = []

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        made[:] = [peer.fresh()]
        return (made[0], batch), {}

    benchmark.pedantic(add, setup=setup, rounds=ROUNDS, iterations=1)
    _record(
        benchmark,
        library=name,
        operation=operation,
        n_keys=peer.n,
        call=call,
        bits_per_key=peer.bits_per_key(made[0]),
    )


@pytest.mark.parametrize("present", [True, False], ids=["present", "absent"])
@pytest.mark.parametrize("name", LIB_NAMES)
@pytest.mark.parametrize("form", ["batch", "single"])
def test_contains(
    benchmark: Any,
    cfg: BenchConfig,
    keys: list[bytes],
    absent_keys: list[bytes],
    filled: Callable[[Peer], Any],
    form: str,
    name: str,
    present: bool,
) -> None:
    """Membership of n keys, all present or all absent, in a full filter: the library's
    batch call, or one call per key (``[k in f for k in keys]`` or its single-key method)."""
    peer = Peer(LIBS[name], cfg)
    lib = peer.lib
    contains, call = (
        (lib.contains_batch, lib.contains_batch_call)
        if form == "batch"
        else (lib.contains_single, lib.contains_single_call)
    )
    f = filled(peer)
    batch = (keys if present else absent_keys)[: peer.n]
    operation = f"contains_{form}_" + ("present" if present else "absent")
    benchmark.group = operation
    result = benchmark.pedantic(contains, args=(f, batch), rounds=ROUNDS, iterations=1)
    hits = sum(result)
    assert len(result) == peer.n
    if present:
        assert hits == peer.n, f"{name}: {peer.n - hits} false negatives"
    _record(
        benchmark,
        library=name,
        operation=operation,
        n_keys=peer.n,
        call=call,
        bits_per_key=peer.bits_per_key(f),
        **({} if present else {"absent_hits": hits / peer.n}),
    )


@pytest.mark.parametrize("name", LIB_NAMES)
def test_fpr_memory(
    benchmark: Any,
    cfg: BenchConfig,
    fpr_keys: list[bytes],
    filled: Callable[[Peer], Any],
    name: str,
) -> None:
    """Memory (bits per key of capacity) and measured false-positive rate.

    The filter holds exactly its capacity of keys (n; pybloom-live: pure_n)
    at error_rate 0.001; the fpr_n absent keys go through the batch membership.
    """
    peer = Peer(LIBS[name], cfg)
    f = filled(peer)
    benchmark.group = "fpr_memory"
    result = benchmark.pedantic(peer.lib.contains_batch, args=(f, fpr_keys), rounds=1, iterations=1)
    false_positives = sum(result)
    _record(
        benchmark,
        library=name,
        operation="fpr_memory",
        n_keys=len(fpr_keys),
        call=peer.lib.contains_batch_call,
        capacity=peer.n,
        nbytes=peer.lib.nbytes(f),
        bits_per_key=peer.bits_per_key(f),
        false_positives=false_positives,
        fpr=false_positives / len(fpr_keys),
    )


# --------------------------------------------------- dedupcore phases --


@pytest.fixture(scope="module")
def prehashed(keys: list[bytes]) -> Any:
    """The present keys as hashed by a seed-0 filter, as a uint64 buffer."""
    from dedupcore import _core

    return _core.hash64_many(keys, 0)


@pytest.mark.parametrize("phase", ["hash", "add_prehashed", "contains_prehashed"])
def test_dedupcore_phase(
    benchmark: Any,
    cfg: BenchConfig,
    keys: list[bytes],
    prehashed: Any,
    filled: Callable[[Peer], Any],
    phase: str,
) -> None:
    """Where add_many/contains_many spend their time.

    ``hash``: hash64_many over the key list (GIL-held pass over the list
    objects, XXH64, copy out). ``add_prehashed``/``contains_prehashed``: the
    probe loops alone, on the uint64 buffer of the same keys.
    """
    from dedupcore import _core

    peer = Peer(LIBS["dedupcore"], cfg)
    benchmark.group = "dedupcore_phase"
    operation = "phase_" + phase
    if phase == "hash":
        benchmark.pedantic(_core.hash64_many, args=(keys, 0), rounds=ROUNDS, iterations=1)
        call = "_core.hash64_many(keys)"
    elif phase == "add_prehashed":

        def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
            return (peer.fresh(), prehashed), {}

        benchmark.pedantic(lambda f, h: f.add_many(h), setup=setup, rounds=ROUNDS, iterations=1)
        call = "f.add_many(uint64 hashes)"
    else:
        f = filled(peer)
        result = benchmark.pedantic(f.contains_many, args=(prehashed,), rounds=ROUNDS, iterations=1)
        assert sum(result) == cfg.n
        call = "f.contains_many(uint64 hashes)"
    _record(benchmark, library="dedupcore", operation=operation, n_keys=cfg.n, call=call)


# ------------------------------------------- pre-hashed, memory bound --


@pytest.fixture(scope="module")
def big(cfg: BenchConfig) -> Any:
    """BIG random uint64 keys, a filter full of them, and the gather baseline."""
    np = pytest.importorskip("numpy")
    from dedupcore import BloomFilter

    rng = np.random.default_rng(cfg.seed + 3)
    hashes = rng.integers(0, 2**64 - 1, size=cfg.big, dtype=np.uint64, endpoint=True)
    full = BloomFilter(cfg.big, cfg.error_rate)
    full.add_many(hashes)
    words = full.nbytes // 8
    # A uint64 array of the filter's size, with every page really backed
    # (np.zeros would map one shared zero page), and as many random indexes
    # as there are keys.
    table = np.arange(words, dtype=np.uint64)
    idx = rng.integers(0, words, size=cfg.big, dtype=np.intp)
    data = {"np": np, "hashes": hashes, "full": full, "table": table, "idx": idx}
    yield data
    data.clear()


def _gather(table: Any, idx: Any) -> Any:
    return table[idx].sum()


@pytest.mark.parametrize(
    ("operation", "name"),
    [
        ("big_add", "dedupcore"),
        ("big_add", "numpy-gather"),
        ("big_contains", "dedupcore"),
        ("big_contains", "numpy-gather"),
    ],
)
def test_big_prehashed(
    benchmark: Any, cfg: BenchConfig, big: Any, operation: str, name: str
) -> None:
    """BIG pre-hashed uint64 keys against a random gather over an array of the filter's size.

    The gather is measured next to each dedupcore operation (same run, same
    noise). add_many gets a fresh filter per round whose pages are touched in
    setup, since the gather's array is resident too.
    """
    from dedupcore import BloomFilter

    np = big["np"]
    full = big["full"]
    benchmark.group = operation
    bits = full.nbytes * 8 / cfg.big
    if name == "numpy-gather":
        benchmark.pedantic(_gather, args=(big["table"], big["idx"]), rounds=ROUNDS, iterations=1)
        call = f"table[idx].sum()  (table: {full.nbytes // 8} uint64)"
    elif operation == "big_add":

        def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
            f = BloomFilter(cfg.big, cfg.error_rate)
            np.frombuffer(f, dtype=np.uint8)[::4096] = 0  # fault every page in
            return (f, big["hashes"]), {}

        benchmark.pedantic(lambda f, h: f.add_many(h), setup=setup, rounds=ROUNDS, iterations=1)
        call = "f.add_many(uint64 array)"
    else:
        result = benchmark.pedantic(
            full.contains_many, args=(big["hashes"],), rounds=ROUNDS, iterations=1
        )
        assert np.frombuffer(result, dtype=np.bool_).all()
        call = "f.contains_many(uint64 array)"
    _record(
        benchmark,
        library=name,
        operation=operation,
        n_keys=cfg.big,
        call=call,
        bits_per_key=bits,
        filter_nbytes=full.nbytes,
    )
