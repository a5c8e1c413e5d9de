"""Freshness of committed results: digests of the paths a benchmark measures, taken from
the working tree or a commit; a result whose sources changed reads stale since the first
commit that changed them; a doc that quotes a stale result must say so; every benchmark
of `make bench` declares what it measures, and every committed result records it."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from loadtest.harness.target import TargetResult
from loadtest.reports import provenance, results
from loadtest.reports.freshness import NO_SOURCES, undated
from loadtest.reports.provenance import Host, Provenance, cpu_flags, memory_bytes
from loadtest.reports.quotes import QuotedResult, anchor, pages, ratio_quotes, unmarked_quotes
from loadtest.reports.result_file import read_result, write_result
from loadtest.reports.sources import (
    SourceOrigin,
    Tree,
    changed,
    check_paths,
    is_shallow,
    record,
)

ROOT = Path(__file__).resolve().parents[3]
HOST = Host("bench-host", "Example CPU", 2, 2, "3.11.9", "Linux")


class Repo:
    """A scratch git repository."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.git("init", "-q")

    def git(self, *args: str) -> str:
        who = ["-c", "user.name=t", "-c", "user.email=t@example.com"]
        done = subprocess.run(
            ["git", *who, *args], cwd=self.root, check=True, capture_output=True, text=True
        )
        return done.stdout.strip()

    def commit(self, files: dict[str, str], message: str) -> str:
        for name, text in files.items():
            (self.root / name).parent.mkdir(parents=True, exist_ok=True)
            (self.root / name).write_text(text)
        self.git("add", "-A")
        self.git("commit", "-qm", message)
        return self.git("rev-parse", "HEAD")


@dataclass(frozen=True)
class Report:
    schema: str = "pdserve.spec_bench/1"
    targets: list[TargetResult] = field(
        default_factory=lambda: [TargetResult.check("spec / off", 1.91, ">=", 1.8)]
    )


def _result(dir: Path, commit: str | None, tree: Tree | None, measures: list[str]) -> Path:
    sources = record(measures, tree) if tree is not None else None
    prov = Provenance(commit, False, "2026-01-02T03:04:05+00:00", "bench", HOST, sources)
    return write_result(dir / "spec.json", Report(), prov)


# -- digests ------------------------------------------------------------------------
def test_the_working_tree_and_the_commit_digest_alike_until_a_file_changes(
    tmp_path: Path,
) -> None:
    repo = Repo(tmp_path)
    repo.commit({"pkg/a.py": "a = 1\n", "pkg/sub/b.py": "b = 2\n", "c.py": "c\n"}, "one")
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0cache")
    work, head = Tree(tmp_path), Tree.at("HEAD", tmp_path)
    assert head is not None and head.commit == repo.git("rev-parse", "HEAD")
    measured = ["pkg", "c.py"]
    before = record(measured, work)
    assert before.origin is SourceOrigin.RUN
    assert record(measured, head) == type(before)(before.digests, SourceOrigin.COMMIT)
    assert changed(before, Tree(tmp_path)) == []
    (tmp_path / "pkg" / "sub" / "b.py").write_text("b = 3\n")  # an edit
    assert changed(before, Tree(tmp_path)) == ["pkg"]
    (tmp_path / "pkg" / "sub" / "b.py").write_text("b = 2\n")
    (tmp_path / "pkg" / "sub" / "b.py").rename(tmp_path / "pkg" / "sub" / "c.py")  # a rename
    assert changed(before, Tree(tmp_path)) == ["pkg"]
    (tmp_path / "c.py").unlink()  # a deleted file reads as changed, not as an error
    assert changed(before, Tree(tmp_path)) == ["pkg", "c.py"]
    assert Tree.at("f" * 40, tmp_path) is None


@pytest.mark.parametrize("paths", [["/etc"], ["../x"], ["a", "a/"], [""]])
def test_a_measured_path_must_be_relative_inside_and_once(paths: list[str]) -> None:
    with pytest.raises(ValueError, match="measured path"):
        check_paths(paths)


