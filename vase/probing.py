"""The probe runner the run's evaluator calls (docs/probes.md): fixed probe sets, evaluation, Table 1 summaries.

Protocol (ours, since the paper's appendix A.6 is unpublished; see ``docs/probes.md``):

1. Per environment, a fixed probe-train and probe-held-out index set, drawn once with
   ``np.random.default_rng(cfg.seed + env_index)``.
2. At each evaluation the frozen encoder maps both sets to μ(x); a linear classifier per
   environment with a class factor gives ``object_id/<env>`` (held-out accuracy) and a linear
   regressor per moving environment gives ``position_mse/<env>`` (held-out MSE).
3. ``results()`` summarises the history: Table 1 columns, the R matrix, forgetting and BWT
   (``vase.metrics.continual``).

Evaluation never changes the training run: it runs under ``torch.no_grad()`` and restores the
global torch, numpy and python RNG states, so a run with probes draws the same random numbers as a
run without them.
"""
from __future__ import annotations

import copy
import math
import random
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from vase.errors import CheckpointError
from vase.inference import most_likely_slot
from vase.metrics.continual import (
    ACCURACY,
    KINDS,
    MSE,
    TABLE1_PREFIX,
    ProbeCurve,
    average_forgetting,
    backward_transfer,
    probe_matrix,
    probe_name,
    table1_stats,
)
from vase.metrics.probes import object_id_accuracy, position_mse
from vase.objective import masked_sample

# Images per encoder call: bounds peak memory of a probe pass (spec: chunks of 512).
ENCODE_CHUNK = 512

Encode = Callable[[torch.Tensor], Any]


def positions(env, indices: np.ndarray) -> np.ndarray:
    """(len(indices), 2): the objects' (x, y) in [0, 1], the position regressor's targets."""
    return np.stack([np.asarray(env.factors["x"])[indices], np.asarray(env.factors["y"])[indices]], axis=1)


