"""`vase bench`: what is compared. A Spec describes one timed variant (which step, which code
routes, which process); `default_specs` lists those of a preset (docs/benchmarks.md)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Spec:
    """A picklable description of one timed variant (built in this process or in the plain child)."""

    key: str
    label: str
    preset: str
    kind: str = "learner"  # "learner", "reference" or "loop"
    ablation: str = "-"
    overrides: tuple[str, ...] = ()
    implementation: str = "fast"
    n_envs: int = 0  # >0: prepare_environments(learner, n_envs)
    process: str = "main"  # "main" (allocator tuned, current code) or "plain" (a fresh default process)
    threads: int = 0  # >0: torch threads while this variant runs (0: the run's setting)
    # The routes of the current code, or the earlier ones for before/after figures:
    transposed_weight_grad: str = "swapped"  # conv_paths.TRANSPOSED_WEIGHT_GRAD
    fused_adam: bool = True  # learner.FUSED_ADAM


# oneDNN's weight gradients: the route our kernel (vase/kernels) replaces, for before/after figures.
ONEDNN_WGRAD = "model.weight_grad_kernel=onednn"
# bf16 autocast (train.precision): the layers it runs are the plain NCHW ones, as in the Learner.
BF16 = "train.precision=bf16"


def default_specs(preset: str) -> list[Spec]:
    p = preset
    specs = [
        Spec(f"{p}/plain", 'plain step "-"', p),
        Spec(f"{p}/vase", "VASE step SDA, 2 past envs", p, ablation="SDA", n_envs=3),
        Spec(
            f"{p}/vase_1past", "SDA, 1 past env (k_max 10)", p, ablation="SDA", overrides=("model.k_max=10",), n_envs=2
        ),
        Spec(
            f"{p}/vase_8past", "SDA, 8 past envs (k_max 10)", p, ablation="SDA", overrides=("model.k_max=10",), n_envs=9
        ),
        Spec(f"{p}/plain_bf16", 'plain "-", bf16 autocast', p, overrides=(BF16,), implementation="nchw"),
        Spec(f"{p}/vase_bf16", "SDA 2 past, bf16 autocast", p, ablation="SDA", overrides=(BF16,),
             implementation="nchw", n_envs=3),
        Spec(f"{p}/loop", "trainer-like loop, SDA 2 past", p, kind="loop", ablation="SDA", n_envs=3),
        Spec(f"{p}/plain_1thread", 'plain step "-", 1 thread', p, threads=1),
        Spec(f"{p}/plain_onednn_wgrad", 'plain "-", oneDNN weight gradients', p, overrides=(ONEDNN_WGRAD,)),
        Spec(
            f"{p}/plain_nchw_wgrad",
            'plain "-", NCHW deconv wgrad + multi-tensor Adam',
            p,
            overrides=(ONEDNN_WGRAD,),
            transposed_weight_grad="nchw",
            fused_adam=False,
        ),
        Spec(
            f"{p}/plain_cl", 'plain "-", old layers + kept memory', p, implementation="channels_last", fused_adam=False
        ),
        Spec(
            f"{p}/before_plain",
            'plain "-", before (old code, plain process)',
            p,
            implementation="channels_last",
            process="plain",
            fused_adam=False,
        ),
        Spec(
            f"{p}/before_vase",
            "SDA 2 past, before (old code, plain process)",
            p,
            ablation="SDA",
            implementation="channels_last",
            n_envs=3,
            process="plain",
            fused_adam=False,
        ),
        Spec(f"{p}/reference", "reference NCHW (plain process)", p, kind="reference", process="plain"),
        Spec(f"{p}/reference_kept", "reference NCHW + kept memory (this process)", p, kind="reference"),
    ]
    return specs
