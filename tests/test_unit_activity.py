"""`vase eval --alive-units`: the encoder's units that still fire, counted on hand-made networks whose
dead units are known, and read from a run's saved encoders."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from test_inspect import invoke

from cli import main
from vase.config import build_config
from vase.networks import Encoder
from vase.unit_activity import alive_units, firing, layer_widths, without_channels

SMALL = ["model.channels=4,4,6,6", "model.hidden=8"]


def encoder(*sets: str) -> Encoder:
    """Positive weights and biases: on images in [0, 1] every unit's output is positive everywhere."""
    net = Encoder(build_config("cpu", [*SMALL, *sets]).model)
    with torch.no_grad():
        for layer in [*net.convs, net.fc]:
            if hasattr(layer, "weight"):
                layer.weight.fill_(0.01)
                layer.bias.fill_(0.1)
    return net


def images(n: int = 16) -> torch.Tensor:
    return torch.rand(n, 1, 64, 64, generator=torch.Generator().manual_seed(1))


def kill(layer: torch.nn.Module, units: list[int]) -> None:
    """Units whose pre-activation is negative for every input: their ReLU output is always zero."""
    with torch.no_grad():
        layer.weight[units] = 0.0
        layer.bias[units] = -1.0


def test_every_unit_of_an_encoder_with_positive_weights_fires():
    net = encoder()
    assert layer_widths(net) == [4, 4, 6, 6, 8]
    assert alive_units(net, images()) == [4, 4, 6, 6, 8]


def test_units_made_dead_are_not_counted_and_the_rest_are():
    net = encoder()
    conv3 = [m for m in net.convs if isinstance(m, torch.nn.Conv2d)][2]
    kill(conv3, [0, 4])
    kill(net.fc, [1, 2, 7])
    assert alive_units(net, images()) == [4, 4, 4, 6, 5]


def test_under_a_leaky_relu_a_unit_fires_only_where_its_output_is_positive():
    """model.negative_slope: a killed unit's output is -slope, not zero, everywhere; it still does not fire,
    and the units below it still see it (the next layer's input is not zero)."""
    net = encoder("model.negative_slope=0.1")
    conv3 = [m for m in net.convs if isinstance(m, torch.nn.Conv2d)][2]
    kill(conv3, [0, 4])
    kill(net.fc, [1, 2, 7])
    assert alive_units(net, images()) == [4, 4, 4, 6, 5]
    conv3_out = torch.nn.Sequential(*list(net.convs)[:6])(images())
    torch.testing.assert_close(conv3_out[:, 0], torch.full_like(conv3_out[:, 0], -0.1))


def test_a_unit_is_alive_if_it_fires_on_one_image_and_dead_at_exactly_zero():
    net = encoder()
    with torch.no_grad():
        net.fc.weight[3] = 0.0
        net.fc.bias[3] = 0.0  # ReLU(0) = 0 on every image: no gradient either
    x = images()
    assert alive_units(net, x)[-1] == 7
    features = torch.nn.Sequential(*net.convs)(x).flatten(1)  # the fc layer's inputs, all > 0, one sum per image
    first, second = features.sum(1).topk(2).values
    assert first > second
    with torch.no_grad():  # fires where the features sum above the midpoint of the two largest sums
        net.fc.weight[3] = 1.0
        net.fc.bias[3] = -float(first + second) / 2
    assert (torch.relu(net.fc(features))[:, 3] > 0).sum() == 1
    assert alive_units(net, x)[-1] == 8


def last_conv(net: Encoder) -> torch.nn.Conv2d:
    return [m for m in net.convs if isinstance(m, torch.nn.Conv2d)][-1]


def test_firing_marks_each_dead_unit_of_each_layer():
    net = encoder()
    kill(last_conv(net), [0, 4])
    kill(net.fc, [2])
    fired = firing(net, images())
    assert [f.tolist() for f in fired[3:]] == [[False, True, True, True, False, True],
                                              [True, True, False, True, True, True, True, True]]
    assert all(f.all() for f in fired[:3])


def test_cutting_channels_is_zeroing_their_outputs_before_the_fc_layer():
    """Against the encoder's layers run by hand with the chosen channels of the last conv's ReLU output
    zeroed: the same hidden layer and code. Fails if a channel's block of fc inputs is misplaced (the
    conv output is flattened channel by channel)."""
    torch.manual_seed(3)
    net = Encoder(build_config("cpu", SMALL).model)
    x = images()
    chosen = torch.tensor([False, True, False, False, True, False])
    state = {k: v.clone() for k, v in net.state_dict().items()}
    cut_net = Encoder(build_config("cpu", SMALL).model)
    cut_net.load_state_dict(without_channels(state, chosen))
    torch.testing.assert_close(state["fc.weight"], net.state_dict()["fc.weight"])  # the given weights untouched

    with torch.no_grad():
        features = torch.nn.Sequential(*net.convs)(x) * (~chosen).float().view(1, -1, 1, 1)
        hidden = net.act(net.fc(features.flatten(1)))
        mu = net.head(hidden).chunk(2, dim=1)[0]
        got = cut_net(x)
        assert not torch.allclose(net(x).hidden, got.hidden)  # the chosen channels did carry something
    torch.testing.assert_close(got.hidden, hidden)
    torch.testing.assert_close(got.mu, mu)


def test_cutting_channels_that_never_fire_changes_nothing():
    net = encoder()
    kill(last_conv(net), [1, 3])
    x = images()
    dark = ~firing(net, x)[-2]
    assert dark.tolist() == [False, True, False, True, False, False]
    cut_net = encoder()
    cut_net.load_state_dict(without_channels(net.state_dict(), dark))
    with torch.no_grad():
        torch.testing.assert_close(cut_net(x).mu, net(x).mu)
    assert (cut_net.fc.weight.view(8, 6, -1)[:, [1, 3]] == 0).all()
    assert (cut_net.fc.weight.view(8, 6, -1)[:, [0, 2, 4, 5]] != 0).all()


def test_cutting_refuses_a_channel_count_that_does_not_divide_the_fc_inputs():
    with pytest.raises(ValueError, match="not a whole number per channel"):
        without_channels({"fc.weight": torch.ones(8, 96)}, torch.zeros(5, dtype=torch.bool))


def test_eval_reads_every_saved_encoder_on_every_environment(tiny_run):
    result = invoke(["eval", tiny_run, "--alive-units", "all", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert {(r["step"], r["environment"]) for r in rows} == {(s, e) for s in (2, 4, 6, 8)
                                                             for e in ("moving_shapes_a", "shapes_b")}
    for r in rows:
        assert len(r["alive"]) == len(r["of"]) == 5 and all(0 <= a <= w for a, w in zip(r["alive"], r["of"]))
    text = invoke(["eval", tiny_run, "--alive-units", "2,8"]).output
    steps = [line.split()[0] for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert "conv1" in text and "moving_shapes_a" in text and steps == ["2", "8", "2", "8"]


def test_eval_names_a_step_without_a_saved_encoder_and_refuses_two_readings(tiny_run):
    result = CliRunner().invoke(main, ["eval", str(tiny_run), "--alive-units", "3"])
    assert result.exit_code != 0 and "no saved encoder of step 3" in result.output
    result = CliRunner().invoke(main, ["eval", str(tiny_run), "--alive-units", "all", "--mask-changes"])
    assert result.exit_code != 0 and "give one at a time" in result.output
    result = CliRunner().invoke(main, ["eval", str(tiny_run), "--alive-units", "all", "--cut-dark", "2"])
    assert result.exit_code != 0 and "--cut-dark goes with --readouts" in result.output
