"""The VASE learner: its whole state, and one training step that reads like eq. 8.

    L(phi, theta) = E[-log p(x|z^s,s)] + gamma |KL(q(z^s|x) || p(z)) - C|     (MDL on current data, eq. 3)
                  + E_{z,s',x'}[ W2(q_phi(z|x'), q_phi'(z|x')) + KL(p_theta'(x|z,s') || p_theta(x|z,s')) ]
                                                                               (dreaming, eq. 7)

S, D and A are switches of the config; each is visible in `step` as one `if`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from vase.config import Config
from vase.dreaming import Dreams, Snapshot, decoder_proximity, encoder_proximity
from vase.errors import NumericalError
from vase.inference import Decision, EnvironmentInference
from vase.masking import LatentMasks, atypicality, information
from vase.networks import VAE, EnvironmentClassifier, Posterior
from vase.objective import (environment_capacity, kl_per_latent, masked_kl, masked_sample, mdl_loss, prior_where_masked,
                            reconstruction_nll)


# The fused Adam kernel updates all ~2M parameters of the paper preset in one pass: ~2.4 ms per step
# against ~5 ms for the default multi-tensor one. `vase bench` times the step with both.
FUSED_ADAM = True


@dataclass
class StepOutput:
    """What one step measured, for logging (plain floats and small CPU tensors)."""

    step: int
    decision: Decision
    losses: dict[str, float]
    kl_per_latent: torch.Tensor
    alpha: torch.Tensor
    mask: torch.Tensor
    extra: dict[str, float] = field(default_factory=dict)


class Learner:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        m = cfg.model
        self.generator = torch.Generator().manual_seed(cfg.train.seed)
        # Weight init draws from torch's global RNG: seed it from the run seed so runs reproduce.
        torch.manual_seed(cfg.train.seed)
        self.model = VAE(m)
        self.classifier = EnvironmentClassifier(m)
        self.snapshot = Snapshot(self.model)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.train.lr, fused=FUSED_ADAM)
        self.classifier_optimizer = torch.optim.Adam(self.classifier.parameters(), lr=cfg.inference.classifier_lr,
                                                     fused=FUSED_ADAM)
        self.masks = LatentMasks(m.k_max, m.latents, cfg.mask)
        self.inference = EnvironmentInference(cfg.inference, m.k_max, m.latents, use_masks=cfg.mask.enabled)
        # Per environment slot after the first: (step allocated, KL carried then), for
        # objective.new_env_ramp_steps.
        self.capacity_starts: dict[int, tuple[int, float]] = {}
        self.step = 0

    # -- the pieces of eq. 8 ------------------------------------------------------------------------
    def dream_environments(self) -> list[int]:
        """Past environments to dream from. With S off every batch is environment 0, so the dreams
        come from environment 0 as the (tau-steps old) snapshot remembers it."""
        if not self.cfg.inference.enabled:
            return [0]
        return self.inference.past_environments()

    def dream(self) -> Dreams | None:
        past = self.dream_environments() if self.cfg.dream.enabled else []
        if not past or self.inference.n_envs == 0:
            return None
        return self.snapshot.dream(past, self.cfg.dream.batch_size, self.cfg.model.latents, self.generator)

    def decode(self, posterior: Posterior, noise: torch.Tensor, env: int, dreams: Dreams | None):
        """Decode the real batch under env (masked posterior, eq. 2) and the dreams under s', in one pass."""
        batch = noise.shape[0]
        mask = self.masks.mask(env)
        z = masked_sample(posterior.mu[:batch], posterior.logvar[:batch], mask, noise)
        envs = torch.full((batch,), env, dtype=torch.long)
        if dreams is not None:
            z, envs = torch.cat([z, dreams.z]), torch.cat([envs, dreams.env])
        logits = self.model.decoder(z, envs)
        return logits[:batch], logits[batch:]

    def aggregate_shift(self, real: Posterior, mask: torch.Tensor, maskable: torch.Tensor, env: int):
        """The atypicality (eq. 4) of the masked posterior on this batch, with gradient, summed over
        the unmasked latents and over env's fresh ones, for the penalties of `mdl_loss`; None where
        a penalty is off. Fresh: unmasked, and no other environment uses it (not `maskable`); only in
        an environment allocated after the first (one in `capacity_starts`)."""
        obj = self.cfg.objective
        fresh_on = obj.fresh_aggregate_weight and env in self.capacity_starts
        if not (obj.aggregate_weight or fresh_on):
            return None, None
        alpha = atypicality(*prior_where_masked(real.mu, real.logvar, mask))
        fresh = (alpha * mask * (~maskable).to(mask.dtype)).sum() if fresh_on else None
        return (alpha.sum() if obj.aggregate_weight else None), fresh

    # -- one step --------------------------------------------------------------------------------------
    def training_step(self, x: torch.Tensor) -> StepOutput:
        cfg, t, batch = self.cfg, self.step, x.shape[0]
        dreams = self.dream()  # D: imagined past data, no autograd through the snapshot
        # One encoder pass serves the real batch and the dreams.
        inputs = x if dreams is None else torch.cat([x, dreams.x])
        posterior = self.model.encoder(inputs)
        real = Posterior(*(p[:batch] for p in posterior))
        with torch.no_grad():
            alpha = atypicality(real.mu, real.logvar)  # eq. 4
            kl_batch = kl_per_latent(real.mu, real.logvar).mean(0)
            # Latent usage for eq. 5-6 is read as information, not KL [ours]: see `information`.
            info_batch = information(kl_batch, alpha)
        noise = torch.randn(real.mu.shape, generator=self.generator)
        class_logits = self.classifier(posterior.hidden) if cfg.inference.enabled else None

        decoded: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

        def reconstruct(env: int):
            if env not in decoded:
                real_logits, dream_logits = self.decode(posterior, noise, env, dreams)
                decoded[env] = (real_logits, dream_logits, reconstruction_nll(real_logits, x))
            return decoded[env]

        # S: which environment is this batch from (eq. 6)?
        if cfg.inference.enabled:
            probs = F.softmax(class_logits[:batch].detach(), dim=1).mean(0)
            decision = self.inference.infer(
                t, probs, alpha, info_batch, self.masks, lambda env: float(reconstruct(env)[2].detach().mean())
            )
        else:
            decision = self.inference.infer(t, torch.ones(1), alpha, info_batch, self.masks, lambda env: 0.0) \
                if self.inference.n_envs == 0 else Decision(t, 0, 0, "same")
        s = decision.env
        # Which latents a^s may switch off [ours]: other slots' latents with S, learnt ones without.
        maskable = self.inference.maskable(s) if cfg.inference.enabled else self.masks.learnt[s].clone()
        if decision.allocated:
            self.masks.start(s, alpha, maskable)
            self.snapshot.sync(self.model)  # [ours]: dreams of the old environments from the model that knew them
        mask = self.masks.mask(s).clone()  # A: a^s (all ones when A is off), before this batch updates it
        real_logits, dream_logits, recon = reconstruct(s)

        # MDL on current data (eq. 3) with the masked posterior (eq. 2).
        kl = masked_kl(real.mu, real.logvar, mask)
        if decision.verdict == "new":  # the first environment is C(t)'s own
            self.capacity_starts[s] = (t, float(kl.detach().mean()))
        target = environment_capacity(t, self.capacity_starts.get(s), cfg.objective)
        atypical, fresh_atypical = self.aggregate_shift(real, mask, maskable, s)
        loss_mdl = mdl_loss(recon, kl, target, cfg.objective, atypical, fresh_atypical)
        losses = {"reconstruction": recon.mean(), "kl": kl.mean(), "mdl": loss_mdl}
        loss = loss_mdl
        # Dreaming feedback on past data (eq. 7).
        if dreams is not None:
            dream_posterior = Posterior(*(p[batch:] for p in posterior))
            losses["dream_encoder"] = encoder_proximity(dream_posterior, dreams.posterior)
            loss = loss + cfg.dream.encoder_weight * losses["dream_encoder"]
            if cfg.dream.decoder_term:  # dropped in the SD-[41] variant
                losses["dream_decoder"] = decoder_proximity(dream_logits, dreams.logits)
                loss = loss + cfg.dream.decoder_weight * losses["dream_decoder"]
        losses["total"] = loss

        self._check_finite(losses)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self._check_gradients()
        self.optimizer.step()
        if cfg.inference.enabled:
            losses["classifier"] = self._train_classifier(class_logits, s, batch, dreams)

        # Bookkeeping of eq. 5 and eq. 6 for the environment just trained (not on a doubtful batch).
        if decision.verdict != "pending":
            # Masked latents are prior noise (eq. 2): they carry nothing for this environment.
            self.inference.record(s, float(recon.detach().mean()), torch.where(mask.bool(), info_batch, 0.0))
            used = None if cfg.inference.enabled else self.inference.used(s)  # the single-slot rule's record
            if cfg.mask.enabled and not torch.equal(self.masks.update(s, alpha, maskable, used), mask):
                self.inference.resettle(s, t)  # L_s was measured under the old mask
        if cfg.dream.enabled and (t + 1) % cfg.dream.snapshot_every == 0:
            self.snapshot.sync(self.model)  # every tau steps (paper §3.5)
        self.step += 1
        return StepOutput(
            step=t,
            decision=decision,
            losses={k: float(v.detach()) if torch.is_tensor(v) else v for k, v in losses.items()},
            kl_per_latent=kl_batch,
            alpha=alpha,
            mask=mask,
            extra={"capacity": target},
        )

    def _train_classifier(self, logits: torch.Tensor, env: int, batch: int, dreams: Dreams | None) -> float:
        """q_psi: cross-entropy on the real batch (inferred label) and on dreams (their label)."""
        labels = torch.full((batch,), env, dtype=torch.long)
        if dreams is not None:
            labels = torch.cat([labels, dreams.env])
        loss = F.cross_entropy(logits, labels)
        self.classifier_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.classifier_optimizer.step()
        return float(loss.detach())

    def _check_finite(self, losses: dict[str, torch.Tensor]) -> None:
        for name, value in losses.items():
            if not torch.isfinite(value):
                raise NumericalError(
                    f"step {self.step}: loss term '{name}' is {float(value.detach())}; the run stopped and the last "
                    "good checkpoint is kept (try a lower train.lr)"
                )

    def _check_gradients(self) -> None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        if not torch.isfinite(norm):
            raise NumericalError(
                f"step {self.step}: the gradient of the total loss is {float(norm)}; the run stopped and the "
                "last good checkpoint is kept (try a lower train.lr)"
            )

    # -- evaluation helpers (no RNG, no state change) ------------------------------------------------
    @torch.no_grad()
    def encode_mean(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.encoder(x).mu

    @torch.no_grad()
    def infer_slot(self, x: torch.Tensor) -> int:
        """The slot the classifier would pick for x (0 when S is off); evaluation only, no decision."""
        if not self.cfg.inference.enabled or self.inference.n_envs == 0:
            return 0
        probs = F.softmax(self.classifier(self.model.encoder(x).hidden), dim=1).mean(0)
        return self.inference.predict(probs)

    @torch.no_grad()
    def reconstruct_mean(self, x: torch.Tensor, env: int) -> torch.Tensor:
        """Reconstruction from mu under env with a^env (masked latents at the prior mean, 0)."""
        post = self.model.encoder(x)
        z = post.mu * self.masks.mask(env)
        return torch.sigmoid(self.model.decoder(z, torch.full((x.shape[0],), env, dtype=torch.long)))

    @torch.no_grad()
    def reconstruction_error(self, x: torch.Tensor, env: int) -> float:
        """Mean error (nats per image) of x decoded from mu under env with a^env: the held-out
        reading of eq. 6's reconstruction test. Probabilities are clamped to [1e-6, 1 - 1e-6], so a
        pixel costs at most ~13.8 nats."""
        recon = self.reconstruct_mean(x, env).clamp(1e-6, 1 - 1e-6)
        return float(reconstruction_nll(torch.logit(recon), x).mean())

    # -- checkpointing ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "model": self.model.state_dict(),
            "classifier": self.classifier.state_dict(),
            "snapshot": self.snapshot.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "classifier_optimizer": self.classifier_optimizer.state_dict(),
            "masks": self.masks.state_dict(),
            "inference": self.inference.state_dict(),
            "capacity_starts": dict(self.capacity_starts),
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
        }

    def load_state_dict(self, d: dict) -> None:
        self.step = int(d["step"])
        self.model.load_state_dict(d["model"])
        self.classifier.load_state_dict(d["classifier"])
        self.snapshot.load_state_dict(d["snapshot"])
        self.optimizer.load_state_dict(d["optimizer"])
        self.classifier_optimizer.load_state_dict(d["classifier_optimizer"])
        self.masks.load_state_dict(d["masks"])
        self.inference.load_state_dict(d["inference"])
        self.capacity_starts = dict(d.get("capacity_starts", {}))  # absent in checkpoints from before it
        self.generator.set_state(d["generator"])
        torch.set_rng_state(d["torch_rng"])