def draw_probe_sets(n_available: int, train_size: int, test_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint probe-train and probe-held-out indices into an environment of ``n_available`` items.

    Sizes are ``train_size`` and ``test_size`` when the environment is large enough; otherwise the
    available items are split in the same train:test proportion (each side at least one item).
    Uses its own ``default_rng(seed)`` so the global RNGs are never touched.
    """
    if n_available < 2:
        raise ValueError(f"an environment needs at least 2 items to probe, it has {n_available}")
    n_train, n_test = train_size, test_size
    if n_available < train_size + test_size:
        n_train = int(np.clip(round(n_available * train_size / (train_size + test_size)), 1, n_available - 1))
        n_test = n_available - n_train
    order = np.random.default_rng(seed).permutation(n_available)
    return order[:n_train].astype(np.int64), order[n_train : n_train + n_test].astype(np.int64)


def encode_indices(env, indices: np.ndarray, encode: Encode, chunk: int = ENCODE_CHUNK) -> np.ndarray:
    """μ(x) of ``env``'s items at ``indices`` as float64 (len(indices), D), in chunks, without grad."""
    parts = []
    with torch.no_grad():
        for start in range(0, len(indices), chunk):
            idx = torch.as_tensor(indices[start : start + chunk], dtype=torch.long)
            mu = encode(env.batch(idx))
            if isinstance(mu, torch.Tensor):
                mu = mu.detach().cpu().numpy()
            parts.append(np.asarray(mu, dtype=np.float64).reshape(len(idx), -1))
    return np.concatenate(parts, axis=0)


class SlotReading:
    """What the paper's reading needs of the slots at one probe point: the mask a^s each allocated
    slot applies (eq. 2), and q_psi, which picks the slot (None with S off: every image is slot 0).
    The trainer saves one beside the encoder at every probe point, so `vase eval` can recompute
    the reading (docs/probes.md)."""

    def __init__(self, masks: torch.Tensor, classifier: torch.nn.Module | None):
        self.masks, self.classifier = masks, classifier  # masks: (allocated slots, latents)

    @classmethod
    def of(cls, learner) -> SlotReading:
        """The learner's slots as they are now (the classifier's weights copied)."""
        inference = learner.inference
        masks = torch.stack([inference.mask(env) for env in range(max(inference.n_envs, 1))]).float()
        classifier = copy.deepcopy(learner.classifier) if learner.cfg.inference.enabled else None
        return cls(masks, classifier)

    @classmethod
    def single(cls, latents: int, device: torch.device | str = "cpu") -> SlotReading:
        """S and A off: one slot, every latent unmasked."""
        return cls(torch.ones(1, latents, device=device), None)

    def slot_of(self, hidden: torch.Tensor) -> int:
        """s_hat for a chunk of images, as eq. 6's inference predicts it (0 with S off)."""
        if self.classifier is None:
            return 0
        return most_likely_slot(self.classifier, hidden, self.masks.shape[0])

    def state_dict(self) -> dict:
        return {"masks": self.masks.cpu(),
                "classifier": None if self.classifier is None else self.classifier.state_dict()}

    @classmethod
    def load(cls, state: dict, cfg_model, device: torch.device | str = "cpu") -> SlotReading:
        from vase.networks import EnvironmentClassifier

        classifier = None
        if state["classifier"] is not None:
            classifier = EnvironmentClassifier(cfg_model).to(device)
            classifier.load_state_dict(state["classifier"])
        return cls(state["masks"].to(device), classifier)


class PosteriorSamples:
    """The paper's probe reading: codes z drawn from the masked posterior of eq. 2 under the slot
    q_psi picks for each chunk of images, masked latents as prior noise. The noise comes from a
    generator seeded afresh for every evaluation, so the same encoder and slots give the same
    codes."""

    def __init__(self, encoder, slots: SlotReading, seed: int):
        self.encoder, self.slots = encoder, slots
        self.generator = torch.Generator(device=slots.masks.device).manual_seed(seed)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        post = self.encoder.posterior(x)
        mask = self.slots.masks[self.slots.slot_of(post.hidden)]
        noise = torch.randn(post.mu.shape, generator=self.generator, device=post.mu.device)
        return masked_sample(post.mu, post.logvar, mask, noise)


@contextmanager
def preserved_global_rng() -> Iterator[None]:
    """Restore torch's, numpy's and python's global RNG states on exit.

    The probe code itself draws from private generators only; this guard also covers an
    ``env.batch`` or ``encode`` that samples, so evaluation can never shift the training stream.
    """
    torch_state, numpy_state, python_state = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        np.random.set_state(numpy_state)
        random.setstate(python_state)


class ProbeSuite:
    """Fixed probe sets over the training environments, and the history of probe values.

    ``envs`` are in training-sequence order (``env_index`` = position); each has ``.name``,
    ``.family``, ``.moving``, ``.factors`` (``"class"`` int64 (N,), ``"x"``, ``"y"`` in [0, 1]),
    ``.batch(idx) -> (B, C, 64, 64)`` float32 images and ``len()``. ``cfg`` is a ``ProbeConfig``
    (``every`` is the trainer's evaluation interval; this class uses the set sizes and the seed).
    """

    def __init__(self, envs: Sequence, cfg) -> None:
        self.envs = list(envs)
        self.cfg = cfg
        self.names = _unique_names([env.name for env in self.envs])
        self.sets = [
            draw_probe_sets(len(env), cfg.train_size, cfg.test_size, cfg.seed + i) for i, env in enumerate(self.envs)
        ]
        self.probes = self._probe_specs()
        self.history: list[tuple[int, dict[str, float]]] = []
        self.boundaries: dict[int, int] = {}

    # -- evaluation ------------------------------------------------------------------------------
    def evaluate(self, encode: Encode, step: int) -> dict[str, float]:
        """Fit every probe on the current codes and record the held-out values at ``step``.

        ``encode(images) -> μ`` (numpy or tensor, (B, D)) must be the frozen encoder in eval mode.
        Evaluating twice at the same step (an interval that falls on a boundary) replaces the
        earlier entry, so the history has one entry per step.
        """
        if self.history and step < self.history[-1][0]:
            raise ValueError(f"probe evaluation at step {step} is before the last one ({self.history[-1][0]})")
        values: dict[str, float] = {}
        with preserved_global_rng():
            for i, env in enumerate(self.envs):
                values.update(self._evaluate_env(i, env, encode))
        if self.history and self.history[-1][0] == step:
            self.history.pop()
        self.history.append((int(step), values))
        return values

    def _evaluate_env(self, i: int, env, encode: Encode) -> dict[str, float]:
        wanted = {spec["kind"]: name for name, spec in self.probes.items() if spec["env_index"] == i}
        if not wanted:
            return {}
        train, test = self.sets[i]
        codes = encode_indices(env, np.concatenate([train, test]), encode)
        codes_train, codes_test = codes[: len(train)], codes[len(train) :]
        out = {}
        if ACCURACY in wanted:
            labels = np.asarray(env.factors["class"])
            out[wanted[ACCURACY]] = object_id_accuracy(
                codes_train, labels[train], codes_test, labels[test], seed=self.cfg.seed + i
            )
        if MSE in wanted:
            out[wanted[MSE]] = position_mse(codes_train, positions(env, train), codes_test, positions(env, test))
        return out

    def _probe_specs(self) -> dict[str, dict]:
        """Which probes exist: object-ID where there is a class factor, position where objects move."""
        specs = {}
        for i, (env, name) in enumerate(zip(self.envs, self.names)):
            if "class" in env.factors:
                specs[probe_name(ACCURACY, name)] = {"kind": ACCURACY, "env_index": i, "family": env.family}
            if env.moving:
                specs[probe_name(MSE, name)] = {"kind": MSE, "env_index": i, "family": env.family}
        return specs

    # -- boundaries and summaries ----------------------------------------------------------------
    def mark_boundary(self, env_index: int, step: int) -> None:
        """Record that training on environment ``env_index`` ended at ``step`` (call evaluate too)."""
        if not 0 <= env_index < len(self.envs):
            raise ValueError(f"env_index {env_index} out of range for {len(self.envs)} environments")
        self.boundaries[int(env_index)] = int(step)

    def env_end_steps(self) -> list[int]:
        """End steps of the environments trained so far, in sequence order (a prefix of the envs)."""
        ended = sorted(self.boundaries)
        if ended != list(range(len(ended))):
            raise ValueError(f"boundaries must be marked in sequence order, got environments {ended}")
        return [self.boundaries[i] for i in ended]

    def curves(self) -> list[ProbeCurve]:
        """The history as one ``ProbeCurve`` per probe."""
        curves = []
        for name, spec in self.probes.items():
            points = [(step, values[name]) for step, values in self.history if name in values]
            curves.append(
                ProbeCurve(
                    name=name,
                    kind=spec["kind"],
                    env_index=spec["env_index"],
                    steps=[s for s, _ in points],
                    values=[v for _, v in points],
                )
            )
        return curves

    def results(self, begun: int | None = None) -> dict:
        """JSON-serialisable summary: history, boundaries, R matrices, Table 1, forgetting and BWT.

        Values are raw (accuracy in [0, 1], MSE in squared position units); NaN becomes None.
        Matrices, forgetting and BWT are keyed by Table 1 group ("object_id", "position").
        ``begun``: Table 1 over the first ``begun`` environments only, those a run in progress has
        begun to train; a later one's MAX would be its zero-shot reading (docs/probes.md).
        """
        ends = self.env_end_steps()
        curves = self.curves()
        begun_curves = [c for c in curves if begun is None or c.env_index < begun]
        matrices = {kind: probe_matrix(curves, ends, kind) for kind in KINDS}
        return _json_safe(
            {
                "reading": self.cfg.reading,
                "env_names": self.names,
                "probes": self.probes,
                "history": [{"step": step, "values": values} for step, values in self.history],
                "boundaries": ends,
                "matrix": {TABLE1_PREFIX[k]: m.tolist() for k, m in matrices.items()},
                "table1": table1_stats(begun_curves, ends),
                "forgetting": {TABLE1_PREFIX[k]: average_forgetting(m, k) for k, m in matrices.items()},
                "bwt": {TABLE1_PREFIX[k]: backward_transfer(m, k) for k, m in matrices.items()},
            }
        )

    # -- checkpointing ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """History and boundaries as plain python, plus what the probe sets were drawn from."""
        return {
            "history": [[step, dict(values)] for step, values in self.history],
            "boundaries": [[i, step] for i, step in sorted(self.boundaries.items())],
            "probe_sets": self._fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore history and boundaries; refuse a state whose probe sets were drawn differently."""
        if state.get("probe_sets") != self._fingerprint():
            raise CheckpointError(
                "the checkpoint's probe sets differ from this run's (probe seed/sizes or environments changed): "
                f"checkpoint {state.get('probe_sets')}, run {self._fingerprint()}"
            )
        self.history = [(int(step), {k: float(v) for k, v in values.items()}) for step, values in state["history"]]
        self.boundaries = {int(i): int(step) for i, step in state["boundaries"]}

    def _fingerprint(self) -> dict:
        return {
            "seed": int(self.cfg.seed),
            "envs": [
                [name, len(env), len(tr), len(te)] for name, env, (tr, te) in zip(self.names, self.envs, self.sets)
            ],
        }


def _unique_names(names: list[str]) -> list[str]:
    """Environment names, suffixed with "#<index>" where a name repeats in the sequence."""
    return [f"{n}#{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def _json_safe(obj: Any) -> Any:
    """Plain python containers and numbers, with NaN/inf as None (strict JSON has no NaN)."""
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, np.integer):
        return int(obj)
    return obj
