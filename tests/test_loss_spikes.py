"""`vase eval --spikes`: eq. 8's loss spikes, the checkpoint to replay each from, and the masked
latents close to a flip, from a run's logged steps."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_cli import fails_in_one_line

from cli import main
from vase.config import build_config
from vase.loss_spikes import FACTOR, MIN_HISTORY, WINDOW, at_risk, find_spikes, read_spikes
from vase.mask_changes import MaskChange

EVERY = 50


def steady(start: int, count: int, level: float, stage: int) -> tuple[dict[int, float], dict[int, int]]:
    """`count` logged steps from `start`, the loss alternating about `level` (median `level`)."""
    loss = {start + EVERY * i: level * (1.1 if i % 2 else 0.9) for i in range(count)}
    return loss, dict.fromkeys(loss, stage)


def test_a_loss_above_the_factor_times_the_stage_median_is_a_spike_and_below_it_is_not():
    loss, envs = steady(EVERY, 60, 100.0, 0)
    loss[EVERY * 31] = FACTOR * 100.0 * 1.02  # a spike, after 30 steps: 15 at 90 and 15 at 110
    loss[EVERY * 45] = FACTOR * 100.0 * 0.95  # high, but not a spike
    found = find_spikes(loss, envs)
    assert [step for step, _ in found] == [EVERY * 31]
    assert found[0][1] == pytest.approx(100.0)  # the median of the WINDOW steps before it


def test_a_new_stage_is_compared_with_its_own_steps_only():
    first, first_envs = steady(EVERY, 40, 100.0, 0)
    # The next stage's data cost three times the nats: its first steps are no spike, and a spike in it
    # is read against its own median once it has MIN_HISTORY steps.
    second, second_envs = steady(EVERY * 41, 40, 300.0, 1)
    second[EVERY * 41 + EVERY * (MIN_HISTORY - 1)] = 10_000.0  # too early in its stage to be judged
    second[EVERY * 41 + EVERY * (MIN_HISTORY + 5)] = FACTOR * 300.0 * 1.05
    found = find_spikes(first | second, first_envs | second_envs)
    assert [step for step, _ in found] == [EVERY * 41 + EVERY * (MIN_HISTORY + 5)]
    assert WINDOW > MIN_HISTORY


def test_the_trailing_window_follows_a_falling_loss():
    # Training from scratch: the loss falls, so no step stands above the steps before it.
    loss = {EVERY * i: 2000.0 / (1 + i) for i in range(1, 200)}
    assert find_spikes(loss, dict.fromkeys(loss, 0)) == []


# step: (slot, stage, mask); slot 1 masks z0 (alpha about 0.5: inside the band), z1 (alpha about 1.5:
# far above it) and uses z2.
LOGGED = {EVERY * i: (0, 0, (1, 1, 1)) for i in range(1, 5)} | {EVERY * i: (1, 1, (0, 0, 1)) for i in range(5, 12)}
ALPHA = {0: {step: 0.4 + 0.03 * (step // EVERY) for step in LOGGED},
         1: dict.fromkeys(LOGGED, 1.5), 2: dict.fromkeys(LOGGED, 0.1)}


def test_the_masked_latents_under_lambda_high_are_at_risk_lowest_first():
    rows = at_risk(LOGGED, ALPHA, lambda_high=1.0)
    assert [(r.slot, r.latent) for r in rows] == [(1, 0)]  # z1 is far above the band, z2 is on
    values = [ALPHA[0][EVERY * i] for i in range(5, 12)]
    assert (rows[0].low, rows[0].median, rows[0].high) == pytest.approx((min(values), values[3], max(values)))
    assert rows[0].steps == (EVERY * 5, EVERY * 11)
    assert [(r.slot, r.latent) for r in at_risk(LOGGED, ALPHA, lambda_high=2.0)] == [(1, 0), (1, 1)]


def a_run(path: Path, spike_at: int) -> Path:
    """A run directory whose TensorBoard holds LOGGED's masks, ALPHA, and a loss with one spike."""
    from torch.utils.tensorboard import SummaryWriter

    path.mkdir()
    cfg = build_config("cpu", ["data.sequence=moving_shapes_a,shapes_b"])
    (path / "config.json").write_text(cfg.to_json())
    logged = {EVERY * i: (0, 0, (1, 1, 1)) for i in range(1, 40)} | {EVERY * i: (1, 1, (0, 0, 1))
                                                                       for i in range(40, 80)}
    logged[spike_at + EVERY] = (1, 1, (1, 0, 1))  # z0 turns on in slot 1 just after the spike
    writer = SummaryWriter(str(path / "tb"))
    for step, (slot, env, mask) in logged.items():
        writer.add_scalar("inference/assigned_env", slot, step)
        writer.add_scalar("inference/true_env", env, step)
        writer.add_scalar("loss/total", 500.0 if step == spike_at else 150.0 + (step // EVERY) % 3, step)
        writer.add_scalar("loss/kl", 33.0 if step == spike_at else 25.0, step)
        writer.add_scalar("capacity/C", 25.0, step)
        for n, m in enumerate(mask):
            writer.add_scalar(f"mask/z{n:02d}", float(m), step)
            writer.add_scalar(f"atypicality/z{n:02d}", 0.5 if n == 0 else 1.5, step)
    writer.close()
    return path


def test_a_spike_names_the_checkpoint_kept_before_its_batch_and_the_mask_change_beside_it(tmp_path):
    run = a_run(tmp_path / "run", spike_at=EVERY * 60)
    # A checkpoint kept at the logged step itself was written after the spike's batch trained.
    spikes, risky, every = read_spikes(run, [1000, 2000, 2500, 3000, 3500], lambda_high=1.0)
    assert every == EVERY and len(spikes) == 1
    s = spikes[0]
    assert (s.step, s.true_env, s.slot, s.loss, s.kl, s.capacity, s.replay_from) == (3000, 1, 1, 500.0, 33.0,
                                                                                       25.0, 2500)
    assert s.median == pytest.approx(151.0)  # of the 20 steps its stage logged before it
    # z0 on in slot 1 from the next logged step, and off again at the one after
    assert s.changes == (MaskChange(1, 3000, 3050, 1, on=(0,), off=()), MaskChange(1, 3050, 3100, 1, on=(), off=(0,)))
    assert [(r.slot, r.latent) for r in risky] == [(1, 0)]
    assert read_spikes(run, [3000], lambda_high=1.0)[0][0].replay_from is None


def test_the_command_prints_the_replay_to_run_and_its_json(tmp_path):
    run = a_run(tmp_path / "run", spike_at=EVERY * 60)
    out = CliRunner().invoke(main, ["eval", str(run), "--spikes"])
    assert out.exit_code == 0, out.output
    assert "no checkpoint kept before it" in out.output  # the synthetic run keeps none
    assert "     3,000  shapes_b in slot 1: 500.0 against 151.0 (3.3 times); KL 33.0 against C(t) 25.0" in out.output
    assert "slot 1's mask 3,000 -> 3,050: on z0" in out.output and "slot 1 z0: median 0.50" in out.output
    as_json = json.loads(CliRunner().invoke(main, ["eval", str(run), "--spikes", "--json"]).output)
    assert [s["step"] for s in as_json["spikes"]] == [3000] and as_json["at_risk"][0]["latent"] == 0
    fails_in_one_line(CliRunner().invoke(main, ["eval", str(run), "--spikes", "--mask-changes"]),
                      "--mask-changes and --spikes are separate readings")
    import shutil

    shutil.rmtree(run / "tb")
    fails_in_one_line(CliRunner().invoke(main, ["eval", str(run), "--spikes"]), "tb not found")
