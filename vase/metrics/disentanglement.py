"""Disentanglement metrics from ground-truth factors: MIG and DCI (docs/usage.md, data, sprites).

Pure functions of ``(factors, codes, rng)`` returning dicts, in the style of disentanglement_lib:
they never touch a model, so the identity, constant, duplicated and mixed "representations" of the
sanity tests are scored by exactly the code that scores VASE.

- ``factors``: (N, K) ground-truth factor values (discrete ids or continuous values).
- ``codes``:   (N, D) representation, e.g. the encoder mean μ(x).
- ``rng``:     ``np.random.Generator``; every random choice is drawn from it.

Factors with at most ``n_bins`` distinct values are treated as categories; factors with more are
cut into ``n_bins`` equal-width bins. Factors that take a single value carry no information and are
skipped; when no factor varies the scores are NaN.
"""
from __future__ import annotations

import numpy as np
from sklearn.ensemble import RandomForestClassifier
from sklearn.metrics import mutual_info_score

from vase.metrics.continual import nanmean

# [ours] Equal-width bins for codes and continuous factors (disentanglement_lib uses 20 for MIG).
DEFAULT_BINS = 20
# [ours] DCI importance model: a small random forest is fast on 2 cores and, unlike a linear
# model, credits a latent that encodes a factor non-monotonically.
DCI_TREES = 20
DCI_MAX_DEPTH = 8
DCI_TRAIN_FRACTION = 0.8


def mig(factors: np.ndarray, codes: np.ndarray, rng: np.random.Generator, n_bins: int = DEFAULT_BINS) -> dict:
    """Mutual Information Gap (Chen et al. 2018, "Isolating sources of disentanglement in VAEs").

    For each factor v_k: (I(z_(1); v_k) − I(z_(2); v_k)) / H(v_k), where z_(1), z_(2) are the two
    latents with the largest mutual information with v_k after binning; MIG is the mean over
    factors. A single latent that captures v_k alone scores 1; two latents sharing it score 0.
    MIG is deterministic; ``rng`` is accepted so every metric has the same signature.
    """
    del rng
    labels = factor_labels(factors, n_bins)
    binned = discretise(np.asarray(codes, dtype=np.float64).reshape(len(labels), -1), n_bins)
    info = mutual_information_matrix(binned, labels)
    per_factor = []
    for k in range(labels.shape[1]):
        h = mutual_info_score(labels[:, k], labels[:, k])  # H(v) = I(v; v)
        if h <= 0:
            per_factor.append(float("nan"))
            continue
        top = np.sort(info[:, k])[::-1]
        second = top[1] if top.size > 1 else 0.0
        per_factor.append(float((top[0] - second) / h))
    return {"mig": nanmean(per_factor), "mig_per_factor": per_factor}


def dci(
    factors: np.ndarray,
    codes: np.ndarray,
    rng: np.random.Generator,
    n_bins: int = DEFAULT_BINS,
    train_fraction: float = DCI_TRAIN_FRACTION,
    n_estimators: int = DCI_TREES,
    max_depth: int = DCI_MAX_DEPTH,
) -> dict:
    """Disentanglement, completeness and informativeness (Eastwood & Williams, ICLR 2018).

    One random-forest classifier per varying factor, from all codes to the factor's label, fitted
    on a random ``train_fraction`` of the examples (split drawn from ``rng``). Its impurity-based
    feature importances form column k of the importance matrix R (D × K).

    - disentanglement = Σ_i ρ_i (1 − H_K(R_i· / Σ_k R_ik)), ρ_i = Σ_k R_ik / Σ R: each latent should
      matter for one factor only, weighted by how much the latent matters at all;
    - completeness = mean_k (1 − H_D(R_·k / Σ_i R_ik)): each factor should be captured by one latent;
    - informativeness = mean_k held-out accuracy of the classifiers.

    Entropies H_K, H_D are in base K and D so both scores lie in [0, 1]. A latent or factor with no
    importance at all scores 0 (nothing is captured), so constant codes give 0 rather than NaN.
    """
    labels = factor_labels(factors, n_bins)
    varying = [k for k in range(labels.shape[1]) if np.unique(labels[:, k]).size > 1]
    nan = float("nan")
    if not varying:
        return {"disentanglement": nan, "completeness": nan, "informativeness": nan}
    labels = labels[:, varying]
    codes = np.asarray(codes, dtype=np.float64).reshape(len(labels), -1)
    order = rng.permutation(len(labels))
    n_train = int(np.clip(round(train_fraction * len(labels)), 1, len(labels) - 1))
    train, test = order[:n_train], order[n_train:]
    importance = np.zeros((codes.shape[1], labels.shape[1]))
    accuracy = []
    for k in range(labels.shape[1]):
        model = RandomForestClassifier(
            n_estimators=n_estimators,
            max_depth=max_depth,
            # Every split sees every latent, so an irrelevant latent is never forced into a split
            # (as with max_features="sqrt"), which would leak importance into it.
            max_features=None,
            random_state=int(rng.integers(2**31 - 1)),
            n_jobs=1,
        )
        model.fit(codes[train], labels[train, k])
        importance[:, k] = model.feature_importances_
        accuracy.append(float(np.mean(model.predict(codes[test]) == labels[test, k])))
    return {
        "disentanglement": dci_disentanglement(importance),
        "completeness": dci_completeness(importance),
        "informativeness": float(np.mean(accuracy)),
    }


