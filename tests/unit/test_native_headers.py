"""The native core's headers tested in C, under AddressSanitizer and UBSan.

tests/native/test_headers.c includes every header of ext/ twice (each must be
guarded whole) and drives the status codes, the hashes, the split-block
filter, the record format, the claim table and the fuse filter directly, so
that an out-of-bounds access, a leak or undefined behaviour in C fails the
suite even on a path the Cython wrappers do not reach. Its XXH64 is also
compared with the xxhash library's on inputs of every length up to 199, and
its walk of LMDB's pages (ext/dc_mdb.h) with LMDB on a real file and on
damaged copies of it.
"""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import lmdb
import pytest
import xxhash

from tests.unit.test_lmdb_pages import NAME, _digests, _value

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "tests" / "native" / "test_headers.c"
FLAGS = [
    "-std=gnu11",
    "-O1",
    "-g",
    "-fno-omit-frame-pointer",
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-Wall",
    "-Wextra",
    "-Wno-unused-function",  # header-only: a test need not call every static helper
    "-Werror",
]


#: Builds of the headers: as the package is built, and with the fuse stacks' plain
#: loop over columns instead of vector compares (what compilers without vector
#: types get).
BUILDS = {"default": [], "no-simd": ["-DDC_FUSE_NO_SIMD"]}


