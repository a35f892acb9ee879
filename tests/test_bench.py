"""`vase bench`: the FLOP counter, the equivalence of the layer implementations, and the results'
shape. No timing is asserted anywhere (timings depend on the machine and its load)."""
import copy
import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from vase import conv_paths
from vase.bench import run_bench
from vase.bench_flops import ModelCosts, PassRecorder, layer_costs, pass_flops
from vase.bench_reference import reference_from
from vase.bench_steps import prepare_environments
from vase.bench_variants import BF16, Spec
from vase.config import build_config
from vase.conv_paths import use_implementation
from vase.learner import Learner
from vase.networks import VAE


# -- FLOP counting -------------------------------------------------------------------------------------
def test_flop_counter_matches_a_hand_count_for_a_tiny_network():
    net = nn.Sequential(nn.Conv2d(1, 2, 4, 2, 1), nn.ReLU(), nn.Flatten(), nn.Linear(8, 3))
    costs = layer_costs(net, torch.zeros(1, 1, 4, 4))
    # conv: 2x2 outputs x 2 channels, each 1*4*4 MACs = 128; linear: 3 outputs x 8 inputs = 24.
    assert [(c.kind, c.macs) for c in costs] == [("conv", 128), ("linear", 24)]
    assert pass_flops(costs, batch=5, train=False) == 2 * 152 * 5
    # Trained: forward + input and weight gradients (2x forward), minus the first layer's input
    # gradient when the input is data.
    assert pass_flops(costs, batch=5, train=True, input_grad=True) == 3 * 2 * 152 * 5
    assert pass_flops(costs, batch=5, train=True, input_grad=False) == (3 * 2 * 152 - 2 * 128) * 5


def test_flop_counter_counts_transposed_convs_per_input_element():
    net = nn.Sequential(nn.ConvTranspose2d(3, 2, 4, 2, 1))
    (cost,) = layer_costs(net, torch.zeros(1, 3, 2, 2))
    # 3 channels x 2x2 input pixels, each spread over 2 output channels x 4x4 taps.
    assert (cost.kind, cost.macs) == ("deconv", 12 * 2 * 16)


def test_paper_networks_cost_what_the_spec_says():
    costs = ModelCosts.of(build_config("paper").model)
    assert [c.macs for c in costs.encoder[:4]] == [32 * 32 * 64 * 16, 16 * 16 * 64 * 64 * 16,
                                                   8 * 8 * 128 * 64 * 16, 4 * 4 * 128 * 128 * 16]
    assert [c.macs for c in costs.decoder[-4:]] == [4 * 4 * 128 * 128 * 16, 8 * 8 * 128 * 64 * 16,
                                                    16 * 16 * 64 * 64 * 16, 32 * 32 * 64 * 1 * 16]
    step = costs.flops("encoder", 64, True) + costs.flops("decoder", 64, True)
    assert 23e9 < step < 24.5e9  # docs/method.md, networks: "about 24 GFLOP"


def test_recorded_passes_of_a_vase_step():
    learner = Learner(build_config("cpu", ablation="SDA"))
    prepare_environments(learner, 3)
    recorder = PassRecorder(learner)
    out = learner.training_step(torch.rand(8, 1, 64, 64))
    recorder.close()
    assert out.decision.verdict == "same" and out.decision.env == 2
    dream = learner.cfg.dream.batch_size
    # Snapshot decoder + encoder on the dreams (no grad), one trained encoder and decoder pass on
    # real + dreams, and the classifier.
    assert sorted(recorder.passes) == sorted([
        ("decoder", dream, False), ("encoder", dream, False), ("encoder", 8 + dream, True),
        ("classifier", 8 + dream, True), ("decoder", 8 + dream, True),
    ])


