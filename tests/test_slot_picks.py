"""`vase eval --classifier`: q_psi's mean probabilities and the slot it names per batch."""
import math

import pytest
import torch

from vase.slot_picks import SlotPicks, picks_of, slot_picks_text


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
