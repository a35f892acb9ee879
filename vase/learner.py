"""The VASE learner: its whole state, and one training step that reads like eq. 8.

    L(phi, theta) = E[-log p(x|z^s,s)] + gamma |KL(q(z^s|x) || p(z)) - C|^2   (MDL on current data, eq. 3)
                  + E_{z,s',x'}[ W2(q_phi(z|x'), q_phi'(z|x')) + KL(p_theta'(x|z,s') || p_theta(x|z,s')) ]
                                                                               (dreaming, eq. 7)

`training_step` runs the phases in that order. Each switch is one object, chosen once in
`__init__`, with a stand-in when it is off: S is `inference` (eq. 6, or `SingleEnvironment`: every
batch is environment 0), A is the inference's masking (a^s, or `AllOnes`), D is `dreaming` (eq. 7's
dreams, or `NoDreams`). The rule set `inference.rules` (`vase.rules`) adds to eq. 3-6.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch

from vase.config import Config
from vase.conv_paths import place, use_implementation
from vase.cuda_graphs import GraphedNoGrad, GraphedPasses, usable
from vase.device import precision_context
from vase.dreaming import Dreaming, Dreams, NoDreams, Snapshot, decoder_proximity, encoder_proximity
from vase.errors import NumericalError
from vase.inference import Decision, build
from vase.masking import atypicality
from vase.networks import VAE, EnvironmentClassifier, Posterior
from vase.objective import (
    environment_capacity,
    kl_per_latent,
    masked_kl,
    masked_sample,
    mdl_loss,
    prior_where_masked,
    reconstruction_nll,
)
from vase.rules import as_configured
from vase.slots import from_split_layout

# The fused Adam kernel updates all ~2M parameters of the paper preset in one pass: ~2.4 ms per step
# against ~5 ms for the default multi-tensor one. `vase bench` times the step with both.
FUSED_ADAM = True


@dataclass
class Encoded:
    """One encoder pass over the real batch and the dreams, and what eq. 4-6 read from the batch."""

    x: torch.Tensor  # the real batch
    posterior: Posterior  # q_phi(z|x) of [x; x'] (real batch, then dreams)
    real: Posterior  # the real batch's rows
    alpha: torch.Tensor  # eq. 4 on x, per latent
    kl: torch.Tensor  # mean KL per latent on x
    usage: torch.Tensor  # latent use as the rule set reads it (information or KL)
    noise: torch.Tensor  # the reparameterisation's eps (eq. 2)
    class_logits: torch.Tensor | None  # q_psi on [x; x'], with S
    probs: torch.Tensor | None  # q_psi(s|x) averaged over the real batch, with S
    decoded: dict = field(default_factory=dict)  # env -> (batch logits, dream logits, NLL per image)
    errors: dict = field(default_factory=dict)  # env -> the batch's error as eq. 6 and L_s read it


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
    def __init__(self, cfg: Config, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.device = device = torch.device(device)
        m = cfg.model
        # Every random draw of the step comes from this generator, on the device it feeds.
        self.generator = torch.Generator(device=device).manual_seed(cfg.train.seed)
        # Weight init draws from torch's global (CPU) RNG, seeded from the run seed, and happens on
        # the CPU, so a seed gives the same initial weights on every device.
        torch.manual_seed(cfg.train.seed)
        self.model = place(VAE(m), device)
        self.classifier = EnvironmentClassifier(m).to(device)
        self.snapshot = Snapshot(self.model)
        fused = FUSED_ADAM and device.type in ("cpu", "cuda")
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.train.lr, fused=fused)
        self.classifier_optimizer = torch.optim.Adam(self.classifier.parameters(), lr=cfg.inference.classifier_lr,
                                                     fused=fused)
        # S (with A inside it: masks belong to slots) and D, or their stand-ins; eq. 3 under the rule set.
        self.inference = build(cfg, device, self.classifier, self.classifier_optimizer)
        self.slots = self.inference.slots
        self.dreaming = Dreaming(cfg.dream, self.snapshot) if cfg.dream.enabled else NoDreams()
        self.objective = as_configured(cfg).objective
        self.autocast = precision_context(device, cfg.train.precision)
        if cfg.train.precision != "fp32":  # the CPU "fast" layers are float32 only: autocast needs plain ones
            use_implementation(self.model, "nchw")
            use_implementation(self.snapshot.model, "nchw")
        if cfg.train.compile:  # after the snapshot's copy, which must keep the plain forward
            for net in (self.model.encoder, self.model.decoder):
                net.forward = torch.compile(net.forward)
        # The networks' training passes: CUDA graph replays on CUDA (vase.cuda_graphs), else the networks.
        graphed = cfg.train.cuda_graphs and usable(device, cfg.train.precision, cfg.train.compile)
        self.graphed = [GraphedPasses(n) for n in (self.model.encoder, self.model.decoder)] if graphed else []
        self.encoder_pass, self.decoder_pass = self.graphed or (self.model.encoder, self.model.decoder)
        if graphed:
            self.snapshot.passes = GraphedNoGrad(self.snapshot.imagine)
        # Per slot after the first: (step allocated, KL carried then), for the rule own_capacity_ramp.
        self.capacity_starts: dict[int, tuple[int, float]] = {}
        self.step = 0

    # -- the pieces of eq. 8 ------------------------------------------------------------------------
    def mask(self, env: int) -> torch.Tensor:
        """a^env as the batches of env are trained and decoded with it (all ones with A off)."""
        return self.inference.mask(env)

    def dream(self) -> Dreams | None:
        """x' ~ p_theta'(x | z, s') of the environments the inference dreams from (none with D off)."""
        with self.autocast():
            return self.dreaming.dream(self.inference.dream_environments(), self.cfg.model.latents, self.generator)

    def decode(self, posterior: Posterior, noise: torch.Tensor, env: int, dreams: Dreams | None):
        """Decode the real batch under env (masked posterior, eq. 2) and the dreams under s', in one pass."""
        batch = noise.shape[0]
        mask = self.mask(env)
        z = masked_sample(posterior.mu[:batch], posterior.logvar[:batch], mask, noise)
        envs = torch.full((batch,), env, dtype=torch.long, device=self.device)
        if dreams is not None:
            z, envs = torch.cat([z, dreams.z]), torch.cat([envs, dreams.env])
        with self.autocast():
            logits = self.decoder_pass(z, envs).float()
        return logits[:batch], logits[batch:]

    def fresh_shift(self, real: Posterior, mask: torch.Tensor, maskable: torch.Tensor, env: int):
        """The atypicality (eq. 4) of the masked posterior on this batch, with gradient, summed over
        env's fresh latents, for the penalty of `mdl_loss`; None where it is off. Fresh: unmasked,
        and no other environment uses it (not `maskable`); only in an environment allocated after
        the first (slot 0 is the first, and with S off the only one)."""
        if not (self.objective.fresh_aggregate_weight and env > 0):
            return None
        alpha = atypicality(*prior_where_masked(real.mu, real.logvar, mask))
        return (alpha * mask * (~maskable).to(mask.dtype)).sum()

    # -- one step --------------------------------------------------------------------------------------
    def training_step(self, x: torch.Tensor) -> StepOutput:
        """One step of eq. 8: dream, encode, infer the environment, the MDL term on the batch (eq. 3),
        the dreaming term on the dreams (eq. 7), update, and the bookkeeping of eq. 5-6."""
        t = self.step
        for passes in self.graphed:
            passes.new_step()
        dreams = self.dream()  # D: x' ~ p_theta'(x | z, s') of past environments s'
        enc = self.encode(x, dreams)  # one encoder pass over [x; x'], and eq. 4 on x
        decision = self.infer_environment(enc, dreams)  # S: eq. 6
        s = decision.env
        mask, maskable = self.enter(decision, enc.alpha)  # A: a^s, as it stands before this batch
        _, dream_logits, recon = self.reconstruct(enc, s, dreams)
        losses, target = self.mdl_term(enc, decision, mask, maskable, recon)  # eq. 3 with eq. 2
        losses.update(self.dreaming_term(enc, dreams, dream_logits))  # eq. 7
        losses.update(self.imagination_term(enc, s))  # Fig. 5B, off by default [ours]
        losses["total"] = self.total(losses)
        values = self.update(losses, enc, s, dreams, self.inference.learns(decision))
        if decision.verdict == "new":  # where own_capacity_ramp starts s's target: the KL read with the logs
            self.capacity_starts[s] = (t, values["kl"])
            target = environment_capacity(t, self.capacity_starts[s], self.objective)  # the same, as a number
        # Eq. 5-6's statistics of s: L_s, its latent use, then a^s.
        self.inference.bookkeeping(decision, self.eq6_error(enc, s, dreams), enc.usage, enc.alpha, mask, maskable)
        self.dreaming.stepped(t, self.model)  # every tau steps the snapshot is re-synced (paper §3.5)
        self.step += 1
        return StepOutput(step=t, decision=decision, losses=values, kl_per_latent=enc.kl, alpha=enc.alpha,
                          mask=mask, extra={"capacity": target})

    # -- the phases of a step ------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, dreams: Dreams | None) -> Encoded:
        """q_phi(z|x) of the batch and the dreams in one pass, what eq. 4-6 read from the batch, the
        reparameterisation noise, and q_psi's logits."""
        batch = x.shape[0]
        inputs = x if dreams is None else torch.cat([x, dreams.x])
        with self.autocast():
            posterior = Posterior(*(p.float() for p in self.encoder_pass(inputs)))
        real = Posterior(*(p[:batch] for p in posterior))
        with torch.no_grad():
            alpha = atypicality(real.mu, real.logvar)  # eq. 4
            kl = kl_per_latent(real.mu, real.logvar).mean(0)
            usage = self.inference.reading(kl, alpha)  # latent use as the rule set reads it
        noise = torch.randn(real.mu.shape, generator=self.generator, device=self.device)
        logits, probs = self.inference.classify(posterior.hidden, batch)
        return Encoded(x, posterior, real, alpha, kl, usage, noise, logits, probs)

    def reconstruct(self, enc: Encoded, env: int, dreams: Dreams | None):
        """(batch logits, dream logits, -log p(x|z^env, env) per image), decoded once per env."""
        if env not in enc.decoded:
            real_logits, dream_logits = self.decode(enc.posterior, enc.noise, env, dreams)
            enc.decoded[env] = (real_logits, dream_logits, reconstruction_nll(real_logits, enc.x))
        return enc.decoded[env]

    def eq6_error(self, enc: Encoded, env: int, dreams: Dreams | None) -> torch.Tensor:
        """The batch's mean reconstruction error under env as eq. 6 and L_s read it, a 0-d tensor:
        -log p(x|z^env, env); once per env, for eq. 6 and the bookkeeping alike."""
        if env not in enc.errors:
            enc.errors[env] = self.reconstruct(enc, env, dreams)[2].detach().mean()
        return enc.errors[env]

    def infer_environment(self, enc: Encoded, dreams: Dreams | None) -> Decision:
        """Eq. 6 under the rule set `inference.rules`; with S off, environment 0. The errors stay on
        the device until eq. 6 reads them with its other evidence (`vase.evidence`)."""
        error = lambda env: self.eq6_error(enc, env, dreams)  # noqa: E731
        return self.inference.infer(self.step, enc.probs, enc.alpha, enc.usage, error)

    def enter(self, decision: Decision, alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mask a^s this batch trains under, and the latents a^s may switch off (every one in
        eq. 5; the rule set may narrow them, `vase.rules`). A new environment starts its mask from
        this batch, and tells D (`Dreaming.new_environment`)."""
        s = decision.env
        maskable = self.inference.maskable(s)
        if decision.allocated:
            self.inference.start(s, alpha, maskable)
            self.dreaming.new_environment(self.model)
        return self.mask(s).clone(), maskable  # all ones when A is off

    def mdl_term(self, enc: Encoded, decision: Decision, mask: torch.Tensor, maskable: torch.Tensor,
                 recon: torch.Tensor) -> tuple[dict[str, torch.Tensor], float | torch.Tensor]:
        """Eq. 3 on the batch with the masked posterior of eq. 2, and the capacity target: C(t), or a
        new environment's own climb to it (`environment_capacity`, the rule own_capacity_ramp). The
        climb starts at the KL the allocating batch carries, a tensor until the logs' read
        (`training_step` records it)."""
        kl = masked_kl(enc.real.mu, enc.real.logvar, mask)
        new = decision.verdict == "new"  # the first environment (verdict "first") follows C(t)
        start = (self.step, kl.detach().mean()) if new else self.capacity_starts.get(decision.env)
        target = environment_capacity(self.step, start, self.objective)
        loss = mdl_loss(recon, kl, target, self.objective, self.fresh_shift(enc.real, mask, maskable, decision.env))
        return {"reconstruction": recon.mean(), "kl": kl.mean(), "mdl": loss}, target

    def dreaming_term(self, enc: Encoded, dreams: Dreams | None, dream_logits: torch.Tensor) -> dict:
        """Eq. 7 on the dreams: the encoder's W2 to the snapshot and (not in SD-[41]) the decoder's KL."""
        if dreams is None:
            return {}
        batch = enc.x.shape[0]
        terms = {"dream_encoder": encoder_proximity(Posterior(*(p[batch:] for p in enc.posterior)), dreams.posterior)}
        if self.cfg.dream.decoder_term:
            terms["dream_decoder"] = decoder_proximity(dream_logits, dreams.logits)
        return terms

    def total(self, losses: dict[str, torch.Tensor]) -> torch.Tensor:
        """Eq. 8: the MDL term plus the weighted dreaming terms."""
        loss = losses["mdl"]
        if "dream_encoder" in losses:
            loss = loss + self.cfg.dream.encoder_weight * losses["dream_encoder"]
        if "dream_decoder" in losses:
            loss = loss + self.cfg.dream.decoder_weight * losses["dream_decoder"]
        if "imagination" in losses:
            loss = loss + self.cfg.imagination.weight * losses["imagination"]
        return loss

    def imagination_term(self, enc: Encoded, s: int) -> dict:
        """Imagination-driven exploration (Fig. 5B) [ours, docs/method.md]: factors that past
        environments use and s does not (position, while training on static MNIST after moving
        Fashion) are imagined on the current data. The batch's codes under a^s get those latents
        redrawn from the prior and are decoded under s (no gradient); the encoder must then read
        the imagined images back into the codes they came from. So it learns to encode the current
        objects with the transferred factor before it ever sees them vary."""
        transfer = self.transferable_latents(s)
        if transfer is None:
            return {}
        n = min(self.cfg.imagination.batch_size, enc.x.shape[0])
        mask = self.mask(s)
        with torch.no_grad():
            codes = enc.real.mu[:n] * mask
            prior = torch.randn(codes.shape, generator=self.generator, device=self.device)
            codes = torch.where(transfer, prior, codes)
            envs = torch.full((n,), s, dtype=torch.long, device=self.device)
            imagined = torch.sigmoid(self.model.decoder(codes, envs))
        with self.autocast():
            read = self.model.encoder(imagined).mu.float()
        kept = (mask.bool() | transfer).to(read.dtype)
        return {"imagination": ((read - codes).pow(2) * kept).sum(1).mean()}

    def transferable_latents(self, s: int) -> torch.Tensor | None:
        """Latents some past environment uses and s does not, or None (imagination off, no past
        environment, as with S off, or nothing to transfer)."""
        if not self.cfg.imagination.enabled:
            return None
        past = self.inference.past_environments()
        if not past:
            return None
        transfer = torch.stack([self.inference.used(p) for p in past]).any(0) & ~self.inference.used(s)
        return transfer if bool(transfer.any()) else None

    def update(self, losses: dict[str, torch.Tensor], enc: Encoded, env: int, dreams: Dreams | None,
               learn: bool = True) -> dict:
        """q_psi's step (on detached features, so separate), then the model's, after one host read of
        every loss term and the gradient norm (the NaN check and the logs). A batch that does not
        learn (`EnvironmentInference.learns`) is logged with a gradient norm of 0 and moves nothing."""
        losses.update(self.inference.train_classifier(enc.class_logits, env, enc.x.shape[0], dreams, learn))
        self.optimizer.zero_grad(set_to_none=True)
        if learn:
            losses["total"].backward()
            norm = self._gradient_norm()
        else:
            norm = torch.zeros((), device=self.device)
        readings = torch.stack([*(v.detach() for v in losses.values()), norm]).tolist()
        values = dict(zip(losses, readings))
        self._check_finite(values, readings[-1])
        if learn:
            self.optimizer.step()
        return values

    def _gradient_norm(self) -> torch.Tensor:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))

    def _check_finite(self, losses: dict[str, float], gradient_norm: float) -> None:
        """Stop before the update on a NaN or Inf, naming the term (the loss first, then the gradient)."""
        for name, value in losses.items():
            if not math.isfinite(value):
                raise NumericalError(
                    f"step {self.step}: loss term '{name}' is {value}; the run stopped and the last "
                    "good checkpoint is kept (try a lower train.lr)"
                )
        if not math.isfinite(gradient_norm):
            raise NumericalError(
                f"step {self.step}: the gradient of the total loss is {gradient_norm}; the run stopped and the "
                "last good checkpoint is kept (try a lower train.lr)"
            )

    # -- evaluation helpers (no RNG, no state change) ------------------------------------------------
    @torch.no_grad()
    def encode_mean(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.encoder(x).mu

    @torch.no_grad()
    def infer_slot(self, x: torch.Tensor) -> int:
        """The slot the classifier would pick for x (0 when S is off); evaluation only, no decision."""
        return self.inference.slot_of(x, self.model.encoder)

    @torch.no_grad()
    def reconstruct_mean(self, x: torch.Tensor, env: int, mu: torch.Tensor | None = None) -> torch.Tensor:
        """Reconstruction from mu under env with a^env (masked latents at the prior mean, 0). With
        `mu`, these codes are decoded instead of the encoder's codes of x now."""
        z = (self.model.encoder(x).mu if mu is None else mu) * self.mask(env)
        return torch.sigmoid(
            self.model.decoder(z, torch.full((x.shape[0],), env, dtype=torch.long, device=self.device))
        )

    @torch.no_grad()
    def reconstruction_error(self, x: torch.Tensor, env: int, mu: torch.Tensor | None = None) -> float:
        """Mean error (nats per image) of x decoded from mu under env with a^env: the held-out
        reading of eq. 6's reconstruction test. Probabilities are clamped to [1e-6, 1 - 1e-6], so a
        pixel costs at most ~13.8 nats. With `mu`, of those codes (`reconstruct_mean`)."""
        recon = self.reconstruct_mean(x, env, mu).clamp(1e-6, 1 - 1e-6)
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
            "inference": self.inference.state_dict(),  # with the slots: a^s, L_s, usage
            "capacity_starts": dict(self.capacity_starts),
            "generator": self.generator.get_state(),
            "generator_device": self.device.type,
            "torch_rng": torch.get_rng_state(),
        }

    def load_state_dict(self, d: dict) -> None:
        self.step = int(d["step"])
        self.model.load_state_dict(d["model"])
        self.classifier.load_state_dict(d["classifier"])
        self.snapshot.load_state_dict(d["snapshot"])
        self.optimizer.load_state_dict(d["optimizer"])
        self.classifier_optimizer.load_state_dict(d["classifier_optimizer"])
        inference = d["inference"]
        if "masks" in d:  # the split layout: each slot's mask apart from the rest of it
            inference = from_split_layout(inference, d["masks"])
        self.inference.load_state_dict(inference)
        self.capacity_starts = dict(d.get("capacity_starts", {}))  # absent in checkpoints of runs without it
        # A CPU generator's state cannot seed a CUDA one (different algorithms). Moved to another
        # kind of device, the run continues from a fresh stream derived from its seed and step:
        # it resumes, but not bit for bit (docs/devices.md).
        saved_on = d.get("generator_device", "cpu")
        if saved_on == self.device.type:
            self.generator.set_state(d["generator"])
        else:
            warnings.warn(f"this run's checkpoint was written on {saved_on} and resumes on {self.device.type}: its "
                          "random stream restarts from a seed derived from (train.seed, step), so the continuation "
                          "is not bit-identical to an uninterrupted run", stacklevel=2)
            self.generator.manual_seed(self.cfg.train.seed * 1_000_003 + self.step)
        torch.set_rng_state(d["torch_rng"])