def build_program(build: str, out_dir: Path) -> Path:
    """tests/native/test_headers.c built as ``build`` of BUILDS, under the sanitizers."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.fail("no C compiler on PATH: the package cannot be built without one either")
    out = out_dir / f"test_headers-{build}"
    compiled = subprocess.run(
        [
            cc,
            *FLAGS,
            *BUILDS[build],
            f"-I{REPO / 'ext'}",
            str(SOURCE),
            "-o",
            str(out),
            "-lm",
            "-pthread",
        ],
        capture_output=True,
        text=True,
    )
    assert compiled.returncode == 0, compiled.stderr
    return out


@pytest.fixture(scope="module", params=sorted(BUILDS))
def program(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_program(request.param, tmp_path_factory.mktemp("native"))


def test_headers_pass_their_c_tests_under_the_sanitizers(program: Path) -> None:
    run = subprocess.run([str(program)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    checks, failed = run.stdout.split()[0::2][:2]
    assert int(failed) == 0
    assert int(checks) > 1000, run.stdout


def test_native_xxh64_matches_the_xxhash_library(program: Path) -> None:
    run = subprocess.run([str(program), "xxh64"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    data = bytes((i * 37 + 11) & 0xFF for i in range(200))
    lines = run.stdout.splitlines()
    assert len(lines) == 200
    for line in lines:
        length, seed0, seed1 = (int(x) for x in line.split())
        assert seed0 == xxhash.xxh64_intdigest(data[:length], seed=0), length
        assert seed1 == xxhash.xxh64_intdigest(data[:length], seed=0x8000000000000001), length


# -- damaged files, under the sanitizers -----------------------------------------------


def _walk(
    walker: Path, data: Path, psize: int, record: bytes, keys: list[bytes], mode: str = "mdb"
) -> list[str]:
    """The keys looked up one by one ("mdb" mode), or in one dc_mdb_get_many in
    their order ("mdb-many": one "?" line where it could not be made)."""
    run = subprocess.run(
        [str(walker), mode, str(data), str(psize), record.hex()],
        input="".join(k.hex() + "\n" for k in keys),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert len(lines) == len(keys) or (mode == "mdb-many" and lines == ["?"])
    return lines


def _orders(keys: list[bytes], rng: random.Random) -> list[list[bytes]]:
    """The keys in byte order, reversed and shuffled: each batch lookup starts its
    walk below the deepest page of the last walk that holds the key, in any order."""
    shuffled = list(keys)
    rng.shuffle(shuffled)
    return [sorted(keys), sorted(keys, reverse=True), shuffled]


def _damaged(blob: bytearray, psize: int, rng: random.Random, rounds: int) -> list[bytearray]:
    """Copies of a data file with a byte overwritten in every page past the meta
    pages: in its header and first node pointers (odd rounds) or anywhere."""
    out = []
    for round_ in range(rounds):
        damaged = bytearray(blob)
        for page in range(2, len(blob) // psize):
            at = page * psize + rng.randrange(32 if round_ % 2 else psize)
            damaged[at] = rng.randrange(256)
        out.append(damaged)
    return out


def test_the_lmdb_walk_matches_lmdb_and_reads_nothing_outside_a_damaged_file(
    program: Path, tmp_path: Path
) -> None:
    """ext/dc_mdb.h's walk ("mdb" mode of test_headers.c) answers what LMDB
    answers on a file py-lmdb wrote, and reads nothing outside damaged copies of it
    (docs/warm-tier.md, "Lookups in native code")."""
    env = lmdb.open(str(tmp_path / "env"), max_dbs=4, map_size=1 << 28)
    keys = _digests(4000, seed=4)
    db = env.open_db(NAME)
    with env.begin(write=True) as txn:
        for i, k in enumerate(keys[::2]):
            txn.put(k, _value(i), db=db)
    psize = env.stat()["psize"]
    with env.begin(buffers=False) as txn:
        record = txn.get(NAME)
        want = {k: v for k, v in txn.cursor(db=db).getmulti(keys)}
    assert record is not None
    data = Path(env.path()) / "data.mdb"
    env.close()
    got = _walk(program, data, psize, record, keys)
    assert got == [want[k].hex() if k in want else "-" for k in keys]
    for order in _orders(keys, random.Random(4)):
        assert _walk(program, data, psize, record, order, "mdb-many") == [
            want[k].hex() if k in want else "-" for k in order
        ]
    # Damaged copies: bytes overwritten in every page's header and node pointers
    # and at seeded places in between. Any answer is allowed (the records carry
    # their own checksums); reading outside the file's bytes is not (ASan fails it).
    rng = random.Random(5)
    blob = bytearray(data.read_bytes())
    pages = len(blob) // psize
    for round_, damaged in enumerate(_damaged(blob, psize, rng, 16)):
        # The file's last pages hold the tree's upper levels (LMDB writes them
        # last): a node pointer or size there that ran past its page would run
        # past the file.
        for _ in range(64):
            at = (pages - 1 - rng.randrange(min(4, pages - 2))) * psize + rng.randrange(psize)
            damaged[at] = rng.randrange(256)
        copy = tmp_path / f"damaged-{round_}.mdb"
        copy.write_bytes(damaged)
        answers = _walk(program, copy, psize, record, keys[::7])
        assert all(a in ("-", "?") or len(a) % 2 == 0 for a in answers)
        for order in _orders(keys[::3], rng):
            answers = _walk(program, copy, psize, record, order, "mdb-many")
            assert all(a in ("-", "?") or len(a) % 2 == 0 for a in answers)
    # A file cut short: the pages past its end are beyond the mapping.
    cut = tmp_path / "cut.mdb"
    cut.write_bytes(blob[: 3 * psize])
    assert set(_walk(program, cut, psize, record, keys[:50])) <= {"?", "-"}
    assert _walk(program, cut, psize, record, keys, "mdb-many") == ["?"]


def _keys(walker: Path, data: Path, psize: int, record: bytes, batch: int) -> list[str]:
    run = subprocess.run(
        [str(walker), "mdb-keys", str(data), str(psize), record.hex(), str(batch)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines()


def test_the_walk_over_every_key_matches_lmdb_and_reads_nothing_outside_a_damaged_file(
    program: Path, tmp_path: Path
) -> None:
    """ext/dc_mdb.h's walk over every key of a database ("mdb-keys" mode) gives
    LMDB's keys in LMDB's order on a file py-lmdb wrote, in any batch size, and
    on damaged copies stops ("?") or ends without reading outside the file."""
    env = lmdb.open(str(tmp_path / "env"), max_dbs=4, map_size=1 << 28)
    db = env.open_db(NAME)
    with env.begin(write=True) as txn:
        for i, k in enumerate(_digests(6000, seed=9)):
            txn.put(k, _value(i % 50), db=db)
    psize = env.stat()["psize"]
    with env.begin(buffers=False) as txn:
        record = txn.get(NAME)
        want = [bytes(k).hex() for k in txn.cursor(db=db).iternext(keys=True, values=False)]
    assert record is not None and len(want) == 6000
    data = Path(env.path()) / "data.mdb"
    env.close()
    for batch in (1, 7, 1000, 10_000):
        assert _keys(program, data, psize, record, batch) == [*want, "end"]
    blob = bytearray(data.read_bytes())
    for round_, damaged in enumerate(_damaged(blob, psize, random.Random(11), 16)):
        copy = tmp_path / f"damaged-keys-{round_}.mdb"
        copy.write_bytes(damaged)
        lines = _keys(program, copy, psize, record, 100)
        assert lines[-1] in ("end", "?") and all(len(k) == 32 for k in lines[:-1])
    cut = tmp_path / "cut-keys.mdb"
    cut.write_bytes(blob[: 3 * psize])
    assert _keys(program, cut, psize, record, 100)[-1] == "?"
