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


def test_sampled_dreams_are_bernoulli_draws_of_the_mean_dreams():
    """dream.images = "sample": the same z, s' and logits as the mean dreams, x' binary, on where the
    uniform falls below the pixel's mean (so about the mean's share of draws), and the snapshot's
    posterior is of the drawn images."""
    snap = Snapshot(_model())
    mean = snap.dream([0, 1], 64, 4, torch.Generator().manual_seed(3))
    drawn = snap.dream([0, 1], 64, 4, torch.Generator().manual_seed(3), sample=True)
    assert torch.equal(drawn.z, mean.z) and torch.equal(drawn.env, mean.env) and torch.equal(drawn.logits, mean.logits)
    assert set(drawn.x.unique().tolist()) <= {0.0, 1.0}
    p = torch.sigmoid(mean.logits)
    # 64 dreams of 4,096 pixels: the share of pixels on is the mean probability within 1 %.
    assert abs(float(drawn.x.mean()) - float(p.mean())) < 0.01
    assert float(drawn.x[p < 1e-3].sum()) <= 2 and float((1 - drawn.x[p > 1 - 1e-3]).sum()) <= 2
    again = Snapshot(snap.model).imagine(drawn.z, drawn.env)[0]
    assert torch.equal(again, mean.x)  # without uniforms, the means
    assert torch.allclose(drawn.posterior.mu, snap.model.encoder(drawn.x).mu)


def test_dreaming_draws_the_images_its_setting_names():
    from vase.config import DreamConfig
    from vase.dreaming import Dreaming

    snap = Snapshot(_model())
    for images, binary in (("mean", False), ("sample", True)):
        dreaming = Dreaming(DreamConfig(images=images, batch_size=8), snap)
        dreams = dreaming.dream([0], 4, torch.Generator().manual_seed(0))
        assert len(dreams.x) == 8 and (set(dreams.x.unique().tolist()) <= {0.0, 1.0}) == binary
