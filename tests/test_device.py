"""--device: resolution, placement of every state tensor, bit-identity on the CPU, moving checkpoints.

The same code runs on every device, so CI (CPU only) tests the plumbing on the CPU; the tests marked
`cuda` repeat what matters on a GPU and are skipped where there is none.
"""
import copy
import json
import warnings

import pytest
import torch
from click.testing import CliRunner

from cli import main
from vase.config import build_config
from vase.device import DeviceError, cpu_model, host, resolve_device
from vase.learner import Learner

TINY = ["model.channels=8,8,8,8", "model.hidden=32", "model.latents=6", "model.k_max=4", "dream.batch_size=8",
        "train.batch_size=16", "inference.patience=1", "inference.cooldown=0", "dream.snapshot_every=3"]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def batches(n, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(16, 1, 64, 64, generator=g) < 0.1).float().to(device) for _ in range(n)]


def tensors(obj, path="state"):
    """Every tensor inside a nested state dict, with where it sits."""
    if torch.is_tensor(obj):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{path}[{i}]")


def train(learner, xs):
    return [learner.training_step(x) for x in xs]


def test_auto_is_the_cpu_without_accelerators(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("vase.device._mps_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["cuda", "cuda:1", "mps"])
def test_an_absent_device_is_one_clear_error(monkeypatch, name):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("vase.device._mps_available", lambda: False)
    with pytest.raises(DeviceError, match=f"--device {name}: .*use --device cpu"):
        resolve_device(name)


def test_an_unknown_device_name_is_refused():
    with pytest.raises(DeviceError, match="unknown device 'tpu7'"):
        resolve_device("tpu7")


def test_the_cli_says_one_line_for_a_missing_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(main, ["train", "--device", "cuda", "--run-dir", str(tmp_path / "r")])
    assert result.exit_code != 0
    assert result.output.strip().splitlines() == [
        result.output.strip().splitlines()[0]] and result.output.startswith("Error: --device cuda")
    assert "Traceback" not in result.output and not (tmp_path / "r").exists()


def test_an_explicit_cpu_device_trains_bit_for_bit_like_the_default():
    cfg = build_config("cpu", TINY, "SDA")
    a, b = Learner(cfg), Learner(cfg, resolve_device("cpu"))
    xs = batches(6)
    outs_a, outs_b = train(a, xs), train(b, xs)
    assert [o.losses for o in outs_a] == [o.losses for o in outs_b]
    for (name, x), (_, y) in zip(tensors(a.state_dict()), tensors(b.state_dict())):
        assert torch.equal(x, y), name


def test_every_state_tensor_is_on_the_learners_device():
    learner = Learner(build_config("cpu", TINY, "SDA"), "cpu")
    train(learner, batches(4))
    placed = dict(tensors(learner.state_dict()))
    host_side = {"state.generator", "state.torch_rng", "state.inference.slots.recorded",
                 "state.inference.slots.initialised"}
    assert all(t.device == learner.device for name, t in placed.items() if name not in host_side)
    assert learner.generator.device == learner.device


def test_a_checkpoint_from_another_device_resumes_with_a_reseeded_stream():
    """A CUDA generator's state cannot seed a CPU one: the resume warns and continues from a stream
    derived from (seed, step), deterministically."""
    cfg = build_config("cpu", TINY, "SDA")
    source = Learner(cfg)
    train(source, batches(3))
    state = source.state_dict()
    state["generator_device"] = "cuda"
    resumed = []
    for _ in range(2):
        learner = Learner(cfg)
        with pytest.warns(UserWarning, match="written on cuda and resumes on cpu"):
            learner.load_state_dict(copy.deepcopy(state))  # the optimizer keeps the loaded tensors
        resumed.append([o.losses for o in train(learner, batches(2, seed=1))])
    assert resumed[0] == resumed[1] and all(torch.isfinite(torch.tensor(list(r.values()))).all() for r in resumed[0])


def test_a_same_device_resume_keeps_the_generator_bit_for_bit():
    cfg = build_config("cpu", TINY, "SDA")
    straight = Learner(cfg)
    xs = batches(6)
    expected = [o.losses for o in train(straight, xs)]
    first = Learner(cfg)
    train(first, xs[:3])
    second = Learner(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second.load_state_dict(first.state_dict())
    assert [o.losses for o in train(second, xs[3:])] == expected[3:]


def test_bf16_precision_trains_finite_steps_on_the_cpu():
    learner = Learner(build_config("cpu", TINY + ["train.precision=bf16"], "SDA"))
    outs = train(learner, batches(3))
    assert all(torch.isfinite(torch.tensor(list(o.losses.values()))).all() for o in outs)


# -- on a GPU ---------------------------------------------------------------------------------------------
@cuda
@pytest.mark.cuda
def test_cuda_state_lives_on_the_gpu_and_moves_to_the_cpu():
    cfg = build_config("cpu", TINY, "SDA")
    gpu = Learner(cfg, "cuda")
    train(gpu, batches(4, "cuda"))
    placed = dict(tensors(gpu.state_dict()))
    host_side = {"state.generator", "state.torch_rng", "state.inference.slots.recorded",
                 "state.inference.slots.initialised"}
    assert all(t.is_cuda for name, t in placed.items() if name not in host_side)
    # The checkpoint path loads on the CPU (map_location) and each part moves to its device.
    state = torch.load(_saved(gpu.state_dict()), map_location="cpu", weights_only=True)
    cpu = Learner(cfg, "cpu")
    with pytest.warns(UserWarning, match="written on cuda"):
        cpu.load_state_dict(state)
    assert cpu.step == 4 and torch.isfinite(torch.tensor(list(train(cpu, batches(2))[-1].losses.values()))).all()
    back = Learner(cfg, "cuda")
    back.load_state_dict(torch.load(_saved(gpu.state_dict()), map_location="cpu", weights_only=True))
    assert back.slots[0].mask.is_cuda and back.slots[0].error.is_cuda


@cuda
@pytest.mark.cuda
def test_cuda_training_matches_the_cpu_to_float_tolerance():
    cfg = build_config("cpu", TINY + ["train.deterministic=true"], "-")
    losses = []
    for device in ("cpu", "cuda"):
        learner = Learner(cfg, device)
        # The same noise on both devices: the CPU generator's draws differ from the GPU's.
        learner.generator = torch.Generator(device=device).manual_seed(0)
        losses.append(train(learner, batches(1, device))[0].losses["reconstruction"])
    assert losses[1] == pytest.approx(losses[0], rel=0.05)


@cuda
@pytest.mark.cuda
def test_cuda_cli_run_records_its_device(tmp_path):
    from tests.test_cli import tiny_args

    result = CliRunner().invoke(main, tiny_args(tmp_path / "run", tmp_path / "data") + ["--device", "cuda"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["device"].startswith("cuda")


def _saved(state):
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf


def test_mps_is_seen_by_its_control_pipe(tmp_path):
    from vase.device import mps_running

    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    assert not mps_running(env)
    (tmp_path / "control").touch()
    assert mps_running(env)


def test_the_cpu_model_is_read_from_cpuinfo_and_falls_back_to_platform(monkeypatch):
    info = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Example CPU @ 2.80GHz\nflags\t: avx2\n"
    assert cpu_model(info) == "Example CPU @ 2.80GHz"
    monkeypatch.setattr("platform.processor", lambda: "arm")
    assert cpu_model("processor\t: 0\nmodel name\t:\n") == "arm"
    monkeypatch.setattr("platform.processor", lambda: "")
    assert cpu_model("") == "unknown"


def test_the_host_record_names_what_decides_the_cpu_kernels():
    record = host()
    assert record["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert record["torch"] == torch.__version__ and record["threads"] == torch.get_num_threads()
    assert json.loads(json.dumps(record)) == record


@pytest.mark.parametrize("threads, device, load, cores, noted", [
    (2, "cpu", 3.1, 2, True),  # the grid's three one-thread runs on 2 cores, and a run of two threads
    (2, "cpu", 2.0, 2, True),
    (2, "cpu", 1.9, 2, False),  # a core to spare
    (1, "cpu", 9.0, 2, False),  # one thread waits for nobody
    (2, "cuda", 9.0, 2, False),
])
def test_a_busy_cpu_is_noted_for_runs_of_several_threads(threads, device, load, cores, noted):
    from vase.device import busy_cpu_note

    note = busy_cpu_note(threads, torch.device(device), load, cores)
    assert (note is not None) == noted
    if noted:
        assert f"load average is {load:.1f} on {cores} cores" in note and "--set train.threads=1" in note


def test_vase_train_notes_a_busy_machine_once_on_stderr(tmp_path, monkeypatch):
    import vase.device
    from tests.test_cli import tiny_args

    monkeypatch.setattr(vase.device.os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    busy = CliRunner().invoke(main, tiny_args(tmp_path / "busy", tmp_path / "data", train__threads=2),
                              catch_exceptions=False)
    assert busy.exit_code == 0, busy.output
    assert busy.stderr.count("note: this machine's load average is 64.0") == 1
    quiet = CliRunner().invoke(main, tiny_args(tmp_path / "one", tmp_path / "data", train__threads=1),
                               catch_exceptions=False)
    assert quiet.exit_code == 0 and "load average" not in quiet.output
