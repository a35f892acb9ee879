"""D: the dreaming loss of eq. 7."""
import torch

from vase.config import ModelConfig
from vase.dreaming import Snapshot, decoder_proximity, encoder_proximity
from vase.networks import VAE


def _model():
    torch.manual_seed(0)
    return VAE(ModelConfig(channels=[8, 8, 8, 8], hidden=32, latents=4, k_max=3))


def _dream_loss(model, snapshot, dreams):
    post = model.encoder(dreams.x)
    logits = model.decoder(dreams.z, dreams.env)
    return encoder_proximity(post, dreams.posterior), decoder_proximity(logits, dreams.logits)


def test_dream_loss_is_zero_when_model_equals_snapshot():
    model = _model()
    snap = Snapshot(model)
    dreams = snap.dream([0, 1], 16, 4, torch.Generator().manual_seed(0))
    enc, dec = _dream_loss(model, snap, dreams)
    assert float(enc.detach()) == 0.0 and float(dec.detach()) == 0.0


def test_dream_loss_is_positive_after_an_update_on_other_data():
    model = _model()
    snap = Snapshot(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.rand(8, 1, 64, 64)
    post = model.encoder(x)
    logits = model.decoder(post.mu, torch.zeros(8, dtype=torch.long))
    torch.nn.functional.binary_cross_entropy_with_logits(logits, x).backward()
    opt.step()
    dreams = snap.dream([0, 1], 16, 4, torch.Generator().manual_seed(0))
    enc, dec = _dream_loss(model, snap, dreams)
    assert float(enc.detach()) > 0.0 and float(dec.detach()) > 0.0


def test_snapshot_is_frozen_and_dreams_come_from_past_envs():
    model = _model()
    snap = Snapshot(model)
    assert not any(p.requires_grad for p in snap.model.parameters())
    dreams = snap.dream([2], 10, 4, torch.Generator().manual_seed(1))
    assert torch.equal(dreams.env, torch.full((10,), 2))
    assert not dreams.x.requires_grad and dreams.x.min() >= 0 and dreams.x.max() <= 1


def test_encoder_proximity_is_w2_between_diagonal_gaussians():
    from vase.networks import Posterior

    a = Posterior(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]), None)
    b = Posterior(torch.tensor([[0.0, 0.0]]), torch.log(torch.tensor([[4.0, 1.0]])), None)
    # ||1-0||^2 + ||sigma 1 - sigma 2||^2 = 1 + 1
    assert float(encoder_proximity(a, b)) == 2.0
