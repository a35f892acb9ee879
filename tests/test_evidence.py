"""Eq. 6's evidence of a batch comes to the host in one read (`vase.evidence`), and a training step
reads the host once for eq. 6 and once for its logs."""
import math
import warnings
from contextlib import ExitStack, contextmanager
from unittest.mock import patch

import pytest
import torch
from test_learner import TINY, learner, squares

from vase.config import Config, InferenceConfig, MaskConfig, build_config
from vase.evidence import Evidence
from vase.inference import build
from vase.learner import Learner

N = 4
# Every way a tensor's value reaches Python; on a GPU each one waits for the device.
READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu", "nonzero")


def counting(function, count):
    """`function`, adding one to count[0] at each call."""
    def counted(*args, **kwargs):
        count[0] += 1
        return function(*args, **kwargs)
    return counted


@contextmanager
def counting_reads():
    """Counts the host reads of tensor values while active (a one-element list)."""
    count = [0]
    with ExitStack() as stack:
        for name in READS:
            stack.enter_context(patch.object(torch.Tensor, name, counting(getattr(torch.Tensor, name), count)))
        yield count


def two_slots():
    """Eq. 6 as printed with slots 0 and 1 allocated, current 1; slot 0 masks latent 3."""
    cfg = Config(inference=InferenceConfig(rules="paper", kappa=1.5, patience=1, used_kl=0.1),
                 mask=MaskConfig(lambda_low=0.5, lambda_high=1.0, ema=0.0))
    cfg.model.k_max, cfg.model.latents = 3, N
    inf = build(cfg)
    inf.n_envs, inf.current = 2, 1
    for s, error in ((0, 40.0), (1, 90.0)):
        slot = inf.slots[s]
        slot.record(torch.tensor(error), torch.tensor([1.0, 1.0, 0.0, 0.0]), 0.0)
        slot.initialised = True
    inf.slots[0].mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    return inf


def test_evidence_reads_s_hat_with_the_current_slot_and_another_slot_once_more():
    inf = two_slots()
    alpha = torch.tensor([0.0, 1.5, 0.0, 0.2])  # latent 1 atypical: a(x) switches off a latent both slots use
    usage = torch.tensor([1.0, 0.0, 0.0, 0.3])  # latent 3 informative on the batch, off in slot 0
    errors = {0: torch.tensor(70.25), 1: torch.tensor(120.5)}
    decoded = []

    def error_under(s):
        decoded.append(s)
        return errors[s]

    evidence = Evidence(inf, torch.tensor([0.7, 0.2, 0.1]), alpha, usage, error_under)
    with counting_reads() as reads:
        assert evidence.predicted() == 0
        current = evidence.tests(1)
        assert reads[0] == 1 and decoded == [1]
        named = evidence.tests(0)
        assert reads[0] == 2 and decoded == [1, 0]
        assert evidence.tests(0) is named and evidence.predicted() == 0 and reads[0] == 2
    assert (current.error, current.slot_error, current.disagreeing) == (120.5, 90.0, (1,))
    # slot 0: latent 1 lost as in slot 1, and latent 3, off in slot 0, typical and used on the batch.
    assert (named.error, named.slot_error, named.disagreeing) == (70.25, 40.0, (1, 3))
    assert inf.failures(named) == (["reconstruction", "mask"], [1, 3])  # 70.25 > 1.5 * 40
    assert inf.failures(current) == (["mask"], [1])  # 120.5 <= 1.5 * 90


def test_evidence_keeps_an_error_given_as_a_float_and_reads_float32_exactly():
    inf = two_slots()
    inf.slots[1].error = torch.tensor(0.1)  # float32: not the double 0.1
    evidence = Evidence(inf, torch.tensor([0.1, 0.9, 0.0]), torch.zeros(N), torch.zeros(N), lambda s: 0.1)
    tests = evidence.tests(1)
    assert tests.error == 0.1 and tests.slot_error == float(torch.tensor(0.1)) != 0.1
    assert evidence.predicted() == 1


