"""Linear read-out probes on frozen codes (docs/probes.md, "2. What is probed").

The paper trains "object identity classifiers ... and an object position regressor on top of the
latent representation" (§4, Fig. 2 bottom) but its protocol (appendix A.6) is unpublished, so the
settings here are ours and are documented in ``docs/probes.md``. Both probes are pure functions of
arrays: they never see the model, so any representation (VASE, a baseline, the identity) can be
probed the same way.
"""
from __future__ import annotations

import numpy as np
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

# [ours] lbfgs on standardised 24-d codes converges well within this on a few thousand samples.
CLASSIFIER_MAX_ITER = 1000
# [ours] Inverse L2 strength of the classifier; sklearn's default, weak on thousands of samples.
CLASSIFIER_C = 1.0
# [ours] A tiny ridge keeps the least-squares solve stable when latents are collinear or dead
# (a dead latent standardises to pure noise) without visibly biasing a well-posed fit.
REGRESSOR_ALPHA = 1e-2


def object_id_accuracy(
    codes_train: np.ndarray,
    labels_train: np.ndarray,
    codes_test: np.ndarray,
    labels_test: np.ndarray,
    seed: int,
) -> float:
    """Held-out accuracy in [0, 1] of a linear classifier from codes to object class (docs/probes.md, "Classifier").

    Multinomial logistic regression on standardised codes. Standardising makes the fixed L2
    strength mean the same for every latent, whatever scale the encoder gave it. If the probe-train
    set holds a single class there is nothing to fit; the probe then predicts that class.
    """
    labels_train = np.asarray(labels_train)
    labels_test = np.asarray(labels_test)
    classes = np.unique(labels_train)
    if classes.size == 1:
        return float(np.mean(labels_test == classes[0]))
    probe = make_pipeline(
        StandardScaler(),
        LogisticRegression(C=CLASSIFIER_C, max_iter=CLASSIFIER_MAX_ITER, random_state=seed),
    )
    probe.fit(_as_2d(codes_train), labels_train)
    return float(np.mean(probe.predict(_as_2d(codes_test)) == labels_test))


def position_mse(
    codes_train: np.ndarray,
    xy_train: np.ndarray,
    codes_test: np.ndarray,
    xy_test: np.ndarray,
) -> float:
    """Held-out MSE of a linear regressor from codes to (x, y) in [0, 1] (docs/probes.md, "Regressor").

    Ridge regression on standardised codes; the squared error is averaged over the test examples
    and over the two coordinates, so a constant predictor at the mean scores Var(x)/2 + Var(y)/2
    (1/12 ≈ 0.083 for uniform positions). Table 1 reports this in units of 1e-4.
    """
    probe = make_pipeline(StandardScaler(), Ridge(alpha=REGRESSOR_ALPHA))
    probe.fit(_as_2d(codes_train), np.asarray(xy_train, dtype=np.float64))
    pred = probe.predict(_as_2d(codes_test))
    return float(np.mean((pred - np.asarray(xy_test, dtype=np.float64)) ** 2))


def _as_2d(codes: np.ndarray) -> np.ndarray:
    # float64 so the solvers' tolerances mean the same whatever dtype the encoder produced.
    codes = np.asarray(codes, dtype=np.float64)
    return codes.reshape(len(codes), -1)