# -- the layer implementations compute the same function -----------------------------------------------
@pytest.mark.parametrize("kernel,slope", [("native", 0.0), ("onednn", 0.0), ("native", 0.2)])
@pytest.mark.parametrize("route", ["swapped", "nchw"])
@pytest.mark.parametrize("preset", ["cpu", "paper"])
def test_optimised_networks_match_a_plain_nchw_evaluation(preset, route, kernel, slope, monkeypatch):
    monkeypatch.setattr(conv_paths, "TRANSPOSED_WEIGHT_GRAD", route)  # both weight-gradient routes of the deconvs
    # ours (where built) or oneDNN's weight gradients; the paper's ReLU or a leaky one (model.negative_slope)
    cfg = build_config(preset, [f"model.weight_grad_kernel={kernel}", f"model.negative_slope={slope}"])
    torch.manual_seed(0)
    model = VAE(cfg.model)  # "fast" layers, channels_last parameters
    assert model.encoder.implementation == "fast" and model.decoder.implementation == "fast"
    ref = reference_from(model, cfg.model)  # nn.Sequential, NCHW, copies of the same weights
    x = torch.rand(6, 1, 64, 64)
    z = torch.randn(6, cfg.model.latents)
    env = torch.tensor([0, 1, 2, 3, 4, 5])

    post = model.encoder(x)
    logits = model.decoder(z, env)
    ref_mu, ref_logvar = ref.encoder(x).chunk(2, dim=1)
    ref_logits = ref.decoder(torch.cat([z, F.one_hot(env, cfg.model.k_max).float()], dim=1))
    torch.testing.assert_close(post.mu, ref_mu, atol=1e-4, rtol=0)
    torch.testing.assert_close(post.logvar, ref_logvar, atol=1e-4, rtol=0)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)

    # The gradients agree too (one loss through encoder and decoder).
    def loss(mu, logvar, out):
        return mu.square().sum() + logvar.sum() + F.binary_cross_entropy_with_logits(out, x, reduction="sum")

    loss(post.mu, post.logvar, logits).backward()
    loss(ref_mu, ref_logvar, ref_logits).backward()
    ours = dict(model.named_parameters())
    # Every conv layer: each weight-gradient route (patch matmul, swapped conv, oneDNN) is covered.
    layers = [(f"encoder.convs.{2 * i}", ref.encoder[2 * i]) for i in range(4)]
    layers += [(f"decoder.deconvs.{2 * i}", ref.decoder[5 + 2 * i]) for i in range(4)]
    for name, src in layers:
        g, g_ref = ours[f"{name}.weight"].grad, src.weight.grad
        torch.testing.assert_close(g, g_ref, atol=1e-4 * float(g_ref.abs().max()), rtol=0)
        gb, gb_ref = ours[f"{name}.bias"].grad, src.bias.grad
        torch.testing.assert_close(gb, gb_ref, atol=1e-4 * float(gb_ref.abs().max()), rtol=0)


def test_every_implementation_gives_the_same_outputs():
    cfg = build_config("cpu")
    torch.manual_seed(1)
    model = VAE(cfg.model)
    x, z, env = torch.rand(4, 1, 64, 64), torch.randn(4, cfg.model.latents), torch.tensor([0, 1, 0, 1])
    outs = {}
    for impl in conv_paths.IMPLEMENTATIONS:
        m = use_implementation(copy.deepcopy(model), impl)
        with torch.no_grad():
            outs[impl] = (m.encoder(x).mu, m.decoder(z, env))
    for impl in conv_paths.IMPLEMENTATIONS:
        torch.testing.assert_close(outs[impl][0], outs["nchw"][0], atol=1e-4, rtol=0)
        torch.testing.assert_close(outs[impl][1], outs["nchw"][1], atol=1e-4, rtol=0)
    with pytest.raises(ValueError):
        use_implementation(model, "bogus")


