"""`vase bench`: the peak memory of a default training run, and what the data occupies."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from vase import conv_paths
from vase.config import Config, build_config


# =====================================================================================================
# Peak memory of a default training run
# =====================================================================================================
def _train_child(steps: int, env: dict[str, str], echo: Callable[[str], None], what: str) -> dict:
    """Run `vase train --steps STEPS` (every other setting at its default) in a child process and
    return its exit code, wall time and peak resident set size (ru_maxrss from wait4: that child's own,
    not the maximum over every child of this process)."""
    with tempfile.TemporaryDirectory(prefix="vase-bench-") as tmp:
        cmd = [sys.executable, "-c", "import sys; from cli import main; sys.argv[0] = 'vase'; main()",
               "train", "--steps", str(steps), "--run-dir", str(Path(tmp) / "run"), "--no-progress"]
        echo(f"  memory: vase train --steps {steps} ({what}) in a child process ...")
        t0 = time.perf_counter()
        with open(Path(tmp) / "train.log", "w+") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd(),
                                    env={**os.environ, **env})
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            log.seek(0)
            tail = log.read()[-2000:]
    out = {"returncode": proc.returncode, "wall_s": time.perf_counter() - t0,
           # Linux reports ru_maxrss in KiB.
           "peak_rss_bytes": usage.ru_maxrss * 1024}
    if proc.returncode != 0:
        out["error"] = tail
    return out


def measure_memory(steps: int, echo: Callable[[str], None], compare: bool = True) -> dict:
    """Peak memory of the default training run (`vase train --steps STEPS`), what its data occupies,
    and (compare) the same run with glibc's default allocator settings (VASE_KEEP_FREED_MEMORY=0)."""
    cfg = build_config("cpu", [f"data.steps_per_env={steps}"])
    out = {"command": f"vase train --steps {steps} --no-progress (run dir in a temporary folder)",
           **_train_child(steps, {}, echo, "defaults"), "data_bytes": None}
    if out["returncode"] != 0:
        return out
    if compare:
        out["without_kept_memory"] = _train_child(steps, {conv_paths.KEEP_FREED_MEMORY_ENV: "0"}, echo,
                                                  f"{conv_paths.KEEP_FREED_MEMORY_ENV}=0")
    try:
        out["data_bytes"], out["data_detail"] = _data_bytes(cfg)
    except Exception as e:  # the figure is informative only
        out["data_error"] = f"{type(e).__name__}: {e}"
    return out


def _data_bytes(cfg: Config) -> tuple[int, dict]:
    """Bytes of the images and factors the default run loads (train and test splits, from the cache
    the child just filled)."""
    from vase.data.environments import load_sequence

    detail, total = {}, 0
    for split in ("train", "test"):
        for env in load_sequence(cfg.data, split, progress=False):
            n = env.images.element_size() * env.images.nelement()
            n += sum(int(a.nbytes) for a in env.factors.values())
            detail[f"{env.name}/{split}"] = n
            total += n
    return total, detail


