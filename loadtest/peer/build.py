"""`python -m loadtest.peer.build`: llama.cpp's `llama-server` and a bf16 GGUF of the
served model, for the peer benchmark (`loadtest.peer.bench`).

Lifecycle, every step skipped when its output is already there (so a second run does
nothing but check):

1. download: `pip download --no-binary :all: --no-deps llama-cpp-python==<version>`
   (the source distribution; its vendored llama.cpp carries the server) into
   `<cache>/llama-cpp-python-<version>/sdist/`;
2. unpack it into `src/` (through a staging directory renamed into place, so a broken
   unpack is never taken for a finished one);
3. configure with cmake (Release, CPU only, static libraries, no curl, OpenSSL or web
   UI download: the registries are the only network this host has) into `build/`;
4. build the `llama-server` target and nothing else, and copy the binary to `bin/`;
5. convert the model directory pdserve serves (`engine.model_store.resolve_model_dir`)
   to `gguf/<name>-bf16.gguf` with the vendored `convert_hf_to_gguf.py` and the
   vendored gguf-py, next to a `.source` file naming the directory and its source
   marker: a different model (or a re-converted one) is converted again.

Configure, build and convert run under `nice -n <nice>` with `-j <jobs>` (default 19 and
2: the 2-core development host is shared). The converter's Python dependencies are the
`peer` extra (`pip install -e '.[peer]'`); torch, numpy and transformers come with the
project and its test extra.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.model_store import MARKER_NAME, resolve_model_dir
from loadtest.harness.settings import RunSettings
from services.common.config import add_config_args, config_from_args

#: The pinned llama-cpp-python release whose vendored llama.cpp is built.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
DEFAULT_CACHE = Path("~/.cache/pdserve/peer")
SERVER_TARGET = "llama-server"

#: cmake cache entries of the build: CPU only, one self-contained binary, and nothing
#: that reaches for the network (curl, OpenSSL, the prebuilt web UI) or builds more
#: than the server.
CMAKE_OPTIONS = {
    "CMAKE_BUILD_TYPE": "Release",
    "BUILD_SHARED_LIBS": "OFF",
    "GGML_NATIVE": "ON",
    "GGML_CUDA": "OFF",
    "GGML_VULKAN": "OFF",
    "GGML_METAL": "OFF",
    "LLAMA_CURL": "OFF",
    "LLAMA_OPENSSL": "OFF",
    "LLAMA_BUILD_UI": "OFF",
    "LLAMA_USE_PREBUILT_UI": "OFF",
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_BUILD_TOOLS": "ON",
    "LLAMA_BUILD_SERVER": "ON",
}


@dataclass(frozen=True)
class PeerBuildConfig:
    llama_cpp_python_version: str = field(
        default=LLAMA_CPP_PYTHON_VERSION,
        metadata={"help": "llama-cpp-python release whose vendored llama.cpp is built"},
    )
    peer_cache_dir: Path = field(
        default=DEFAULT_CACHE, metadata={"help": "where the source, build, binary and GGUF go"}
    )
    build_jobs: int = field(default=2, metadata={"help": "parallel compile jobs"})
    build_nice: int = field(
        default=19, metadata={"help": "niceness of configure, build and convert (0: none)"}
    )

    def __post_init__(self) -> None:
        if self.build_jobs < 1:
            raise ValueError(f"build_jobs must be >= 1, got {self.build_jobs}")
        if not 0 <= self.build_nice <= 19:
            raise ValueError(f"build_nice must be in [0, 19], got {self.build_nice}")


@dataclass(frozen=True)
class PeerPaths:
    """Where each step of one version's build puts its output."""

    root: Path
    version: str

    @classmethod
    def of(cls, cfg: PeerBuildConfig) -> PeerPaths:
        root = cfg.peer_cache_dir.expanduser() / f"llama-cpp-python-{cfg.llama_cpp_python_version}"
        return cls(root, cfg.llama_cpp_python_version)

    @property
    def sdist_dir(self) -> Path:
        return self.root / "sdist"

    @property
    def sdist(self) -> Path:
        return self.sdist_dir / f"llama_cpp_python-{self.version}.tar.gz"

    @property
    def src(self) -> Path:
        return self.root / "src"

    @property
    def llama_cpp(self) -> Path:
        """The vendored llama.cpp inside the unpacked source distribution."""
        return self.src / f"llama_cpp_python-{self.version}" / "vendor" / "llama.cpp"

    @property
    def build(self) -> Path:
        return self.root / "build"

    @property
    def server(self) -> Path:
        return self.root / "bin" / SERVER_TARGET

    def gguf(self, model_dir: Path) -> Path:
        return self.root / "gguf" / f"{model_dir.name}-bf16.gguf"


def niced(cmd: Sequence[str], nice: int) -> list[str]:
    return ["nice", "-n", str(nice), *cmd] if nice else list(cmd)