def dci_disentanglement(importance: np.ndarray) -> float:
    """Relevance-weighted mean over latents of 1 − H_K(row distribution) (Eastwood & Williams, eq. 2)."""
    importance = np.abs(np.asarray(importance, dtype=np.float64))
    total = importance.sum()
    if total <= 0:
        return 0.0
    weights = importance.sum(axis=1) / total
    return float(np.sum(weights * _one_minus_entropy(importance)))


def dci_completeness(importance: np.ndarray) -> float:
    """Mean over factors of 1 − H_D(column distribution) (Eastwood & Williams, eq. 3)."""
    importance = np.abs(np.asarray(importance, dtype=np.float64))
    return float(np.mean(_one_minus_entropy(importance.T)))


def factor_labels(factors: np.ndarray, n_bins: int = DEFAULT_BINS) -> np.ndarray:
    """Integer labels per factor column: category ids if ≤ n_bins values, else equal-width bins."""
    factors = np.asarray(factors)
    factors = factors.reshape(len(factors), -1)
    columns = []
    for column in factors.T:
        values, ids = np.unique(column, return_inverse=True)
        columns.append(ids if values.size <= n_bins else discretise(column[:, None], n_bins)[:, 0])
    return np.stack(columns, axis=1).astype(np.int64)


def discretise(values: np.ndarray, n_bins: int) -> np.ndarray:
    """Equal-width binning of each column over its own range (a constant column is one bin)."""
    values = np.asarray(values, dtype=np.float64)
    binned = np.empty(values.shape, dtype=np.int64)
    for j, column in enumerate(values.T):
        inner_edges = np.histogram_bin_edges(column, bins=n_bins)[1:-1]
        binned[:, j] = np.digitize(column, inner_edges)
    return binned


def mutual_information_matrix(code_labels: np.ndarray, factor_labels_: np.ndarray) -> np.ndarray:
    """I(z_i; v_k) in nats for every discretised latent i and factor k → (D, K)."""
    info = np.zeros((code_labels.shape[1], factor_labels_.shape[1]))
    for i in range(code_labels.shape[1]):
        for k in range(factor_labels_.shape[1]):
            info[i, k] = mutual_info_score(factor_labels_[:, k], code_labels[:, i])
    return info


def _one_minus_entropy(rows: np.ndarray) -> np.ndarray:
    """1 − H(row / row.sum()) / log(n_columns) per row; an all-zero row scores 0, one column scores 1."""
    n = rows.shape[1]
    sums = rows.sum(axis=1)
    out = np.zeros(rows.shape[0])
    if n == 1:
        out[sums > 0] = 1.0
        return out
    for r, (row, s) in enumerate(zip(rows, sums)):
        if s <= 0:
            continue
        p = row[row > 0] / s
        out[r] = 1.0 + np.sum(p * np.log(p)) / np.log(n)
    return out
