"""The from-examples math (steergate/gateway/vectors/contrast.py) on synthetic activations, each
figure checked against a plain, loop-by-loop computation of its definition."""

from __future__ import annotations

import numpy as np
import pytest

from steergate.gateway.vectors.contrast import ContrastError, compute, separation
from tests.gateway.contrast_reference import loo_reference


def _classes(p: int, n: int, h: int = 16, gap: float = 3.0, seed: int = 0):
    rng = np.random.default_rng(seed)
    direction = rng.normal(size=h)
    direction /= np.linalg.norm(direction)
    pos = rng.normal(size=(p, h)) + gap / 2 * direction
    neg = rng.normal(size=(n, h)) - gap / 2 * direction
    return pos, neg, direction


def test_mean_difference_equals_an_independent_mean_difference() -> None:
    pos, neg, _ = _classes(7, 5)
    out = compute(pos, neg, "mean_difference")
    expected = [sum(r[k] for r in pos) / 7 - sum(r[k] for r in neg) / 5 for k in range(16)]
    np.testing.assert_allclose(out.vector, np.array(expected, dtype=np.float32), rtol=1e-6)
    assert out.vector.dtype == np.float32
    assert out.norm == pytest.approx(float(np.sqrt(sum(e * e for e in expected))))


def test_normalize_stores_a_unit_vector_and_reports_the_raw_norm() -> None:
    pos, neg, _ = _classes(6, 6)
    raw = compute(pos, neg, "mean_difference")
    unit = compute(pos, neg, "mean_difference", normalize=True)
    assert np.linalg.norm(unit.vector) == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_allclose(unit.vector, raw.vector / raw.norm, rtol=1e-5)
    assert unit.norm == raw.norm


def test_pca_finds_the_planted_direction_oriented_toward_positives() -> None:
    pos, neg, direction = _classes(32, 32, gap=6.0, seed=1)
    out = compute(pos, neg, "pca")
    unit = out.vector / np.linalg.norm(out.vector)
    assert unit @ direction > 0.9  # oriented: positives project higher
    # Its length is the class-mean gap along it.
    assert out.norm == pytest.approx(float((pos.mean(0) - neg.mean(0)) @ unit), rel=1e-5)
    # Swapping the classes flips it.
    flipped = compute(neg, pos, "pca")
    np.testing.assert_allclose(flipped.vector, -out.vector, rtol=1e-4, atol=1e-6)


def test_separation_is_the_gap_in_pooled_standard_deviations() -> None:
    pos, neg, _ = _classes(9, 4, seed=2)
    vec = pos.mean(0) - neg.mean(0)
    unit = vec / np.linalg.norm(vec)
    pp, pn = [float(r @ unit) for r in pos], [float(r @ unit) for r in neg]
    mp, mn = sum(pp) / 9, sum(pn) / 4
    ss = sum((x - mp) ** 2 for x in pp) + sum((x - mn) ** 2 for x in pn)
    expected = (mp - mn) / (ss / (9 + 4 - 2)) ** 0.5
    assert compute(pos, neg, "mean_difference").separation == pytest.approx(expected)


def test_separation_of_two_points_is_none_not_infinite() -> None:
    pos = np.array([[1.0, 0.0], [1.0, 0.0]])
    neg = np.array([[0.0, 0.0], [0.0, 0.0]])
    assert separation(pos, neg, pos.mean(0) - neg.mean(0)) is None


@pytest.mark.parametrize("method", ["mean_difference", "pca"])
@pytest.mark.parametrize("gap", [0.3, 1.0, 4.0])
def test_leave_one_out_accuracy_matches_a_loop(method: str, gap: float) -> None:
    counts = (12, 12) if method == "pca" else (12, 7)
    pos, neg, _ = _classes(*counts, gap=gap, seed=3)
    out = compute(pos, neg, method)
    assert out.accuracy == pytest.approx(loo_reference(pos, neg, method))


def test_accuracy_is_low_on_noise_and_perfect_on_separated_classes() -> None:
    pos, neg, _ = _classes(40, 40, gap=0.0, seed=4)
    assert compute(pos, neg, "mean_difference").accuracy < 0.75
    pos, neg, _ = _classes(40, 40, gap=12.0, seed=4)
    assert compute(pos, neg, "mean_difference").accuracy == 1.0


def test_leave_one_out_sees_an_outlier_that_the_full_fit_hides() -> None:
    """An example that only looks right because it is in the fit: with 2 per side,
    leaving one out can leave its class's mean on the wrong side."""
    pos = np.array([[1.0, 0.0], [-3.0, 0.0]])
    neg = np.array([[-1.0, 0.0], [-1.2, 0.0]])
    assert compute(pos, neg, "mean_difference").accuracy < 1.0


def test_bad_inputs_are_refused() -> None:
    pos, neg, _ = _classes(4, 3)
    with pytest.raises(ContrastError, match="equal"):
        compute(pos, neg, "pca")
    with pytest.raises(ContrastError, match="at least"):
        compute(pos[:1], neg, "mean_difference")
    with pytest.raises(ContrastError, match="method"):
        compute(pos, neg, "median")