@contextmanager
def host_traffic_per_step(lrn):
    """Per training step of `lrn`: (host reads, the batch was judged against a slot other than the
    one current before the step, the verdict, tensors made from host data, the environments it
    dreamt of). A batch left unjudged has no error."""
    counts = []
    step = lrn.training_step

    def counted(x):
        before, dreamt = lrn.inference.current, lrn.inference.dream_environments()
        made = [0]
        with counting_reads() as reads, patch.object(torch, "tensor", counting(torch.tensor, made)):
            out = step(x)
        judged = not math.isnan(out.decision.error)
        counts.append((reads[0], judged and out.decision.predicted != before, out.decision.verdict, made[0], dreamt))
        return out

    lrn.training_step = counted
    yield counts


def test_a_training_step_reads_the_host_once_for_eq_6_and_once_for_its_logs():
    """kappa 1/2 fails every judged batch, so slots are allocated every few steps and batches are
    judged against slots other than the current one. On an accelerator each read and each upload
    waits for the device."""
    torch.manual_seed(0)
    lrn = learner("SDA", ["inference.kappa=0.5", "inference.cooldown=2", "inference.patience=2"])
    gen = torch.Generator().manual_seed(0)
    with host_traffic_per_step(lrn) as counts:
        for i in range(12):
            lrn.training_step(squares(16, gen, i // 6))
    assert lrn.inference.n_envs >= 3
    assert counts[0][:4] == (1, False, "first", 0)  # nothing to judge or dream: the logs' read
    later = counts[1:]
    assert all(reads == (3 if elsewhere else 2) for reads, elsewhere, *_ in later)
    assert any(elsewhere for _, elsewhere, *_ in later) and any(v == "new" for _, _, v, *_ in later)
    assert uploads_follow_the_dreamt_environments(counts) >= 2


def uploads_follow_the_dreamt_environments(counts) -> int:
    """Asserts that the environments dreamt of are uploaded once each time they change, never per
    step, and that nothing else is; returns the number of changes."""
    dreamt = [envs for *_, envs in counts]
    changed = [bool(now) and now != before for before, now in zip([[]] + dreamt, dreamt)]
    assert [made for *_, made, _ in counts] == [int(c) for c in changed]
    return sum(changed)


@pytest.mark.parametrize("ablation", ["-", "DA"])
def test_without_s_a_step_reads_the_host_for_its_logs_only(ablation):
    lrn = learner(ablation, ["dream.snapshot_every=2"])
    gen = torch.Generator().manual_seed(0)
    with host_traffic_per_step(lrn) as counts:
        for i in range(4):
            lrn.training_step(squares(16, gen, 0))
    assert [reads for reads, *_ in counts] == [1] * 4
    if "D" in ablation:  # environment 0, dreamt of from the second step on
        assert uploads_follow_the_dreamt_environments(counts) == 1
    else:
        assert [made for *_, made, _ in counts] == [0] * 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.cuda
def test_on_cuda_a_step_on_the_current_slot_synchronises_twice():
    """What the CPU tests count, as CUDA counts it: after the graphs are captured, a step whose
    batch q_psi sends to the current slot waits for the GPU twice, for eq. 6 and for the logs."""
    torch.manual_seed(0)
    lrn = Learner(build_config("cpu", TINY + ["inference.cooldown=0", "dream.snapshot_every=4"], "SDA"),
                  device="cuda")
    gen = torch.Generator().manual_seed(0)
    batches = [squares(16, gen, 0).cuda() for _ in range(8)]
    for x in batches[:4]:  # capture the graphs
        lrn.training_step(x)
    syncs = []
    for x in batches[4:]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = lrn.training_step(x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert out.decision.verdict == "same"
        syncs.append(sum("synchroniz" in str(w.message) for w in caught))
    assert syncs == [2] * 4
