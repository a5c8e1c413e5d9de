"""The promtool installer's unpacking, on a .deb built here: the `data.tar.*` member is
found past the others (odd-sized ones padded), and only promtool comes out, executable."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from tests.unit.helm.install_promtool import MEMBER, data_archive, extract_promtool


def _ar(members: list[tuple[str, bytes]]) -> bytes:
    out = bytearray(b"!<arch>\n")
    for name, body in members:
        header = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}`\n"
        out += header.encode("ascii") + body + (b"\n" if len(body) % 2 else b"")
    return bytes(out)


def _deb(tool: bytes) -> bytes:
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:xz") as tar:
        info = tarfile.TarInfo(MEMBER)
        info.size = len(tool)
        tar.addfile(info, io.BytesIO(tool))
    return _ar([("debian-binary", b"2.0\n"), ("control.tar.xz", b"odd"),
                ("data.tar.xz", data.getvalue())])  # fmt: skip


def test_promtool_comes_out_of_the_package_executable(tmp_path: Path) -> None:
    out = tmp_path / "promtool"
    extract_promtool(_deb(b"#!/bin/sh\necho promtool\n"), out)
    assert out.read_bytes() == b"#!/bin/sh\necho promtool\n"
    assert os.access(out, os.X_OK)
    assert not out.with_name("promtool.tmp").exists()


def test_what_is_not_a_package_is_refused() -> None:
    with pytest.raises(ValueError, match=r"not a \.deb"):
        data_archive(b"PK\x03\x04 a zip")
    with pytest.raises(ValueError, match=r"no data\.tar"):
        data_archive(_ar([("debian-binary", b"2.0\n")]))
