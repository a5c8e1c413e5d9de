"""The fused decode (`engine/fused_decode.py`, `engine/decode_kernel.py`): its pieces
against torch, its steps against the float32 model (nearer than the torch bf16 path),
which steps it takes, where it refuses to run, and its fallback."""

from __future__ import annotations

import logging
import platform
import statistics
from typing import Any

import numba
import numpy as np
import pytest
import torch

from engine import decode_kernel, fused_decode, kv_quant_kernel, llama, weight_tiles
from engine.attention import TorchAttention
from engine.bf16_bits import to_bf16
from engine.config import DecodeKernel
from engine.fused_decode import MAX_ROWS, DecodeRow, fused_decode_wanted
from engine.precision import WeightQuant
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from engine.weight_tiles import PASS_ROWS
from tests.conftest import EngineFactory, assert_no_leaks
from tests.prompts import CHAT, SHORT
from tests.unit.engine.step_logits import distances_to_float32

CPU = torch.device("cpu")
BF16 = torch.bfloat16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@numba.njit(cache=False)
def _round_all(x: np.ndarray, out: np.ndarray) -> None:
    for i in range(x.shape[0]):
        out[i] = to_bf16(x[i])


def test_bf16_rounding_is_torchs_cast() -> None:
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(20_000, generator=gen) * torch.logspace(-40, 38, 20_000).float()
    # Ties (low 16 bits exactly 0x8000) both ways, the largest finite values, subnormals.
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x7F7F8000, 0x7F7FFFFF, 0x00018000, 0x80008000])
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 65504.0, 1e-45])
    x = torch.cat((values, ties.int().view(torch.float32), specials))
    out = np.empty(len(x), dtype=np.uint16)
    _round_all(x.numpy(), out)
    assert np.array_equal(out, x.to(BF16).view(torch.int16).numpy().view(np.uint16))
    nan = np.empty(1, dtype=np.uint16)
    _round_all(np.array([np.nan], dtype=np.float32), nan)
    assert torch.tensor(nan.view(np.int16)).view(BF16).isnan().all()


@numba.njit(cache=False)
def _exp_all(x: np.ndarray, out: np.ndarray) -> None:
    for i in range(x.shape[0]):
        out[i] = decode_kernel.exp_f32(x[i])


@numba.njit(cache=False)
def _read_codes(codes: np.ndarray, kind: int) -> np.ndarray:
    out = np.empty(codes.shape[0], dtype=np.float32)
    decode_kernel.codes_as_f32(codes, out, kind)
    return out


@pytest.mark.parametrize("kind", [kv_quant_kernel.INT8, kv_quant_kernel.FP8])
def test_the_kernel_reads_every_8bit_code_as_the_cache_does(kind: int) -> None:
    """All 256 byte values, fp8's subnormals and NaN codes included, read as the value
    the cache's own table gives (the write re-expresses through it)."""
    codes = np.arange(-128, 128, dtype=np.int8)
    want = kv_quant_kernel.decode_table(kind)[codes.view(np.uint8)]
    assert np.array_equal(_read_codes(codes, kind), want)


def test_the_kernels_exp_is_within_libms_error() -> None:
    """Within 1.5 units in the last place of exact over the range it does not clamp
    (libm's expf: 2.4 here), and NaN, infinities and the clamped ends as documented."""
    gen = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-86.9, 87.9, 400_001), gen.standard_normal(100_000) * 4])
    x = x.astype(np.float32)
    out = np.empty_like(x)
    _exp_all(x, out)
    exact = np.exp(x.astype(np.float64))
    ulps = np.abs(out - exact) / np.spacing(exact.astype(np.float32))
    assert ulps.max() <= 1.5
    edges = np.array([np.nan, np.inf, -np.inf, 1000.0, -1000.0, 0.0], dtype=np.float32)
    got = np.empty_like(edges)
    _exp_all(edges, got)
    assert np.isnan(got[0]) and got[5] == 1.0
    assert got[1] == got[3] and np.isclose(got[1], np.exp(88.0), rtol=1e-6)  # clamped, finite
    assert got[2] == got[4] and np.isclose(got[2], np.exp(-87.0), rtol=1e-6)


