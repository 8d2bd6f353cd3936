"""The leave-one-out accuracy of steergate/gateway/vectors/contrast.py by its definition, with plain
loops (no shortcuts shared with the code it checks)."""

from __future__ import annotations

import numpy as np


def loo_reference(pos: np.ndarray, neg: np.ndarray, method: str) -> float:
    """For each example: rebuild the vector without it (pca: without its pair) with
    plain loops, then ask which side of the midpoint it falls on."""
    right = 0
    for cls, rows in ((1, pos), (-1, neg)):
        for i in range(len(rows)):
            if method == "pca":
                keep = [j for j in range(len(pos)) if j != i]
                p_wo, n_wo = pos[keep], neg[keep]
                _, _, vt = np.linalg.svd(p_wo - n_wo)
                vec = vt[0] if (p_wo.mean(0) - n_wo.mean(0)) @ vt[0] > 0 else -vt[0]
            else:
                others = np.delete(rows, i, axis=0)
                p_wo = others if cls == 1 else pos
                n_wo = others if cls == -1 else neg
                vec = p_wo.mean(0) - n_wo.mean(0)
            mid = (p_wo.mean(0) + n_wo.mean(0)) / 2
            right += int(cls * (rows[i] - mid) @ vec > 0)
    return right / (len(pos) + len(neg))
