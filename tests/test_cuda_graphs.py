"""CUDA graphs of the training passes (vase.cuda_graphs): which pass replays a graph, and on a GPU,
that replays compute what the eager passes compute.

The routing rules are tested on the CPU with the capture replaced by a recorder; the tests marked
`cuda` capture real graphs and are skipped where there is no GPU.
"""
import pytest
import torch
from torch import nn

from vase.config import build_config
from vase.cuda_graphs import GraphedNoGrad, GraphedPasses, capture_key, usable
from vase.dreaming import Snapshot
from vase.learner import Learner
from vase.networks import VAE

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Recorded(GraphedPasses):
    """GraphedPasses whose 'graphs' only record that they ran."""

    def __init__(self, module):
        super().__init__(module)
        self.captured, self.replays = [], 0

    def _capture(self, args):
        self.captured.append(capture_key(args))

        def replay(*a):
            self.replays += 1
            return self.module(*a)

        return replay


def test_one_replay_per_step_and_eager_otherwise():
    passes = Recorded(nn.Linear(3, 2))
    x = torch.randn(4, 3)
    passes(x)
    passes(x)  # a second pass in the same step runs eagerly: the first's activations stay intact
    assert passes.replays == 1
    passes.new_step()
    passes(x)
    assert passes.replays == 2 and len(passes.captured) == 1  # the same shape replays its graph
    passes.new_step()
    with torch.no_grad():
        passes(x)  # no gradient: eager
    passes.module.eval()
    passes(x)  # evaluation: eager
    assert passes.replays == 2
    passes.module.train()
    passes(torch.randn(5, 3))  # a new shape: captured on its own
    assert passes.replays == 3 and len(passes.captured) == 2


def test_graphs_only_on_cuda_in_fp32_eager():
    assert usable(torch.device("cuda"), "fp32", compiled=False)
    assert not usable(torch.device("cpu"), "fp32", compiled=False)
    assert not usable(torch.device("cuda"), "bf16", compiled=False)
    assert not usable(torch.device("cuda"), "fp32", compiled=True)
    learner = Learner(build_config("cpu", [], "SDA"))
    assert learner.graphed == [] and learner.encoder_pass is learner.model.encoder
    assert learner.snapshot.passes == learner.snapshot.imagine


TINY = ["model.channels=8,8,8,8", "model.hidden=32", "model.latents=6", "model.k_max=4", "dream.batch_size=8",
        "train.batch_size=16", "inference.patience=1", "inference.cooldown=0", "dream.snapshot_every=3"]


@cuda
@pytest.mark.cuda
def test_a_replayed_pass_has_the_eager_gradients_after_a_second_pass():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2)).cuda()
    eager = [p.detach().clone() for p in net.parameters()]
    passes = GraphedPasses(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):  # parameters change between replays; the graph must read them in place
        passes.new_step()
        x, other = torch.randn(2, 8, 1, 4, 4, device="cuda")
        first = passes(x)
        passes(other)  # eq. 6's second candidate: must not overwrite first's activations
        loss = first.pow(2).sum()
        opt.zero_grad()
        loss.backward()
        ref = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2)).cuda()
        with torch.no_grad():
            for p, e in zip(ref.parameters(), eager):
                p.copy_(e)
        ref(x).pow(2).sum().backward()
        for p, r in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-5)
        opt.step()
        eager = [p.detach().clone() for p in net.parameters()]
    assert len(passes.graphs) == 1


@cuda
@pytest.mark.cuda
def test_sda_training_with_graphs_matches_eager_on_the_gpu():
    g = torch.Generator().manual_seed(0)
    xs = [(torch.rand(16, 1, 64, 64, generator=g) < 0.1).float().cuda() for _ in range(12)]
    runs = []
    for graphs in ("true", "false"):
        learner = Learner(build_config("cpu", TINY + ["train.deterministic=true", f"train.cuda_graphs={graphs}"],
                                       "SDA"), "cuda")
        runs.append([learner.training_step(x) for x in xs])
    assert runs[0][0] is not runs[1][0] and len(runs[0]) == 12
    for a, b in zip(*runs):
        assert a.decision.env == b.decision.env and a.decision.verdict == b.decision.verdict
        assert a.losses["total"] == pytest.approx(b.losses["total"], rel=1e-4)


@cuda
@pytest.mark.cuda
def test_replayed_dreams_are_the_eager_dreams_after_a_sync():
    cfg = build_config("cpu", TINY, "SDA")
    torch.manual_seed(0)
    model, other = VAE(cfg.model).cuda(), VAE(cfg.model).cuda()
    snapshot = Snapshot(model)
    graphed = GraphedNoGrad(snapshot.imagine)
    for source in (model, other, model):  # re-synced weights are read in place by the replay
        snapshot.sync(source)
        z, env = torch.randn(8, cfg.model.latents, device="cuda"), torch.randint(3, (8,), device="cuda")
        want = snapshot.imagine(z, env)
        got = graphed(z, env)
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(graphed.graphs) == 1