def test_parameters_and_state_dict_keys_are_unchanged():
    cfg = build_config("paper")
    model = VAE(cfg.model)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["encoder.convs.0.weight"] == (64, 1, 4, 4)
    assert shapes["decoder.deconvs.6.weight"] == (64, 1, 4, 4)
    assert shapes["decoder.fc1.weight"] == (256, 24 + cfg.model.k_max)
    assert {k.rsplit(".", 1)[0] for k in shapes} == {
        "encoder.convs.0", "encoder.convs.2", "encoder.convs.4", "encoder.convs.6", "encoder.fc", "encoder.head",
        "decoder.fc1", "decoder.fc2", "decoder.deconvs.0", "decoder.deconvs.2", "decoder.deconvs.4",
        "decoder.deconvs.6",
    }


# -- run_bench with tiny settings -------------------------------------------------------------------------
def test_run_bench_writes_the_json(tmp_path, monkeypatch):
    import vase.bench_flops
    import vase.bench_steps

    # Tiny everything: this checks the plumbing and the JSON, not the machine.
    monkeypatch.setattr(vase.bench_steps, "WARMUP_STEPS", 1)
    monkeypatch.setattr(vase.bench_flops, "MATMUL_N", 256)
    monkeypatch.setattr(vase.bench_flops, "CONV_SHAPE", (2, 16, 8, 8))
    p = "cpu"
    tiny = ("model.channels=8,8,8,8", "model.hidden=32", "train.batch_size=8", "dream.batch_size=4")
    specs = {p: [
        Spec(f"{p}/plain", "plain", p, overrides=tiny),
        Spec(f"{p}/vase", "vase", p, ablation="SDA", n_envs=3, overrides=tiny),
        Spec(f"{p}/loop", "loop", p, kind="loop", ablation="SDA", n_envs=3, overrides=tiny),
        Spec(f"{p}/before_plain", "before", p, implementation="channels_last", process="plain", overrides=tiny),
        Spec(f"{p}/reference", "reference", p, kind="reference", overrides=tiny),
        Spec(f"{p}/vase_bf16", "vase bf16", p, ablation="SDA", n_envs=3, overrides=tiny + (BF16,),
             implementation="nchw"),
    ]}
    printed = []
    out = tmp_path / "bench.json"
    results = run_bench([p], steps=1, json_out=str(out), skip_memory=True, specs=specs, threads=1,
                        echo=printed.append, log=lambda s: None)
    data = json.loads(out.read_text())
    for key in ("date", "cpu_model", "cores", "torch", "torch_threads", "load_average_start", "load_average_end"):
        assert key in data["machine"]
    assert data["peaks"]["matmul"]["peak_flops"] > 0 and data["peaks"]["conv"]["peak_flops"] > 0
    variants = data["presets"][p]["variants"]
    assert set(variants) == {"plain", "vase", "loop", "before_plain", "reference", "vase_bf16"}
    for v in variants.values():
        for key in ("median_step_s", "median_cpu_s", "images_per_s", "flops_per_step", "flops_per_s",
                    "fraction_of_matmul_peak", "fraction_of_conv_peak"):
            assert v[key] > 0, key
    assert variants["vase"]["verdicts"] == {"same": 1}
    assert set(variants["loop"]["sections_median_s"]) == {"step", "data", "nets", "objective", "bookkeeping", "logging"}
    assert 0 <= variants["loop"]["outside_model_fraction"] < 1
    ratios = data["presets"][p]["ratios"]
    for key in ("vase_over_plain_time", "vase_over_plain_flops", "vase_cost_over_flop_ratio",
                "speedup_vs_reference", "speedup_plain_vs_before", "outside_model_fraction"):
        assert key in ratios
    assert 1.5 < ratios["vase_over_plain_flops"] < 1.8  # dreams: 1.5x the trained passes + snapshot passes
    assert ratios["speedup_vase_from_bf16"] > 0
    # bf16 rounds: the loss moves, but by far less than training does (docs/benchmarks.md).
    assert 0 < data["presets"][p]["bf16_loss_difference"] < 0.01
    assert {t["target"] for t in data["targets"]} >= {"cpu plain step, speed-up vs NCHW reference"}
    assert "memory" not in data
    assert "preset cpu" in data["report"] and str(out) in printed[-1]
    assert results["json_path"] == str(out)
