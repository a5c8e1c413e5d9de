"""Install Prometheus' `promtool` next to the venv's Python, for the chart's rule tests:
`python -m tests.unit.helm.install_promtool` (`make test` runs it).

Where it comes from: Debian bookworm's `prometheus` package (`PACKAGE_URL`), pinned by
its SHA-256; only `usr/bin/promtool` is taken out of it. Why Debian's: the project's
hosts reach the package registries but not GitHub, where Prometheus publishes its
release archives, and Debian builds promtool from the same sources.

Outcomes: already installed, nothing to do; installed; a wrong digest fails (exit 1:
a tampered or replaced package must never run); no amd64 Linux host, or no network,
is a warning (exit 0), and the promtool tests skip as they did before it was
installed, saying so in their skip reason.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import platform
import sys
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

PACKAGE_URL = (
    "http://deb.debian.org/debian/pool/main/p/prometheus/prometheus_2.42.0+ds-5+deb12u1_amd64.deb"
)
PACKAGE_SHA256 = "81d59a24fce84f7fbe97a45a4f2914b6a5881b5cd1db2a6a0e129e515e1a5f55"
MEMBER = "./usr/bin/promtool"
TIMEOUT_S = 120.0


def data_archive(deb: bytes) -> bytes:
    """The `data.tar.*` member of a .deb (an `ar` archive of three members)."""
    if not deb.startswith(b"!<arch>\n"):
        raise ValueError("not a .deb (ar) archive")
    pos = 8
    while pos + 60 <= len(deb):
        header = deb[pos : pos + 60]
        name = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        if name.startswith("data.tar"):
            return deb[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size % 2)  # members are padded to an even offset
    raise ValueError("the .deb has no data.tar member")


def extract_promtool(deb: bytes, out: Path) -> None:
    with tarfile.open(fileobj=io.BytesIO(data_archive(deb))) as tar:
        member = tar.extractfile(MEMBER)
        if member is None:
            raise ValueError(f"the package has no {MEMBER}")
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_bytes(member.read())
    tmp.chmod(0o755)
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(sys.executable).parent / "promtool")
    args = parser.parse_args(argv)
    if args.out.exists():
        return 0
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        print("promtool: no amd64 Linux package for this host; its tests will skip")
        return 0
    try:
        with urllib.request.urlopen(PACKAGE_URL, timeout=TIMEOUT_S) as resp:
            deb = resp.read()
    except (urllib.error.URLError, OSError) as exc:
        print(f"promtool: could not download {PACKAGE_URL} ({exc}); its tests will skip")
        return 0
    digest = hashlib.sha256(deb).hexdigest()
    if digest != PACKAGE_SHA256:
        print(f"promtool: {PACKAGE_URL} has SHA-256 {digest}, expected {PACKAGE_SHA256}")
        return 1
    extract_promtool(deb, args.out)
    print(f"promtool: installed {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