def test_fused_steps_are_nearer_the_float32_model(make_engine: EngineFactory) -> None:
    """Its float32 insides (torch rounds to bf16 after every op): on the parity prompts'
    decode steps, while the context is still float32's, its logits' distance to float32's
    is well under the torch bf16 path's (measured: about half, 0.6 on a CPU without
    AVX-512 BF16). Greedy-token agreement over whole runs is not asserted: on six prompts
    it went either way from run to run (54 against 60 of 72 tokens in one, under the
    suite's parallel phase), since one early flip changes the rest of a sequence."""
    errors = distances_to_float32(make_engine)
    assert statistics.fmean(errors["fused"]) < 0.75 * statistics.fmean(errors["torch"])


def test_only_small_plain_decode_steps_are_fused(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fused_decode, "MAX_ROWS", 4)  # the real bound takes 129 requests
    engine = make_engine(dtype="bfloat16", num_kv_blocks=64)
    prompt = engine.tokenizer.encode(SHORT[0])
    # One row more than the kernel takes runs through torch; once one ends, the rest fuse.
    lengths = [4] + [10] * fused_decode.MAX_ROWS
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outs = engine.generate([prompt] * len(lengths), params)
    assert [len(o) for o in outs] == lengths
    assert engine.runner.fused_steps == 10 - 4  # steps after the short one ended: 5-10
    assert all(o == outs[1] for o in outs[2:])
    # Prompt log-probabilities are scored by the torch forward; the decode after fuses.
    before = engine.runner.fused_steps
    scored = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1)
    engine.generate([prompt], scored)
    assert engine.runner.fused_steps == before + 2
    assert_no_leaks(engine)


def _fused_step_widths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets the row count of every fused step run from now on."""
    widths: list[int] = []
    decode = fused_decode.FusedDecoder.decode

    def counted(self: fused_decode.FusedDecoder, rows: list[DecodeRow], *args: Any) -> Any:
        widths.append(len(rows))
        return decode(self, rows, *args)

    monkeypatch.setattr(fused_decode.FusedDecoder, "decode", counted)
    return widths


def test_a_fused_row_is_the_same_alone_or_in_a_batch(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each row's products, norms and attention are its own (in a batch of more than
    one pass's rows the passes only split the rows): a request's decode steps do not
    depend on what they were batched with.

    Prefill is kept out of the comparison. In bf16 it is not batch-invariant: oneDNN
    picks its blocking by the row count, and on a CPU with AMX a batched prefill of every
    prompt at once (about 200 rows) changed the KV's last bits and, four tokens later, a
    greedy token (the invariance probe finds bf16 rows changing at 128 rows, none up to
    32). So every prompt is two full blocks plus one token, its blocks are put in the
    prefix cache by a run of its own first, and both runs below prefill one token per
    request, the same token from the same cached KV."""
    batches = _fused_step_widths(monkeypatch)
    engine = make_engine(dtype="bfloat16", kv_cache_bytes=128 << 20)
    # Without AVX-512 BF16 the engine fuses at most FALLBACK_MAX_ROWS rows; the float32
    # fallback's products take the same passes, so the bound is lifted to test them too.
    monkeypatch.setattr(engine.model.fused, "max_rows", MAX_ROWS)
    length = 2 * engine.config.block_size + 1
    texts = (SHORT + CHAT)[: PASS_ROWS + 2]
    prompts = [(engine.tokenizer.encode(p) * length)[:length] for p in texts]
    for p in prompts:  # each prompt's two full blocks into the prefix cache, alone
        engine.generate([p], SamplingParams(max_tokens=1))
    batches.clear()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    together = engine.generate(prompts, params)
    assert max(batches) == len(prompts) > PASS_ROWS  # steps of two passes ran
    alone = [engine.generate([p], params)[0] for p in prompts]
    assert together == alone
    assert_no_leaks(engine)


