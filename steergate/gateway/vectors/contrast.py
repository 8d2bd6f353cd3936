"""Steering vectors from contrastive examples: the math, per layer (numpy only; no
FastAPI, no Redis, no engine).

Given each example's activation at one site (a row per example: the mean over its
tokens or its last token), ``positive`` ``[P, H]`` and ``negative`` ``[N, H]``:

- ``mean_difference``: ``mean(positive) - mean(negative)``. Any counts.
- ``pca``: the first principal direction of the *paired* differences
  ``d_i = positive[i] - negative[i]`` (so the counts must be equal; the route answers
  400 otherwise), taken as the top right singular vector of the uncentred ``D``. That
  is PCA of the differences with each pair's order flipped at random (the
  representation-engineering recipe): the second moment does not change under sign
  flips, so no randomness is needed. Centring ``D`` instead would remove exactly the
  consistent difference we want. The sign is chosen so positives project higher,
  and the length is the gap of the class means along that direction, so a ``pca``
  vector is used at the same scales as a ``mean_difference`` one.
- ``normalize``: the stored vector has unit length (``norm`` still reports the
  length before normalising, which is what tells layers apart).

The report, per layer, says how well the direction separates the examples:

- ``norm``: the computed vector's length (before ``normalize``).
- ``separation``: (mean projection of positives - mean projection of negatives) onto
  the unit direction, in pooled standard deviations (``None`` when both classes
  project to single points: the gap cannot be put in units of a zero spread).
- ``accuracy``: leave-one-out sign accuracy. For each example the vector is computed
  again without it (``pca``: without its pair), and the example counts as right when
  it falls on its own class's side of the midpoint between the two class means
  (also without it). Computed for all examples at once; ``pca`` uses batched power
  iteration started from the full-data direction (see :func:`_loo_pca`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

METHODS = ("mean_difference", "pca")
#: Fewest examples per side: leave-one-out needs a class mean without each example.
MIN_PER_SIDE = 2
#: Power steps for a leave-one-out principal direction, and the change below which
#: it counts as converged (cosine distance between steps).
POWER_STEPS = 200
POWER_TOL = 1e-10


class ContrastError(ValueError):
    """Examples that cannot make a vector with the requested method."""


@dataclass(frozen=True)
class LayerResult:
    vector: np.ndarray  # float32 [H], as stored
    norm: float
    separation: float | None
    accuracy: float

    def report(self) -> dict[str, float | None]:
        return {"norm": self.norm, "separation": self.separation, "accuracy": self.accuracy}


def compute(
    positive: np.ndarray, negative: np.ndarray, method: str, normalize: bool = False
) -> LayerResult:
    """One layer's vector and report from ``[P, H]`` and ``[N, H]`` activations."""
    pos = np.asarray(positive, dtype=np.float64)
    neg = np.asarray(negative, dtype=np.float64)
    _check(pos, neg, method)
    if method == "mean_difference":
        vec = pos.mean(0) - neg.mean(0)
        correct = _loo_mean_difference(pos, neg)
    else:
        vec = pca_direction(pos, neg)
        correct = _loo_pca(pos, neg)
    norm = float(np.linalg.norm(vec))
    stored = vec / norm if normalize and norm > 0 else vec
    return LayerResult(
        vector=stored.astype(np.float32),
        norm=norm,
        separation=separation(pos, neg, vec),
        accuracy=float(correct.mean()),
    )


def _check(pos: np.ndarray, neg: np.ndarray, method: str) -> None:
    if method not in METHODS:
        raise ContrastError(f"unknown method {method!r}")
    if pos.ndim != 2 or neg.ndim != 2 or pos.shape[1] != neg.shape[1]:
        raise ContrastError("activations must be [examples, hidden] with one hidden size")
    if min(len(pos), len(neg)) < MIN_PER_SIDE:
        raise ContrastError(f"each side needs at least {MIN_PER_SIDE} examples")
    if method == "pca" and len(pos) != len(neg):
        raise ContrastError("'pca' pairs positive[i] with negative[i]: counts must be equal")


