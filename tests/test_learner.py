"""The learner's step: switches, stop-gradients, and environment inference on a synthetic stream."""
import copy

import pytest
import torch

from vase.config import build_config
from vase.learner import Learner
from vase.masking import atypicality
from vase.objective import prior_where_masked
from vase.rules import RULE_SETS, VERDICT_RULES

TINY = ["model.channels=8,8,8,8", "model.hidden=32", "model.latents=6", "model.k_max=4", "dream.batch_size=8",
        "train.batch_size=16"]


def squares(n, gen, half):
    """Squares of side 12 at random positions in the left (half=0) or right (half=1) half."""
    x = torch.zeros(n, 1, 64, 64)
    for i in range(n):
        r = int(torch.randint(0, 52, (1,), generator=gen))
        c = int(torch.randint(0, 20, (1,), generator=gen)) + 32 * half
        x[i, 0, r:r + 12, c:c + 12] = 1.0
    return x


def learner(ablation="SDA", extra=()):
    return Learner(build_config("cpu", TINY + list(extra), ablation))


def test_classifier_does_not_move_encoder_weights():
    lrn = learner()
    x = squares(16, torch.Generator().manual_seed(0), 0)
    post = lrn.model.encoder(x)
    before = [p.detach().clone() for p in lrn.model.encoder.parameters()]
    lrn.inference.train_classifier(lrn.classifier(post.hidden), 0, 16, None)
    assert all(torch.equal(a, b) for a, b in zip(before, lrn.model.encoder.parameters()))
    assert all(p.grad is None for p in lrn.model.encoder.parameters())


