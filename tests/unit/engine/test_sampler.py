"""Sampling (greedy, temperature, top-k, top-p, per-request generators) and the
validation of SamplingParams."""

from __future__ import annotations

import math

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.sampler import new_generator, sample
from engine.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams

VOCAB = 50
GREEDY = SamplingParams()


def rand_logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g, dtype=torch.float32) * 3


def draws(logits_row: torch.Tensor, p: SamplingParams, seed: int, n: int) -> list[int]:
    gen = new_generator(seed)
    return [sample(logits_row[None], [p], [gen])[0] for _ in range(n)]


# -- greedy ------------------------------------------------------------------------


def test_greedy_is_argmax_per_row() -> None:
    logits = rand_logits(6)
    out = sample(logits, [GREEDY] * 6, [None] * 6)
    assert out == logits.argmax(dim=-1).tolist()
    assert all(type(t) is int for t in out)


def test_greedy_ignores_generator_and_is_stable() -> None:
    logits = rand_logits(3, seed=1)
    gens: list[torch.Generator | None] = [new_generator(i) for i in range(3)]
    assert sample(logits, [GREEDY] * 3, gens) == sample(logits, [GREEDY] * 3, [None] * 3)


def test_params_and_generators_must_match_rows() -> None:
    with pytest.raises(ValueError):
        sample(rand_logits(2), [GREEDY], [None, None])


# -- seeded sampling ---------------------------------------------------------------


def test_seeded_draws_independent_of_batch_position_and_neighbours() -> None:
    p = SamplingParams(temperature=1.0, seed=1234)
    target = rand_logits(1, seed=7)[0]
    alone = draws(target, p, seed=1234, n=30)
    assert len(set(alone)) > 1  # a real distribution, not a constant

    # Same row at position 2 of 4, next to sampled rows with their own generators.
    others = rand_logits(3, seed=8)
    batch = torch.stack([others[0], others[1], target, others[2]])
    params = [
        SamplingParams(temperature=0.7, seed=1),
        GREEDY,
        p,
        SamplingParams(temperature=1.3, top_k=5, seed=2),
    ]
    gens: list[torch.Generator | None] = [
        new_generator(1),
        None,
        new_generator(1234),
        new_generator(2),
    ]
    in_batch = [sample(batch, params, gens)[2] for _ in range(30)]
    assert in_batch == alone


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    p = SamplingParams(temperature=1.0)
    row = rand_logits(1, seed=3)[0]
    assert draws(row, p, seed=5, n=40) == draws(row, p, seed=5, n=40)
    assert draws(row, p, seed=5, n=40) != draws(row, p, seed=6, n=40)


def test_unseeded_generators_differ() -> None:
    a, b = new_generator(None), new_generator(None)
    assert a.initial_seed() != b.initial_seed()


# -- truncation --------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 5.0])
def test_top_k_1_equals_greedy(temperature: float) -> None:
    logits = rand_logits(4, seed=11)
    p = SamplingParams(temperature=temperature, top_k=1)
    gens: list[torch.Generator | None] = [new_generator(i) for i in range(4)]
    expected = logits.argmax(dim=-1).tolist()
    for _ in range(20):
        assert sample(logits, [p] * 4, gens) == expected


def test_top_k_keeps_only_k_best() -> None:
    row = torch.zeros(VOCAB)
    row[[3, 17, 41]] = torch.tensor([2.0, 1.9, 1.8])
    p = SamplingParams(temperature=1.0, top_k=3)
    got = set(draws(row, p, seed=0, n=300))
    assert got == {3, 17, 41}


def test_top_k_at_least_vocab_disables_it() -> None:
    row = torch.zeros(4)
    p = SamplingParams(temperature=1.0, top_k=4)
    assert set(draws(row, p, seed=0, n=200)) == {0, 1, 2, 3}


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = rand_logits(4, seed=12)
    p = SamplingParams(temperature=2.0, top_p=1e-6)
    gens: list[torch.Generator | None] = [new_generator(i) for i in range(4)]
    expected = logits.argmax(dim=-1).tolist()
    for _ in range(20):
        assert sample(logits, [p] * 4, gens) == expected


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    # Mass before token 1 is 0.5 < 0.6, kept; before token 2 it is 0.8 >= 0.6, dropped.
    assert set(draws(row, SamplingParams(temperature=1.0, top_p=0.6), 0, 300)) == {0, 1}
    assert set(draws(row, SamplingParams(temperature=1.0, top_p=0.45), 0, 100)) == {0}
    assert set(draws(row, SamplingParams(temperature=1.0, top_p=0.9), 0, 400)) == {0, 1, 2}
    assert set(draws(row, SamplingParams(temperature=1.0, top_p=1.0), 0, 600)) == {0, 1, 2, 3}


# -- temperature -------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_logits(temperature: float) -> None:
    # Two tokens, logit gap 1: P(token 1) = sigmoid(1 / T).
    row = torch.tensor([0.0, 1.0])
    n = 2000
    got = draws(row, SamplingParams(temperature=temperature), seed=99, n=n)
    freq = sum(got) / n
    expected = 1 / (1 + math.exp(-1 / temperature))
    # 5 standard deviations; seeded, so this never flakes.
    assert abs(freq - expected) < 5 * math.sqrt(expected * (1 - expected) / n)


def test_low_temperature_approaches_greedy_high_flattens() -> None:
    row = rand_logits(1, seed=21)[0]
    top = int(row.argmax())
    cold = draws(row, SamplingParams(temperature=0.01), seed=1, n=100)
    assert cold == [top] * 100
    hot = draws(row, SamplingParams(temperature=100.0), seed=1, n=300)
    assert len(set(hot)) > VOCAB // 2


def test_temperature_zero_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-3).greedy


# -- validation --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.0001}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"stop": tuple(f"s{i}" for i in range(MAX_STOP_STRINGS + 1))}, "stop"),
        ({"stop": ("x" * (MAX_STOP_STRING_CHARS + 1),)}, "stop"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_invalid_params_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    err = info.value
    assert err.field == field
    assert err.limit
    assert str(err).startswith(f"{field}: ")
    assert isinstance(err, ValueError)


def test_boundary_values_are_valid() -> None:
    p = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        seed=2**63 - 1,
        stop=tuple("x" * MAX_STOP_STRING_CHARS for _ in range(MAX_STOP_STRINGS)),
    )
    assert p.greedy and p.max_tokens == 1
    assert SamplingParams(top_p=1e-9, seed=0).top_p == 1e-9