def pca_direction(pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    """The top principal direction of the paired differences, oriented so positives
    project higher and scaled to the class-mean gap along it."""
    diffs = pos - neg
    _, _, vt = np.linalg.svd(diffs, full_matrices=False)
    unit = vt[0]
    gap = float((pos.mean(0) - neg.mean(0)) @ unit)
    if gap < 0:
        unit, gap = -unit, -gap
    return unit * gap


def separation(pos: np.ndarray, neg: np.ndarray, vec: np.ndarray) -> float | None:
    """Gap of the classes' mean projections onto ``vec``'s direction, in pooled
    standard deviations."""
    norm = np.linalg.norm(vec)
    if norm == 0:
        return 0.0
    unit = vec / norm
    pp, pn = pos @ unit, neg @ unit
    dof = len(pp) + len(pn) - 2
    pooled = np.sqrt(((len(pp) - 1) * pp.var(ddof=1) + (len(pn) - 1) * pn.var(ddof=1)) / dof)
    gap = float(pp.mean() - pn.mean())
    if pooled <= 1e-12 * max(1.0, abs(gap)):
        return None
    return gap / float(pooled)


def _side_correct(x: np.ndarray, vecs: np.ndarray, mids: np.ndarray, sign: float) -> np.ndarray:
    """Rows of ``x`` whose projection onto their own vector lies on ``sign``'s side of
    their own midpoint (a tie counts as wrong)."""
    return sign * np.einsum("ij,ij->i", x - mids, vecs) > 0


def _loo_mean_difference(pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    """Leave-one-out, closed form: removing ``x_i`` from its class moves that class's
    mean to ``(n * mean - x_i) / (n - 1)``."""
    mp, mn = pos.mean(0), neg.mean(0)
    p, n = len(pos), len(neg)
    mp_wo = (p * mp - pos) / (p - 1)  # [P, H]: positive mean without each positive
    mn_wo = (n * mn - neg) / (n - 1)
    ok_pos = _side_correct(pos, mp_wo - mn, (mp_wo + mn) / 2, 1.0)
    ok_neg = _side_correct(neg, mp - mn_wo, (mp + mn_wo) / 2, -1.0)
    return np.concatenate([ok_pos, ok_neg])


def _loo_pca(pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    """Leave-one-pair-out for ``pca``: pair i's two examples are judged by the
    direction of the other pairs.

    The direction without pair i is the top eigenvector of ``DᵀD - d_i d_iᵀ``. All of
    them are found at once by power iteration on a ``[P, H]`` stack, each started
    from the full-data direction (one pair moves it little), until every row moves
    less than ``POWER_TOL`` (at most ``POWER_STEPS`` steps). Each step costs
    ``O(P² H)``, not an SVD per pair."""
    diffs = pos - neg
    m = len(diffs)
    _, _, vt = np.linalg.svd(diffs, full_matrices=False)
    dirs = np.tile(vt[0], (m, 1))
    for _ in range(POWER_STEPS):
        # (DᵀD - d_i d_iᵀ) u_i for every i, without forming an H x H matrix.
        nxt = (dirs @ diffs.T) @ diffs - np.einsum("ij,ij->i", dirs, diffs)[:, None] * diffs
        nxt /= np.maximum(np.linalg.norm(nxt, axis=1, keepdims=True), 1e-300)
        moved = 1.0 - np.abs(np.einsum("ij,ij->i", nxt, dirs))
        dirs = nxt
        if moved.max() < POWER_TOL:
            break
    mp_wo = (m * pos.mean(0) - pos) / (m - 1)  # [P, H]: class means without pair i
    mn_wo = (m * neg.mean(0) - neg) / (m - 1)
    gap = np.einsum("ij,ij->i", mp_wo - mn_wo, dirs)
    dirs *= np.where(gap < 0, -1.0, 1.0)[:, None]  # orient each: positives higher
    mids = (mp_wo + mn_wo) / 2
    return np.concatenate(
        [_side_correct(pos, dirs, mids, 1.0), _side_correct(neg, dirs, mids, -1.0)]
    )