# -- stale since the first change -----------------------------------------------------
def test_a_result_is_stale_since_the_first_commit_that_changed_its_sources(
    tmp_path: Path,
) -> None:
    repo = Repo(tmp_path / "repo")
    measured = repo.commit({"kernel.py": "fast\n", "other.py": "x\n"}, "measured")
    repo.commit({"other.py": "y\n"}, "not measured")
    out = tmp_path / "results"
    _result(out, measured, Tree(repo.root), ["kernel.py"])
    head = Tree.at("HEAD", repo.root)
    assert head is not None
    page = results.render(out, tmp_path, {}, head)
    assert "Not current" not in page and "| met |" in page

    changing = repo.commit({"kernel.py": "faster\n"}, "the kernel")
    repo.commit({"kernel.py": "fastest\n"}, "again")
    head = Tree.at("HEAD", repo.root)
    assert head is not None
    page = results.render(out, tmp_path, {}, head)
    assert (
        f"**Not current.** Stale since `{changing[:12]}`: its measured sources changed since "
        "the run: `kernel.py`." in page
    )
    assert "| not current |" in page and "Targets met in the current results: 0 of 0." in page


def test_a_shallow_clone_compares_the_page_without_the_dates(tmp_path: Path) -> None:
    repo = Repo(tmp_path / "repo")
    repo.commit({"a.py": "1\n"}, "one")
    repo.commit({"a.py": "2\n"}, "two")
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo.root}",
                    str(tmp_path / "shallow")], check=True)  # fmt: skip
    assert is_shallow(tmp_path / "shallow") and not is_shallow(repo.root)
    dated = "**Not current.** Stale since `0123456789ab`: its measured sources changed since"
    assert undated(dated) == "**Not current.** Stale: its measured sources changed since"
    by_hand = "Stale since `0123456789ab`: measured before the fused kernel"
    assert undated(by_hand) == by_hand  # the registry's dates are in the files: kept


def test_a_result_without_sources_is_not_current(tmp_path: Path) -> None:
    _result(tmp_path, "ab" * 20, None, [])
    page = results.render(tmp_path, tmp_path.parent, {}, Tree(tmp_path))
    assert f"**Not current.** Stale: {NO_SOURCES}." in page


# -- quotes in the docs -------------------------------------------------------------
SPEC = QuotedResult("spec", "spec.json", "Speculative decoding", frozenset({"1.91x"}))


@pytest.mark.parametrize(
    "quote",
    [
        "Speculation ran at 1.91x on the repetitive workload.",
        "See [the result](results/spec.json).",
        "See [benchmarks.md](benchmarks.md#speculative-decoding).",
    ],
)
def test_a_paragraph_quoting_a_stale_result_must_say_so(tmp_path: Path, quote: str) -> None:
    page = tmp_path / "guide.md"
    page.write_text(f"# Guide\n\nOther text.\n\nFirst line.\n{quote}\n\nMore.\n")
    found = unmarked_quotes([SPEC], [page])
    assert [(q.line, q.result) for q in found] == [(5, "spec")]
    assert "guide.md:5: quotes result 'spec'" in str(found[0])
    page.write_text(f"First line.\n{quote} That result is stale: the kernel changed.\n")
    assert unmarked_quotes([SPEC], [page]) == []


def test_a_paragraph_linking_a_current_result_quotes_that_one(tmp_path: Path) -> None:
    fresh = QuotedResult("kv", "kv.json", "KV memory", frozenset({"1.91x"}), current=True)
    page = tmp_path / "guide.md"
    page.write_text("The cache holds 1.91x the blocks ([kv](benchmarks.md#kv-memory)).\n")
    assert unmarked_quotes([SPEC, fresh], [page]) == []
    page.write_text("[kv](benchmarks.md#kv-memory); [spec](results/spec.json).\n")
    assert [q.result for q in unmarked_quotes([SPEC, fresh], [page])] == ["spec"]
    page.write_text("The cache holds 1.91x the blocks.\n")  # no link: it could be either
    assert [q.result for q in unmarked_quotes([SPEC, fresh], [page])] == ["spec"]