def test_rows_the_kernel_cannot_run_safely_go_to_torch(make_engine: EngineFactory) -> None:
    """The kernel has no bounds checks: a row whose blocks fall outside the pool, whose
    table does not reach its position, or that is not one token, is not fused, and
    `decode` refuses such a row before it writes anything."""
    engine = make_engine(dtype="bfloat16", num_kv_blocks=64)
    fused = engine.model.fused
    assert fused is not None
    engine.add_request(RequestSpec(engine.tokenizer.encode(SHORT[1]), GREEDY))
    engine.step()  # prefill: now a plain decode
    (req,) = engine.requests.values()
    bs = engine.config.block_size
    assert fused.rows_of([(req, 1)], 64, bs) is not None
    assert fused.rows_of([(req, 1)], max(req.block_ids), bs) is None  # past the pool
    assert fused.rows_of([(req, 2)], 64, bs) is None  # two tokens but no drafts
    assert fused.rows_of([(req, 1)] * (MAX_ROWS + 1), 64, bs) is None
    step = fused.rows_of([(req, 1)], 64, bs)
    assert step is not None and step.sampling == [req] and not step.speculating
    (row,) = step.rows
    short = DecodeRow(row.token, len(row.blocks) * bs, row.blocks)  # table ends before it
    negative = DecodeRow(row.token, row.position, [-1, *row.blocks[1:]])
    before = engine.kv_cache.blocks.clone()
    for bad in (short, negative, DecodeRow(row.token, 10**6, row.blocks)):
        with pytest.raises(IndexError, match="outside the KV pool or the rotary table"):
            fused.decode([bad], engine.kv_cache)
    assert torch.equal(engine.kv_cache.blocks, before)
    while engine.has_unfinished():
        engine.step()
    assert_no_leaks(engine)


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_a_verification_fuses_with_the_bits_of_plain_decode_steps(
    make_engine: EngineFactory, kv: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verification's rows (one sequence's consecutive positions) run in one fused
    step beside another sequence's decode, and each gets the logits bits and writes the
    K/V bytes that one-row steps of the same tokens give: speculation cannot change a
    token where the steps fuse. An 8-bit cache too: each row writes (growing its
    block's scales) before it attends, in row order, as one-row steps do."""
    engine = make_engine(dtype="bfloat16", kv_cache_dtype=kv, num_kv_blocks=64)
    fused = engine.model.fused
    assert fused is not None
    # Five rows pass FALLBACK_MAX_ROWS: lifted, as above, so the kernel runs them here.
    monkeypatch.setattr(fused, "max_rows", MAX_ROWS)
    for text in SHORT[:2]:
        engine.add_request(RequestSpec(engine.tokenizer.encode(text), GREEDY))
    engine.step()  # both prefilled: now plain decodes
    first, other = engine.requests.values()
    bs = engine.config.block_size
    spare = [b for b in range(64) if b not in first.block_ids + other.block_ids][:2]
    start = first.num_computed_tokens
    blocks = first.block_ids + spare  # room for the drafts past the last block
    verify = [
        DecodeRow(t, start + i, blocks) for i, t in enumerate([first.token_at(start), 11, 12, 13])
    ]
    plain = DecodeRow(
        other.token_at(other.num_computed_tokens), other.num_computed_tokens, other.block_ids
    )
    pool = engine.kv_cache.blocks
    before = pool.clone()
    together = fused.decode([plain, *verify], engine.kv_cache)
    after_together = pool.clone()
    pool.copy_(before)
    alone = torch.cat([fused.decode([row], engine.kv_cache) for row in [plain, *verify]])
    assert torch.equal(together.view(torch.int32), alone.view(torch.int32))
    assert torch.equal(pool, after_together)
    # Through the engine: a request verifying drafts is handed over as 1 + k rows.
    first.draft_token_ids = [11, 12, 13]
    step = fused.rows_of([(other, 1), (first, 4)], 64, bs)
    assert step is not None and step.sampling == [other] and step.speculating == [first]
    assert [(r.token, r.position) for r in step.rows[1:]] == [(r.token, r.position) for r in verify]
    first.draft_token_ids = []
    while engine.has_unfinished():
        engine.step()
    assert_no_leaks(engine)


def test_speculation_fuses_and_changes_no_bf16_token(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In bfloat16, with verifications fused too, greedy and seeded streams are the
    same with speculation on as off, batched and alone."""
    widths = _fused_step_widths(monkeypatch)
    doc = " ".join(SHORT[:3])
    prompt_text = f"Repeat the following text exactly.\n\nText: {doc}\n\nRepeated text:"
    params = [
        SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=32, temperature=0.8, seed=5, ignore_eos=True),
    ]
    outputs = []
    for mode in ("off", "on"):
        engine = make_engine(dtype="bfloat16", speculative_decoding=mode)
        # Verifications and the batched pair pass FALLBACK_MAX_ROWS: lifted, as above.
        monkeypatch.setattr(engine.model.fused, "max_rows", MAX_ROWS)
        prompt = engine.tokenizer.encode(prompt_text)
        batched = engine.generate([prompt, prompt], params)
        widths.clear()
        alone = [engine.generate([prompt], p)[0] for p in params]
        outputs.append(batched + alone)
        assert_no_leaks(engine)
    assert engine.speculator.accepted_total > 0
    assert max(widths) > 1  # one request's step of several rows: a verification, fused
    assert outputs[0] == outputs[1]


def test_where_it_cannot_run_fused_refuses_and_auto_stays_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def wanted(kernel: DecodeKernel, **kw: object) -> bool:
        args: dict[str, object] = {"device": CPU, "dtype": BF16, "quant": WeightQuant.NONE,
                                   "kv_dtype": BF16, **kw}  # fmt: skip
        return fused_decode_wanted(kernel, **args)  # type: ignore[arg-type]

    assert wanted(DecodeKernel.FUSED) and not wanted(DecodeKernel.TORCH)
    # Asked for by name it runs on any CPU; auto only where it was measured (x86).
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert wanted(DecodeKernel.FUSED) and not wanted(DecodeKernel.AUTO)
    monkeypatch.undo()
    for kw, named in (
        ({"dtype": torch.float32, "kv_dtype": torch.float32}, "dtype bfloat16"),
        ({"quant": WeightQuant.INT8}, "quantization none"),
        ({"kv_dtype": torch.float16}, "kv_cache_dtype auto, int8 or fp8"),
        ({"device": torch.device("cuda")}, "device cpu"),
    ):
        assert not wanted(DecodeKernel.AUTO, **kw)
        with pytest.raises(ValueError, match=f"decode_kernel fused needs {named}"):
            wanted(DecodeKernel.FUSED, **kw)


#: On a CPU without AVX-512 BF16 (the tiles then multiply in float32 FMAs, and torch's
#: bf16 products convert through float32 too) the fp8 cache's fused steps measured
#: farther, not nearer: 0.0556 against torch's 0.0541 over the same 47 steps, nearer on
#: 22 (AMD EPYC, AVX2, 2026-12-01). A known gap (docs/engine.md "Kernels"), not skipped
#: where the claim was measured.
FP8_NEARER_NEEDS_BF16_DOT = pytest.mark.skipif(
    not weight_tiles.BF16_DOT, reason="fp8 fused is 2.7% farther without AVX-512 BF16"
)


@pytest.mark.parametrize("kv", ["int8", pytest.param("fp8_e4m3", marks=FP8_NEARER_NEEDS_BF16_DOT)])
def test_an_8bit_cache_fuses_no_farther_from_float32_than_torch(
    make_engine: EngineFactory, kv: str
) -> None:
    """An 8-bit cache's decode steps fuse too (its write is the cache's own compiled
    write, its reads scale each head's scores and weights): on the parity prompts'
    steps whose context is still float32's, the logits' distance to the float32 model's
    (unquantized) is no larger than the torch step's over the same cache, which rounds
    to bfloat16 after every op. A wrong scale or a misplaced byte is far larger."""
    errors = distances_to_float32(make_engine, kv_cache_dtype=kv)
    assert statistics.fmean(errors["fused"]) <= statistics.fmean(errors["torch"])


def test_without_numba_the_torch_path_serves(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("cannot cache numba kernels here")

    monkeypatch.setattr(llama, "FusedDecoder", broken)
    with caplog.at_level(logging.WARNING, logger="engine.llama"):
        engine = make_engine(dtype="bfloat16")
    assert engine.model.fused is None and "fused decode off" in caplog.text
    assert len(engine.generate([engine.tokenizer.encode(SHORT[0])], GREEDY)[0]) == 12
    assert engine.runner.fused_steps == 0
    # Asked for by name, a kernel that cannot compile stops the engine instead.
    with pytest.raises(RuntimeError, match="decode_kernel fused: its kernel failed"):
        make_engine(dtype="bfloat16", decode_kernel="fused")


def test_larger_decode_steps_attend_through_the_compiled_kernel(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the fused step's bound the torch forward runs, with the kernel's decode
    attention (the pool read in place): float32 inside, so on the same queries and cache
    its output is nearer float32 attention than the gathered bf16 matmuls' (measured:
    0.0017 against 0.0043 relative error on a CPU without AVX-512 BF16). Greedy-token
    agreement on six prompts is too chaotic to show it: on that CPU it went either way."""
    prompts = SHORT[:6]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    errors: dict[str, list[float]] = {"compiled": [], "torch": []}
    rows: list[int] = []
    compiled = TorchAttention._compiled_decode

    def measured(self: TorchAttention, q: torch.Tensor, cache: Any, meta: Any, plan: Any) -> Any:
        got = compiled(self, q, cache, meta, plan)
        rows.append(q.shape[0])
        exact, plain = torch.empty_like(q, dtype=torch.float32), torch.empty_like(q)
        for group in plan.decode_groups:
            exact[group.rows] = TorchAttention._decode(q.float()[group.rows], cache, group)
            plain[group.rows] = TorchAttention._decode(q[group.rows], cache, group)
        for name, out in (("compiled", got), ("torch", plain)):
            errors[name].append(float((out.float() - exact).norm() / exact.norm()))
        return got

    monkeypatch.setattr(TorchAttention, "_compiled_decode", measured)
    monkeypatch.setattr(fused_decode, "MAX_ROWS", len(prompts) - 1)
    engine = make_engine(kv_cache_bytes=128 << 20, dtype="bfloat16")
    engine.generate([engine.tokenizer.encode(p) for p in prompts], params)
    assert engine.runner.fused_steps == 0
    assert_no_leaks(engine)
    assert max(rows) == len(prompts)  # the six-row steps attended through the kernel
    assert statistics.fmean(errors["compiled"]) < 0.6 * statistics.fmean(errors["torch"]), {
        k: statistics.fmean(v) for k, v in errors.items()
    }


def _int8_step(heads: int, kv_heads: int, hd: int) -> Any:
    return decode_kernel.decode_step_8bit(heads, kv_heads, hd, kv_quant_kernel.INT8)


@pytest.mark.parametrize(
    "build", [decode_kernel.decode_step, _int8_step, decode_kernel.decode_attention]
)
@pytest.mark.parametrize(("heads", "kv_heads", "hd"), [(9, 2, 64), (9, 0, 64), (9, 3, 0)])
def test_every_entry_point_refuses_head_counts_it_would_divide_by(
    build: Any, heads: int, kv_heads: int, hd: int
) -> None:
    """Compiled under numpy's error model, a bad division would not raise inside."""
    with pytest.raises(ValueError, match="positive multiple of kv_heads"):
        build(heads, kv_heads, hd)