@pytest.mark.parametrize("ablation", ["-", "S", "D", "A", "SA", "DA", "SD", "SDA", "SD-[41]"])
def test_switches_turn_mechanisms_off(ablation):
    lrn = learner(ablation, ["inference.patience=1", "inference.cooldown=0", "dream.snapshot_every=1"])
    gen = torch.Generator().manual_seed(0)
    outs = [lrn.training_step(squares(16, gen, i // 4 % 2)) for i in range(8)]
    assert lrn.cfg.ablation() == ablation
    if "A" not in ablation:
        assert all(torch.equal(o.mask, torch.ones(6)) for o in outs)
    if "S" not in ablation:
        assert lrn.inference.n_envs == 1 and all(o.decision.env == 0 for o in outs)
        assert all("classifier" not in o.losses for o in outs)
    if "D" not in ablation:
        assert all("dream_encoder" not in o.losses for o in outs)
    else:
        # With S off the dreams come from environment 0 itself; with S on only from past ones.
        dreamed = [o for o in outs if "dream_encoder" in o.losses]
        assert dreamed if "S" not in ablation else all(lrn.inference.n_envs > 1 for _ in dreamed)
        assert all(("dream_decoder" in o.losses) == (ablation != "SD-[41]") for o in dreamed)


def test_identical_snapshot_gives_zero_dream_loss_in_the_step():
    lrn = learner("D")
    x = squares(16, torch.Generator().manual_seed(0), 0)
    lrn.training_step(x)  # allocates environment 0
    lrn.snapshot.sync(lrn.model)
    out = lrn.training_step(x)  # dreams of env 0 (S off) from a snapshot identical to the model
    assert out.losses["dream_encoder"] == pytest.approx(0.0, abs=1e-6)
    assert out.losses["dream_decoder"] == pytest.approx(0.0, abs=1e-3)
    out = lrn.training_step(x)  # one update later the model has moved away from the snapshot
    assert out.losses["dream_encoder"] > 0.0 and out.losses["dream_decoder"] > 0.0


@pytest.mark.parametrize("decoder_term", [True, False])
def test_the_step_loss_is_eq8_with_the_dream_weights(decoder_term):
    # L = L_MDL + w_enc * W2 + w_dec * KL(Bern || Bern) (eq. 7-8); SD-[41] drops the decoder term.
    # With S off the dreams come from environment 0 itself, so the second step already dreams.
    lrn = learner("D", ["dream.encoder_weight=3", "dream.decoder_weight=10", f"dream.decoder_term={decoder_term}"])
    gen = torch.Generator().manual_seed(0)
    lrn.training_step(squares(16, gen, 0))
    losses = lrn.training_step(squares(16, gen, 1)).losses  # the model has moved from the snapshot
    decoder = losses.get("dream_decoder", 0.0)
    assert losses["dream_encoder"] > 0 and (decoder > 0) == decoder_term
    assert losses["total"] == pytest.approx(losses["mdl"] + 3 * losses["dream_encoder"] + 10 * decoder, rel=1e-5)


def test_masked_latents_get_no_gradient_in_the_step():
    lrn = learner("A", ["mask.lambda_low=0.01", "mask.lambda_high=0.02"])
    x = squares(16, torch.Generator().manual_seed(0), 0)
    lrn.training_step(x)
    mask = lrn.mask(0).clone()
    lrn.slots[0].mask = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0])  # force two latents off
    lrn.inference.mask_cfg.lambda_high = 1e9  # and keep them off during the step
    post = lrn.model.encoder(x)
    out = lrn.training_step(x)
    head = lrn.model.encoder.head
    # Rows of the head that produce mu and logvar of masked latents 1 and 3 receive no gradient.
    g = head.weight.grad
    assert torch.all(g[[1, 3, 6 + 1, 6 + 3]] == 0)
    assert torch.any(g[[0, 2]] != 0)
    assert out.mask.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    del mask, post


@pytest.mark.parametrize("ablation", ["A", "SA"])
def test_a_masked_latent_whose_variance_overflows_leaves_the_step_finite(ablation):
    """The "A" row on moving MNIST masked every latent; the masked outputs drifted until exp(log
    sigma^2) overflowed at step 4,053 and the run stopped on a NaN KL. Masked latents are the prior
    (eq. 2): their values must reach neither the loss, nor the gradients, nor the usage record."""
    lrn = learner(ablation, ["mask.lambda_high=1e9"])  # nothing gets masked by the step itself
    x = squares(16, torch.Generator().manual_seed(0), 0)
    lrn.training_step(x)
    used_before = float(lrn.slots[0].usage[1])
    lrn.slots[0].mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    head, n = lrn.model.encoder.head, lrn.cfg.model.latents
    with torch.no_grad():
        head.bias[n + 1].fill_(200.0)  # latent 1's log sigma^2: exp overflows in float32
    assert torch.isinf(lrn.model.encoder(x).logvar[:, 1].exp()).all()
    out = lrn.training_step(x)  # raised NumericalError ("loss term 'kl' is nan") before the fix
    assert all(torch.isfinite(torch.tensor(v)) for v in out.losses.values())
    assert all(torch.isfinite(p.grad).all() for p in lrn.model.parameters() if p.grad is not None)
    # The masked latent's usage only decays (this batch adds 0 for it): no inf or NaN gets in.
    assert torch.isfinite(lrn.slots.stack("usage")).all() and float(lrn.slots[0].usage[1]) <= used_before


@pytest.mark.parametrize("ablation", ["SDA", "A"])
def test_usage_records_information_not_kl(ablation):
    """Latent usage (eq. 5-6 bookkeeping) counts information: a latent whose mean is shifted by the
    same amount for every image costs KL but is not 'used'."""
    lrn = learner(ablation)
    head, n = lrn.model.encoder.head, lrn.cfg.model.latents
    with torch.no_grad():  # latent 0: mu = 3 and logvar = 0 for every image
        head.weight[0].zero_(), head.weight[n].zero_()
        head.bias[0].fill_(3.0), head.bias[n].zero_()
    out = lrn.training_step(squares(16, torch.Generator().manual_seed(0), 0))
    assert out.decision.verdict == "first"
    assert float(out.kl_per_latent[0]) == pytest.approx(4.5, abs=1e-4)
    assert float(lrn.slots[0].usage[0]) < lrn.cfg.inference.used_kl
    # The other latents' usage is their information: KL minus atypicality.
    expected = (out.kl_per_latent - out.alpha).clamp_min(0) * out.mask
    assert torch.allclose(lrn.slots[0].usage, expected)


def test_a_mask_change_in_the_step_keeps_the_settling_period_and_l_s():
    lrn = learner("SDA", ["inference.cooldown=3", "mask.ema=0"])
    x = squares(16, torch.Generator().manual_seed(0), 0)
    for _ in range(5):
        lrn.training_step(x)
    settling = lrn.inference.rule("settling")
    assert settling.since == 0  # the allocation
    # Make every latent maskable and atypical: the step's mask update switches latents off.
    lrn.inference.maskable = lambda env: torch.ones(6, dtype=torch.bool)
    lrn.inference.mask_cfg.lambda_low, lrn.inference.mask_cfg.lambda_high = -2.0, -1.0
    out = lrn.training_step(x)
    assert torch.equal(out.mask, torch.ones(6)) and not torch.equal(lrn.mask(0), torch.ones(6))
    # L_s goes on from its batches under the old mask (eq. 6 names no re-learning), and no period opens.
    assert settling.since == 0 and lrn.slots[0].recorded


@pytest.mark.slow
def test_synthetic_two_environment_stream_gets_exactly_two_environments():
    """Eq. 6 tests only the slot q_psi names, so q_psi must name the new slot by the end of its
    cooldown. At the default classifier_lr it takes this toy 50-65 steps, as long as the cooldown,
    and the verdict would turn on that race; at 0.01 it takes 16-18, with or without the pending
    batches held out."""
    torch.manual_seed(0)
    lrn = learner("SDA", ["inference.patience=5", "inference.cooldown=50", "objective.capacity_ramp_steps=200",
                          "train.lr=1e-3", "inference.classifier_lr=0.01"])
    gen = torch.Generator().manual_seed(0)
    steps = 300
    assigned = []
    for i in range(2 * steps):
        out = lrn.training_step(squares(16, gen, i // steps))
        assigned.append(out.decision.env)
    assert lrn.inference.n_envs == 2
    assert set(assigned[:steps]) == {0}
    assert assigned[-1] == 1 and assigned.index(1) - steps < 50


def test_without_s_a_does_not_mask_latents_while_they_are_learnt():
    """The "A" row: one slot, and thresholds so low that every latent leaving the prior is atypical.
    Literal eq. 5 masked them within a few steps; now only latents the slot has learnt (used while
    settled) may be masked, and a learnt latent that turns atypical is."""
    lrn = learner("A", ["mask.lambda_low=0.001", "mask.lambda_high=0.002", "mask.ema=0"])
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        out = lrn.training_step(squares(16, gen, 0))
        assert out.mask.tolist() == [1.0] * 6
    assert float(out.alpha.max()) > 0.002  # so eq. 5 alone would have masked at least one latent
    assert not lrn.slots[0].learnt.any()
    # Declare latent 2 learnt: the next atypical batch masks it, and nothing else.
    lrn.slots[0].learnt[2] = True
    lrn.slots[0].alpha[2] = 1.0
    lrn.training_step(squares(16, gen, 1))
    assert lrn.mask(0).tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("ramp, without", [(0, False), (100, False), (100, True)])
def test_a_new_environment_starts_its_capacity_from_the_kl_it_carries(ramp, without):
    """The rule own_capacity_ramp (objective.new_env_ramp_steps): a slot allocated when C(t) is at
    C_max starts its target from its own KL and climbs C_max / ramp per step; with 0, or the rule
    left out, it must meet C(t) at once, as eq. 3 reads. The first environment follows C(t)."""
    settings = ["objective.capacity_ramp_steps=10", "objective.capacity_max=25",
                f"objective.new_env_ramp_steps={ramp}"] + (["inference.without=own_capacity_ramp"] if without else [])
    lrn = learner("SDA", settings)
    x = squares(16, torch.Generator().manual_seed(0), 0)
    for _ in range(12):  # C(t) reaches C_max at step 10
        out = lrn.training_step(x)
        assert out.extra["capacity"] == pytest.approx(min(25.0, 2.5 * out.step))
    infer = lrn.inference.infer
    lrn.inference.infer = lambda t, *args: lrn.inference.allocate(t, 1, "new", ["reconstruction"])
    out = lrn.training_step(x)  # step 12: a second environment
    lrn.inference.infer = infer
    assert out.decision.env == 1 and lrn.capacity_starts[1][0] == 12
    start_kl = lrn.capacity_starts[1][1]
    assert start_kl == pytest.approx(out.losses["kl"], rel=1e-6) and start_kl < 20.0
    ramps = ramp and not without
    assert out.extra["capacity"] == (pytest.approx(start_kl) if ramps else 25.0)
    nxt = lrn.training_step(x)
    assert nxt.decision.env == 1
    assert nxt.extra["capacity"] == (pytest.approx(start_kl + 0.25) if ramps else 25.0)
    # The ramp survives a checkpoint: a restored learner computes the same target.
    restored = learner("SDA", settings)
    restored.load_state_dict(lrn.state_dict())
    assert restored.capacity_starts == lrn.capacity_starts


def test_the_fresh_latent_penalty_reads_only_a_new_environments_fresh_latents():
    """objective.fresh_aggregate_weight: the atypicality of the unmasked latents no other
    environment uses, in an environment allocated after the first; nothing in the first, and no push
    on a latent another environment uses or on a masked one."""
    lrn = learner("SDA", ["objective.fresh_aggregate_weight=1"])
    post = lrn.model.encoder(squares(16, torch.Generator().manual_seed(0), 0))
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    maskable = torch.tensor([True, True, False, False, False, False])  # latents 0 and 1: another slot's
    assert lrn.fresh_shift(post, mask, maskable, 0) is None  # the first environment: C(t) alone
    fresh = lrn.fresh_shift(post, mask, maskable, 1)
    alpha = atypicality(*prior_where_masked(post.mu, post.logvar, mask))
    assert fresh.item() == pytest.approx(alpha[[2, 4, 5]].sum().item(), rel=1e-6)
    fresh.backward()
    g = lrn.model.encoder.head.weight.grad  # rows: mu of latents 0-5, then log sigma^2 of 0-5
    assert torch.all(g[[0, 1, 3, 6, 7, 9]] == 0) and all(torch.any(g[r] != 0) for r in (2, 4, 5))


def test_the_step_adds_the_fresh_latent_penalty_in_a_new_environment():
    """Two learners in the same state, fresh weight 0 and 1: right after a second environment is
    allocated, the step's eq. 3 differs by exactly gamma times the fresh latents' atypicality."""
    x = squares(16, torch.Generator().manual_seed(0), 0)
    mdl, penalty = [], None
    for weight in (0, 1):
        lrn = learner("SDA", [f"objective.fresh_aggregate_weight={weight}", "dream.enabled=false"])
        for _ in range(3):
            lrn.training_step(x)
        lrn.slots[0].usage = torch.tensor([2.0, 0.0, 2.0, 0.0, 0.0, 0.0])  # slot 0 uses latents 0 and 2
        infer = lrn.inference.infer
        lrn.inference.infer = lambda t, *args: lrn.inference.allocate(t, 1, "new", ["reconstruction"])
        with torch.no_grad():
            post = lrn.model.encoder(x)
        out = lrn.training_step(x)
        lrn.inference.infer = infer
        assert out.decision.env == 1
        alpha = atypicality(*prior_where_masked(post.mu, post.logvar, out.mask))
        penalty = float((alpha * out.mask * torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 1.0])).sum())
        mdl.append(out.losses["mdl"])
    assert penalty > 0 and mdl[1] - mdl[0] == pytest.approx(100.0 * penalty, rel=1e-4)


def test_reconstruction_error_is_the_bernoulli_nll_of_the_mean_decoding():
    lrn = learner()
    x = squares(16, torch.Generator().manual_seed(0), 0)
    p = lrn.reconstruct_mean(x, 0).clamp(1e-6, 1 - 1e-6)
    by_hand = -(x * p.log() + (1 - x) * (1 - p).log()).sum((1, 2, 3)).mean()
    assert lrn.reconstruction_error(x, 0) == pytest.approx(float(by_hand), rel=1e-5)


def test_cross_domain_panel_decodes_the_same_latents_under_every_slot():
    from vase.visualize import cross_domain_panel

    lrn = learner()
    lrn.slots[1].mask[2] = 0.0  # slot 1 masks latent 2: fed its prior mean, 0, in the mean decoding
    x = squares(3, torch.Generator().manual_seed(0), 0)
    panel = cross_domain_panel(lrn, x, 2)
    assert panel.shape == (3, 3, 1, 64, 64)
    assert torch.equal(panel[:, 0], x)
    for s in range(2):
        assert torch.equal(panel[:, 1 + s], lrn.reconstruct_mean(x, s))
    assert not torch.allclose(panel[:, 1], panel[:, 2])  # the slot's one-hot and mask change the decoding
    with torch.no_grad():
        mu = lrn.model.encoder(x).mu
        mu[:, 2] = 0.0
        unmasked = torch.sigmoid(lrn.model.decoder(mu, torch.ones(3, dtype=torch.long)))
    torch.testing.assert_close(panel[:, 2], unmasked)


def _with_a_past_environment(extra=()):
    """A learner training environment 1 after environment 0, which used latent 0 (and 1 did not)."""
    lrn = learner("SDA", ["inference.patience=1", "inference.cooldown=0", *extra])
    x = squares(16, torch.Generator().manual_seed(0), 0)
    lrn.training_step(x)
    lrn.inference.n_envs, lrn.inference.current = 2, 1
    lrn.slots[0].usage = torch.tensor([2.0, 0, 0, 0, 0, 0])
    lrn.slots[0].recorded = lrn.slots[1].recorded = True
    return lrn, x


def test_imagination_is_off_by_default_and_reads_no_random_numbers():
    lrn, x = _with_a_past_environment()
    assert lrn.transferable_latents(1) is None
    assert "imagination" not in lrn.training_step(x).losses


def test_imagination_redraws_exactly_the_transferable_latents_and_trains_only_the_encoder():
    lrn, x = _with_a_past_environment(["imagination.enabled=true", "imagination.batch_size=4"])
    assert lrn.transferable_latents(1).tolist() == [True, False, False, False, False, False]
    seen = []
    decoder_forward = lrn.model.decoder.forward
    lrn.model.decoder.forward = lambda z, env: seen.append(z.detach().clone()) or decoder_forward(z, env)
    enc = lrn.encode(x, None)
    term = lrn.imagination_term(enc, 1)["imagination"]
    codes = seen[-1]
    assert codes.shape == (4, 6)
    assert torch.equal(codes[:, 1:], (enc.real.mu[:4] * lrn.mask(1))[:, 1:].detach())
    assert not torch.allclose(codes[:, 0], enc.real.mu[:4, 0].detach())  # redrawn from the prior
    lrn.model.zero_grad(set_to_none=True)
    term.backward()
    assert all(p.grad is None for p in lrn.model.decoder.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in lrn.model.encoder.parameters())


def _split_layout(state: dict) -> dict:
    """A learner's state dict in the split layout `vase.slots.from_split_layout` reads: the masks in
    their own entry ("masks"), and L_s, usage and the recorded flags stacked in the inference's."""
    old, inference = dict(state), dict(state["inference"])
    slots = inference.pop("slots")
    old["masks"] = {"masks": slots["mask"], "alpha": slots["alpha"], "initialised": slots["initialised"],
                    "learnt": slots["learnt"]}
    inference.update(errors=slots["error"], usage=slots["usage"], recorded=slots["recorded"])
    old["inference"] = inference
    return old


def same_state(a, b) -> bool:
    """Equal nested state: the same keys, bit-identical tensors, equal plain values."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


CHECKPOINTED = ["inference.patience=1", "inference.cooldown=3"]


def state_after_eight_steps():
    """A learner's state after 8 steps of alternating squares, and the 2 batches that follow."""
    lrn = learner("SDA", CHECKPOINTED)
    gen = torch.Generator().manual_seed(0)
    xs = [squares(16, gen, i // 4 % 2) for i in range(10)]
    for x in xs[:8]:
        lrn.training_step(x)
    return copy.deepcopy(lrn.state_dict()), xs[8:]


def test_a_checkpoint_with_the_masks_apart_from_the_slots_resumes_bit_for_bit():
    state, rest = state_after_eight_steps()
    assert "masks" not in state
    resumed, migrated = learner("SDA", CHECKPOINTED), learner("SDA", CHECKPOINTED)
    resumed.load_state_dict(copy.deepcopy(state))
    migrated.load_state_dict(_split_layout(copy.deepcopy(state)))
    assert same_state(resumed.inference.state_dict(), migrated.inference.state_dict())
    assert [resumed.training_step(x).losses for x in rest] == [migrated.training_step(x).losses for x in rest]


def test_a_checkpoint_with_a_probation_visit_resumes_without_it():
    """A checkpoint that holds the state of `probation`, a rule vase does not have (docs/method.md,
    rules beyond eq. 6), resumes as the run of today's set from that state."""
    state, rest = state_after_eight_steps()
    with_visit = copy.deepcopy(state)
    slot = {k: v.clone() for k, v in state["inference"]["slots"].items()}
    with_visit["inference"]["probation"] = {"env": 0, "since": 7, "slot": slot}
    resumed, visited = learner("SDA", CHECKPOINTED), learner("SDA", CHECKPOINTED)
    resumed.load_state_dict(state)
    visited.load_state_dict(with_visit)
    assert [resumed.training_step(x).losses for x in rest] == [visited.training_step(x).losses for x in rest]


def test_counting_counterfactuals_trains_the_same_bits():
    """inference.counterfactuals decodes the batch under more slots to judge it without each rule;
    the step, its decisions and every state tensor stay what they are without it."""
    gen_state = torch.Generator().manual_seed(0).get_state()
    runs = []
    for on in (False, True):
        torch.manual_seed(0)
        # kappa 1/2: every judged batch fails, so slots are allocated (and dreamt) every few steps.
        lrn = learner("SDA", [f"inference.counterfactuals={str(on).lower()}", "inference.kappa=0.5",
                              "inference.cooldown=2", "inference.patience=2"])
        gen = torch.Generator()
        gen.set_state(gen_state)
        outs = [lrn.training_step(squares(16, gen, i // 6)) for i in range(12)]
        runs.append(([(o.decision.as_dict(), o.losses) for o in outs], lrn.state_dict()))
    (steps_off, state_off), (steps_on, state_on) = runs
    assert steps_off == steps_on
    assert state_off["inference"].pop("rule_activity") == {}
    activity = state_on["inference"].pop("rule_activity")
    assert set(activity) == set(RULE_SETS["vase"]) & set(VERDICT_RULES)
    assert state_on["inference"]["n_envs"] == 4 and activity["debouncing"]["changed"] > 0
    assert same_state(state_off, state_on)


@pytest.mark.parametrize("trains", [True, False])
def test_a_pending_batch_moves_nothing_of_the_slot_under_frozen_while_pending(trains):
    """frozen_while_pending: a batch whose "new" verdict is pending moves neither the model's nor
    q_psi's weights, nor Adam's moments, nor the current slot's statistics; left out of the set
    (`trains`), the batch moves all of them. The step's losses are logged alike."""
    from vase.inference import Decision

    lrn = learner("SDA", ["inference.without=frozen_while_pending"] if trains else [])
    x = squares(16, torch.Generator().manual_seed(0), 0)
    for _ in range(3):
        lrn.training_step(x)
    weights = [p.detach().clone() for p in [*lrn.model.parameters(), *lrn.classifier.parameters()]]
    moments = copy.deepcopy(lrn.optimizer.state_dict()["state"])
    error = lrn.slots[0].error.clone()
    infer = lrn.inference.infer
    lrn.inference.infer = lambda t, probs, *args: Decision(t, 0, 0, "pending", ["mask"])
    out = lrn.training_step(squares(16, torch.Generator().manual_seed(1), 1))
    lrn.inference.infer = infer
    now = [*lrn.model.parameters(), *lrn.classifier.parameters()]
    unchanged = all(torch.equal(a, b) for a, b in zip(weights, now))
    assert unchanged == (not trains)
    state = lrn.optimizer.state_dict()["state"]
    same_moments = all(torch.equal(moments[k]["exp_avg"], v["exp_avg"]) for k, v in state.items())
    assert same_moments == (not trains)
    assert torch.equal(lrn.slots[0].error, error) == (not trains)
    assert {"mdl", "classifier", "total"} <= set(out.losses) and out.losses["mdl"] > 0
    assert lrn.inference.learns(out.decision) == trains
    assert lrn.inference.learns(Decision(4, 0, 0, "same"))  # only a pending batch is held out


@pytest.mark.parametrize("sync", [True, False])
def test_the_snapshot_takes_the_models_weights_at_an_allocation_only_with_sync_at_allocation(sync):
    # tau is longer than the stream, so only the allocation can re-sync the snapshot.
    lrn = learner("SDA", ["dream.snapshot_every=1000", f"dream.sync_at_allocation={str(sync).lower()}"])
    x = squares(16, torch.Generator().manual_seed(0), 0)
    initial = copy.deepcopy(lrn.snapshot.state_dict())
    for _ in range(3):
        lrn.training_step(x)
    before = copy.deepcopy(lrn.model.state_dict())
    lrn.inference.infer = lambda t, *args: lrn.inference.allocate(t, 1, "new", ["reconstruction"])
    assert lrn.training_step(x).decision.allocated  # step 3: a second environment
    expected = before if sync else initial  # synced before the allocating batch's update, or never
    snap = lrn.snapshot.state_dict()
    assert all(torch.equal(snap[k], expected[k]) for k in snap)
    assert not all(torch.equal(before[k], initial[k]) for k in before)  # so the two cases differ


def test_tau_re_syncs_the_snapshot_without_sync_at_allocation():
    lrn = learner("SDA", ["dream.snapshot_every=3", "dream.sync_at_allocation=false"])
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # steps 0-2: the third ends a period of tau
        lrn.training_step(squares(16, gen, 0))
    snap, model = lrn.snapshot.state_dict(), lrn.model.state_dict()
    assert all(torch.equal(snap[k], model[k]) for k in snap)
