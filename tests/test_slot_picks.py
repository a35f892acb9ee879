"""`vase eval --classifier`: q_psi's mean probabilities, the slot it names per batch, and eq. 6's
tests of each batch against every slot."""
import math
from types import SimpleNamespace

import pytest
import torch
from test_learner import learner, squares

from vase.slot_picks import SlotPicks, picks_of, slot_picks, slot_picks_text, slot_tests, slot_tests_text


def test_mean_q_and_the_slot_named_for_each_whole_batch():
    # A stand-in q_psi over 3 slots, 2 allocated: a feature of +1 gives logits (0, log 3, 0), one
    # of -1 gives (log 3, 0, 0). So q = (1/5, 3/5, 1/5) or (3/5, 1/5, 1/5). Batches of 4: the first
    # holds three +1, the second one +1; the last 2 images make no whole batch and name nothing.
    def classifier(h):
        return torch.stack([(h[:, 0] < 0) * math.log(3), (h[:, 0] > 0) * math.log(3), torch.zeros(len(h))], 1)

    signs = [1, 1, 1, -1, 1, -1, -1, -1, 1, 1]
    hidden = torch.tensor(signs, dtype=torch.float32)[:, None]
    row = picks_of(classifier, hidden, n_envs=2, batch_size=4, source="mnist")
    plus = signs.count(1) / len(signs)
    assert row.mean_q == pytest.approx([plus / 5 + (1 - plus) * 3 / 5, plus * 3 / 5 + (1 - plus) / 5], abs=1e-4)
    assert row.named == {1: 1, 0: 1}
    assert row.as_dict() == {"source": "mnist", "mean_q": row.mean_q, "named": {0: 1, 1: 1}}


def test_text_lists_each_source_with_its_probabilities_and_named_batches():
    rows = [SlotPicks("mnist", [0.25, 0.75], {1: 8}), SlotPicks("dreams of slot 0", [0.6, 0.4], {0: 5, 1: 3})]
    text = slot_picks_text(rows, step=300, current=1)
    assert "step 300 (2 slots, the current one 1)" in text
    assert "  mnist" in text and "0.25    0.75   slot 1 x8" in text
    assert "0.60    0.40   slot 0 x5, slot 1 x3" in text


def _two_slots(ablation, named, extra=()):
    """A tiny untrained learner with slots 0 and 1 allocated, q_psi fixed to name `named`, and 3 batches
    of held-out squares of one environment."""
    lrn = learner(ablation, extra)
    lrn.inference.n_envs = 2
    with torch.no_grad():
        lrn.classifier.linear.weight.zero_()
        lrn.classifier.linear.bias.copy_(torch.tensor([0.0, 0.0, -9.0, -9.0]))
        lrn.classifier.linear.bias[named] = 5.0
    x = squares(3 * 16 + 5, torch.Generator().manual_seed(0), 0)  # 5 left over: no whole batch
    return lrn, SimpleNamespace(learner=lrn, test_envs=[SimpleNamespace(name="squares")], held_out=[x])


def test_eq6s_tests_against_every_slot_on_a_hand_set_reconstruction_threshold():
    # A off: only the reconstruction test. Slot 0's L_s is huge, slot 1's is 0, and an untrained
    # decoder costs thousands of nats on 64x64 squares, far above slot 1's margin.
    for named, taken in ((1, {"new": 3}), (0, {"slot 0": 3})):
        lrn, evaluator = _two_slots("SD", named)
        lrn.inference.slots[0].error = torch.tensor(1e9)
        lrn.inference.slots[1].error = torch.tensor(0.0)
        (row,) = slot_tests(evaluator)
        assert row.named == [named] * 3
        assert row.passed() == [3, 0]
        assert row.failed_reconstruction == [0, 3] and row.failed_mask == [0, 0]
        assert row.error[1] > row.threshold[1] == lrn.cfg.inference.error_margin
        assert row.taken() == taken


def test_eq6s_mask_test_against_every_slot_on_hand_set_masks():
    # A on, eq. 6 as written (the mask test reads the latents either uses), both thresholds huge.
    # Slot 1 masks every latent and has used them all; slot 0 keeps every latent. The untrained
    # encoder's batches are typical (alpha below lambda_low somewhere, above lambda_high nowhere), so
    # a(x) turns on a latent slot 1 has off, and agrees with slot 0.
    lrn, evaluator = _two_slots("SDA", named=1, extra=["inference.rules=paper"])
    for slot in (0, 1):
        lrn.inference.slots[slot].error = torch.tensor(1e9)
    lrn.inference.slots[1].mask = torch.zeros(6)
    lrn.inference.slots[1].usage = torch.full((6,), 10.0)
    with torch.no_grad():
        alphas = [lrn.encode(x, None).alpha for x in evaluator.held_out[0][:48].split(16)]
    cfg = lrn.cfg.mask
    assert all((a < cfg.lambda_low).any() and (a <= cfg.lambda_high).all() for a in alphas)
    (row,) = slot_tests(evaluator)
    assert row.failed_mask == [0, 3] and row.failed_reconstruction == [0, 0]
    assert row.passed() == [3, 0] and row.taken() == {"new": 3}
    assert "slot 1" in slot_tests_text([row]) and "0/3 r0 m3" in slot_tests_text([row])


def test_each_source_is_read_under_its_own_name_in_both_readings():
    # Two sources of the same images, one of them reversed: the same batches in another order give
    # the same counts, and each row carries its source's name (as `--also` adds environments).
    lrn, evaluator = _two_slots("SD", named=1)
    x = evaluator.held_out[0]
    sources = [("squares", x), ("outside", x.flip(0))]
    picks = slot_picks(evaluator, sources, dreams_per_slot=16)
    assert [row.source for row in picks] == ["squares", "outside", "dreams of slot 0", "dreams of slot 1"]
    assert picks[0].named == picks[1].named == {1: 3}
    tests = slot_tests(evaluator, sources)
    assert [row.environment for row in tests] == ["squares", "outside"]
    assert tests[0].named == tests[1].named == [1, 1, 1]