def download_command(version: str, dest: Path, python: str = sys.executable) -> list[str]:
    return [python, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
            f"llama-cpp-python=={version}", "-d", str(dest)]  # fmt: skip


def configure_command(source: Path, build: Path) -> list[str]:
    options = [f"-D{k}={v}" for k, v in CMAKE_OPTIONS.items()]
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    return ["cmake", "-S", str(source), "-B", str(build), *generator, *options]


def build_command(build: Path, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build), "--target", SERVER_TARGET, "-j", str(jobs)]


def convert_command(
    llama_cpp: Path, model_dir: Path, out: Path, python: str = sys.executable
) -> list[str]:
    return [python, str(llama_cpp / "convert_hf_to_gguf.py"), str(model_dir),
            "--outtype", "bf16", "--outfile", str(out)]  # fmt: skip


def converter_env(llama_cpp: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the converter: the vendored gguf-py first on PYTHONPATH, so
    the converter runs against the gguf it was written for, not the installed one."""
    env = dict(os.environ if environ is None else environ)
    parts = [str(llama_cpp / "gguf-py"), *filter(None, env.get("PYTHONPATH", "").split(":"))]
    env["PYTHONPATH"] = ":".join(parts)
    return env


def model_source(model_dir: Path) -> dict[str, str]:
    """What the GGUF was converted from: the directory and its conversion marker (the
    default model's `.pdserve-source`; else the weights' sizes and times)."""
    marker = model_dir / MARKER_NAME
    if marker.is_file():
        stamp = marker.read_text(encoding="utf-8")
    else:
        weights = sorted(model_dir.glob("*.safetensors"))
        stamp = ";".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in weights)
    return {"model_dir": str(model_dir.resolve()), "source": stamp}


def _run(cmd: Sequence[str], env: dict[str, str] | None = None) -> None:
    print("peer build: " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, env=env)


def _download(paths: PeerPaths) -> None:
    if paths.sdist.is_file():
        return
    paths.sdist_dir.mkdir(parents=True, exist_ok=True)
    _run(download_command(paths.version, paths.sdist_dir))
    if not paths.sdist.is_file():
        raise RuntimeError(f"pip download did not leave {paths.sdist}")


def _unpack(paths: PeerPaths) -> None:
    if paths.llama_cpp.is_dir():
        return
    paths.root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".src-", dir=paths.root))
    try:
        with tarfile.open(paths.sdist) as tar:
            tar.extractall(staging, filter="data")
        if paths.src.exists():
            shutil.rmtree(paths.src)
        staging.rename(paths.src)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if not paths.llama_cpp.is_dir():
        raise RuntimeError(f"{paths.sdist} holds no vendor/llama.cpp")


def build_server(cfg: PeerBuildConfig) -> Path:
    """Steps 1-4; returns the server binary."""
    paths = PeerPaths.of(cfg)
    if paths.server.is_file():
        return paths.server
    _download(paths)
    _unpack(paths)
    if not (paths.build / "CMakeCache.txt").is_file():
        _run(niced(configure_command(paths.llama_cpp, paths.build), cfg.build_nice))
    _run(niced(build_command(paths.build, cfg.build_jobs), cfg.build_nice))
    built = paths.build / "bin" / SERVER_TARGET
    paths.server.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, paths.server.with_suffix(".tmp"))
    paths.server.with_suffix(".tmp").rename(paths.server)
    return paths.server


def convert_model(cfg: PeerBuildConfig, model_dir: Path) -> Path:
    """Step 5; returns the bf16 GGUF of `model_dir`."""
    paths = PeerPaths.of(cfg)
    out = paths.gguf(model_dir)
    stamp = out.with_name(out.name + ".source")
    source = model_source(model_dir)
    if out.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == source:
        return out
    _download(paths)
    _unpack(paths)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    cmd = niced(convert_command(paths.llama_cpp, model_dir, tmp), cfg.build_nice)
    _run(cmd, env=converter_env(paths.llama_cpp))
    tmp.rename(out)
    stamp.write_text(json.dumps(source), encoding="utf-8")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.peer.build", description=(__doc__ or "").splitlines()[0]
    )
    add_config_args(parser, PeerBuildConfig)
    add_config_args(parser, RunSettings, exclude=("out", "seed"))
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(PeerBuildConfig, args)
        settings = config_from_args(RunSettings, args)
    except ValueError as exc:
        parser.error(str(exc))
    model_dir = resolve_model_dir(settings.model, settings.model_cache_dir.expanduser())
    try:
        server = build_server(cfg)
        gguf = convert_model(cfg, model_dir)
    except (subprocess.CalledProcessError, RuntimeError) as exc:
        print(f"peer build failed: {exc}", file=sys.stderr)
        return 1
    print(f"llama-server: {server}\ngguf: {gguf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