def test_what_is_not_a_quote(tmp_path: Path) -> None:
    page = tmp_path / "guide.md"
    page.write_text("It ran at 11.91x, 1.912x and 21.91x here (other runs).\n")
    assert unmarked_quotes([SPEC], [page]) == []
    page.write_text("A fresh run writes bench-results/spec.json.\n")  # not the committed file
    assert unmarked_quotes([SPEC], [page]) == []
    assert ratio_quotes([{"measured": 0.7243}, {"measured": 1.001}, {"measured": "n/a"}]) == {
        "0.72x"
    }
    assert anchor("Engine against this machine's roofs") == "engine-against-this-machines-roofs"
    assert anchor("Load sweep (pdserve-bench)") == "load-sweep-pdserve-bench"
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("a.md", "benchmarks.md", "history.md"):
        (docs / name).write_text("x\n")
    assert [p.name for p in pages(tmp_path / "README.md", docs)] == ["README.md", "a.md"]


def test_the_check_fails_on_an_unmarked_quote_then_passes(tmp_path: Path) -> None:
    out, docs = tmp_path / "results", tmp_path / "docs"
    _result(out, "ab" * 20, None, [])  # no sources: not current
    docs.mkdir()
    readme = tmp_path / "README.md"
    readme.write_text("Speculation: 1.91x.\n")
    args = ["--results-dir", str(out), "--markdown", str(docs / "benchmarks.md"),
            "--readme", str(readme)]  # fmt: skip
    assert results.main(args) == 0  # writes the page
    assert results.main([*args, "--check", "true"]) == 1
    readme.write_text("Speculation: 1.91x (a stale result).\n")
    assert results.main([*args, "--check", "true"]) == 0


# -- the declarations and the committed results -------------------------------------
def _bench_modules() -> list[str]:
    makefile = (ROOT / "Makefile").read_text()
    bench = makefile[makefile.index("\nbench:") : makefile.index("\nbench-docs:")]
    return re.findall(r"python -m (loadtest\.[\w.]+)", bench)


def test_every_benchmark_declares_paths_that_exist() -> None:
    modules = _bench_modules()
    assert len(modules) >= 15
    for name in modules:
        module = importlib.import_module(name)
        measures = getattr(module, "MEASURES", None)
        assert measures, f"{name} declares no MEASURES"
        check_paths(measures)
        for path in measures:
            assert (ROOT / path).exists(), f"{name}: {path} does not exist"
        spec = getattr(module, "SPEC", None)
        if spec is not None:  # the harness's benchmarks pass them through their spec
            assert spec.measures == measures, name


def test_every_committed_result_records_its_sources() -> None:
    for path in results.result_paths(ROOT / "docs" / "results"):
        sources = read_result(path)["provenance"].get("sources")
        assert sources and sources["digests"], path
        assert sources["origin"] in {o.value for o in SourceOrigin}


# -- the host -----------------------------------------------------------------------
def test_the_host_names_its_kernel_flags_and_memory(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma avx512f avx512_bf16 amx_tile\n")
    assert cpu_flags(info) == ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")
    assert cpu_flags(tmp_path / "missing") == ()
    mem = tmp_path / "meminfo"
    mem.write_text("MemTotal:       24576000 kB\nMemFree: 1 kB\n")
    assert memory_bytes(mem) == 24576000 * 1024 and memory_bytes(tmp_path / "missing") == 0
    host = provenance.host_info()
    assert host.kernel and host.memory_bytes > 0
    written = json.loads(_result(tmp_path, None, None, []).read_text())
    assert set(written["provenance"]["host"]) >= {"cpu_flags", "memory_bytes", "kernel"}
