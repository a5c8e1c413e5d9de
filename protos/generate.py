"""Regenerate the committed Python stubs: `python protos/generate.py [OUT_DIR]`.

Stubs are committed so an installed wheel imports them without grpcio-tools; the test
tests/unit/protos/test_stubs_fresh.py regenerates into a temp dir and fails if they differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent


def generate(out_dir: Path) -> None:
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "pdserve" / "v1").glob("*.proto"))
    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}",
            f"--pyi_out={out_dir}", *sources]  # fmt: skip
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
