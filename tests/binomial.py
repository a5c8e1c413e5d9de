"""Exact binomial bounds for tests that count a random split (a canary's share of the
requests): `bounds(n, p)` is the range of canary counts out of `n` draws at the share `p`
outside which a correct split falls with probability at most `alpha`, and `accepts(n, q,
(lo, hi))` is the probability that a split at the share `q` lands inside it anyway. A
test asserts both: that its count is within the bounds, and that the bounds reject the
splits it means to catch (none to the canary, or twice the share) with probability
above 1 - `alpha`. The tails are summed in integers, exactly: no normal approximation."""

from __future__ import annotations

from fractions import Fraction

ALPHA = 1e-6  # the chance a test may fail by bad luck, and a wrong split may pass


def _share(p: float) -> Fraction:
    share = Fraction(p).limit_denominator(10**6)  # 0.1 is 1/10, not its binary neighbour
    assert 0 <= share <= 1, p
    return share


def _weights(n: int, p: float) -> tuple[list[int], int]:
    """P(X = k) for k in 0..n as integers over a common denominator, and that denominator."""
    share = _share(p)
    a, b = share.numerator, share.denominator
    fails = [1]  # (b - a) ** j
    for _ in range(n):
        fails.append(fails[-1] * (b - a))
    weights, ways, hits = [], 1, 1  # comb(n, k), a ** k
    for k in range(n + 1):
        weights.append(ways * hits * fails[n - k])
        ways, hits = ways * (n - k) // (k + 1), hits * a
    return weights, b**n


def bounds(n: int, p: float, alpha: float = ALPHA) -> tuple[int, int]:
    """The smallest range [lo, hi] with P(X < lo) <= alpha/2 and P(X > hi) <= alpha/2 for
    X ~ Binomial(n, p)."""
    weights, total = _weights(n, p)
    limit = Fraction(alpha) / 2 * total
    lo, below = 0, 0
    while below + weights[lo] <= limit:
        below += weights[lo]
        lo += 1
    hi, above = n, 0
    while above + weights[hi] <= limit:
        above += weights[hi]
        hi -= 1
    return lo, hi


def accepts(n: int, p: float, within: tuple[int, int]) -> float:
    """P(lo <= X <= hi) for X ~ Binomial(n, p)."""
    weights, total = _weights(n, p)
    lo, hi = within
    return float(Fraction(sum(weights[lo : hi + 1]), total))
