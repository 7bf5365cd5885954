"""The native core's headers tested in C, under AddressSanitizer and UBSan.

tests/native/test_headers.c includes every header of ext/ twice (each must be
guarded whole) and drives the status codes, the hashes, the split-block
filter, the record format, the claim table and the fuse filter directly, so
that an out-of-bounds access, a leak or undefined behaviour in C fails the
suite even on a path the Cython wrappers do not reach. Its XXH64 is also
compared with the xxhash library's on inputs of every length up to 199.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import xxhash

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


@pytest.fixture(scope="module", params=sorted(BUILDS))
def program(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.fail("no C compiler on PATH: the package cannot be built without one either")
    out = tmp_path_factory.mktemp("native") / f"test_headers-{request.param}"
    build = subprocess.run(
        [
            cc,
            *FLAGS,
            *BUILDS[request.param],
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
    assert build.returncode == 0, build.stderr
    return out


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
