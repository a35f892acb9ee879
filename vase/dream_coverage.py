"""Does eq. 7 hold what it is meant to hold? Drift on a past environment's real data against drift
on its dreams.

Eq. 7 keeps the encoder and the decoder close to a snapshot on dreams, x' decoded from z ~ p(z).
That protects a past environment only if its real images and codes lie where the dreams are: the
paper's premise that a trained environment's aggregate posterior is close to the prior. This
module measures the premise. Over a window of training, from a reference copy of the model to the
model now, it takes eq. 7's two distances for a past slot s on dreams and on real data, and the
encoder's once more on reconstructions:

- on dreams of s, as eq. 7 does: the encoder's W2 on x' and the decoder's Bernoulli KL on z ~ p(z);
- on the held-out real images of the environment trained under s: the encoder's W2 on x, and the
  decoder's KL on the codes z ~ q(z^s | x) of eq. 2 (the reference encoder's posterior, with
  a^s; masked latents are prior noise);
- the encoder's W2 once more, on the reference's reconstructions of those images: their codes z
  decoded under s, as a dream is, but from the real codes instead of z ~ p(z).

Real drift far above dream drift means the dreams do not stand for the data they should protect
(docs/regime.md, "Where the old slots forget"). The reconstructions split the encoder's gap in two:
real above reconstructions is what the real images' pixels carry that decoded images lack;
reconstructions above dreams is where the real codes lie that p(z) seldom draws.
`vase.evaluator.Evaluator` takes the reading at every probe point.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from vase.dreaming import Snapshot, decoder_proximity, encoder_proximity
from vase.networks import VAE
from vase.objective import masked_sample

DREAMS = 256  # dreams per reading: the held-out sets' order of size
COVERAGE_TERMS = ("encoder_real", "encoder_recon", "encoder_dream", "decoder_real", "decoder_dream")


@dataclass
class Coverage:
    """Eq. 7's distances (means over images) from the reference to the model, on real data and dreams."""

    encoder_real: float  # W2 between the encoders' posteriors of the real held-out images
    encoder_recon: float  # the same on the reference's decoded means of their codes
    encoder_dream: float  # the same on dreams of the slot: eq. 7's encoder term
    decoder_real: float  # KL(Bern(reference) || Bern(model)) on the real images' codes, summed over pixels
    decoder_dream: float  # the same on z ~ p(z): eq. 7's decoder term

    def as_dict(self) -> dict:
        return {k: round(v, 4) for k, v in asdict(self).items()}


@torch.no_grad()
def coverage(model: VAE, reference: Snapshot, x: torch.Tensor, slot: int, mask: torch.Tensor,
             generator: torch.Generator) -> Coverage:
    """Eq. 7's two distances between `reference` and `model`, on the real images x of slot `slot`
    (decoded with a^slot = `mask`, eq. 2) and on as many dreams of that slot as eq. 7 would draw
    them. All randomness comes from `generator`, so the reading leaves training untouched."""
    dreams = reference.dream([slot], DREAMS, mask.shape[0], generator)
    real = reference.model.encoder(x)
    noise = torch.randn(real.mu.shape, generator=generator, device=generator.device)
    codes = masked_sample(real.mu.float(), real.logvar.float(), mask, noise)
    env = torch.full((x.shape[0],), slot, dtype=torch.long, device=x.device)
    decoded = reference.model.decoder(codes, env)
    recon = torch.sigmoid(decoded.float())
    return Coverage(
        encoder_real=float(encoder_proximity(model.encoder(x), real)),
        encoder_recon=float(encoder_proximity(model.encoder(recon), reference.model.encoder(recon))),
        encoder_dream=float(encoder_proximity(model.encoder(dreams.x), dreams.posterior)),
        decoder_real=float(decoder_proximity(model.decoder(codes, env), decoded)),
        decoder_dream=float(decoder_proximity(model.decoder(dreams.z, dreams.env), dreams.logits)),
    )
