"""Where the runs of a grid execute: child processes on this machine, or Ray tasks on a cluster.

Every run is a `vase train` child process (`python -m cli train ...`), whichever backend starts
it: a crash, a NaN or an out-of-memory kill ends that run only, its console output goes to its log
file, and its torch threads are its own. A Ray task is the same child process started on whichever
node Ray picks, with `threads` CPUs reserved for it.

Ray nodes need vase installed and the data at the same path (or a shared filesystem). Runs on a
node other than the driver's are sent back to the driver as a tar archive when they end, unless
the driver already sees their results.json (a shared filesystem); a run resumed on another node is
sent there first.
"""
from __future__ import annotations

import io
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from vase.errors import VaseError

# How long an interrupted run gets to stop by itself (it prints its resume command) before it is killed.
STOP_GRACE_S = 30.0
POLL_S = 0.5


@dataclass
class Job:
    name: str
    arguments: list[str]  # `vase train ...` arguments
    run_dir: str
    log: str
    files: bytes | None = None  # the run directory so far, for a resume on another node (Ray)
    env: dict[str, str] = field(default_factory=dict)  # set for the child, e.g. its CUDA_VISIBLE_DEVICES


@dataclass
class Outcome:
    returncode: int
    seconds: float
    host: str
    log_tail: str = ""
    files: bytes | None = None  # the finished run directory, when it ran on another node
    log: bytes | None = None  # its console output, likewise
    error: str = ""  # why the backend could not run it at all

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.error


# Called on the driver as each job ends; it may return jobs that follow it (a row branched from a
# first stage that just ended), which the backend then runs as well.
OnDone = Callable[[Job, Outcome], "list[Job] | None"]


# -- moving a run directory between machines ---------------------------------------------------------
def pack_dir(path: str | Path) -> bytes:
    """The directory's files as an uncompressed tar (checkpoints hardly compress)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(str(path), arcname=".")
    return buf.getvalue()


def unpack_dir(data: bytes, path: str | Path) -> None:
    """Replace `path` with the directory held in `data` (extracted next to it, then moved in place)."""
    path = Path(path)
    staging = path.with_name(path.name + ".incoming")
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        tar.extractall(staging, filter="data")  # the "data" filter refuses links and paths out of staging
    shutil.rmtree(path, ignore_errors=True)
    staging.rename(path)


# -- one run ------------------------------------------------------------------------------------------
def child_command() -> list[str]:
    """This interpreter's `vase` CLI (the same installation as the caller's, on every node)."""
    return [sys.executable, "-m", "cli"]


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def execute(job: Job, driver_host: str, command: list[str] | None = None,
            started: Callable[[subprocess.Popen], None] | None = None) -> Outcome:
    """Run one job to its end in a child process and report how it went.

    `driver_host` tells whether this runs on the driver's machine; if not, the finished run and its
    log travel back in the Outcome. `started` receives the child process (the local backend keeps
    it so that an interrupt reaches it).
    """
    host = socket.gethostname()
    remote = host != driver_host
    run_dir, log = Path(job.run_dir), Path(job.log)
    if job.files is not None and not (run_dir / "config.json").is_file():
        unpack_dir(job.files, run_dir)  # resuming a run that was started on another machine
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "ab") as out:  # append: a resumed run keeps the output of its earlier part
        out.write(f"$ vase {' '.join(job.arguments)}   (on {host})\n".encode())
        out.flush()
        proc = subprocess.Popen([*(command or child_command()), *job.arguments], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **job.env} if job.env else None)
        if started:
            started(proc)
        try:
            # Polled, not proc.wait(): Ray's cancel raises KeyboardInterrupt only between Python
            # bytecodes, never inside a blocking waitpid.
            while (code := proc.poll()) is None:
                time.sleep(POLL_S)
        except KeyboardInterrupt:  # Ray's cancel: let the run stop (it keeps its checkpoints), then go
            stop_children([proc])
            raise
    outcome = Outcome(code, time.perf_counter() - t0, host, _tail(log))
    if remote:
        outcome.log = log.read_bytes()
        if run_dir.is_dir():
            outcome.files = pack_dir(run_dir)
    return outcome


def stop_children(procs: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """SIGINT every run at once (each prints how to resume and exits), then SIGKILL whichever has not
    ended grace_s later: a grid of N stuck runs stops within one grace period, not N in turn."""
    live = [proc for proc in procs if proc.poll() is None]
    for proc in live:
        proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for proc in live:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def receive(job: Job, outcome: Outcome) -> None:
    """On the driver: put a run that ended on another machine where the driver's grid expects it."""
    if outcome.files is not None and not (Path(job.run_dir) / "results.json").is_file():
        unpack_dir(outcome.files, job.run_dir)
    if outcome.log is not None and not Path(job.log).is_file():
        Path(job.log).parent.mkdir(parents=True, exist_ok=True)
        Path(job.log).write_bytes(outcome.log)
    outcome.files = outcome.log = None


# -- backends -----------------------------------------------------------------------------------------
@dataclass
class LocalBackend:
    """Up to `workers` runs at a time, as child processes of this one.

    With `gpus` > 0 the workers are `gpus` x `runs_per_gpu` GPU seats: each run takes a free seat
    and sees only that GPU (CUDA_VISIBLE_DEVICES), so small runs share a GPU and no two runs
    fight over a device they were not given.
    """

    workers: int
    command: list[str] | None = None  # tests replace the child program
    gpus: int = 0
    runs_per_gpu: int = 1
    _live: set = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self):
        self._seats: queue.Queue = queue.Queue()
        if self.gpus:
            self.workers = self.gpus * self.runs_per_gpu
            for _ in range(self.runs_per_gpu):
                for gpu in range(self.gpus):
                    self._seats.put(str(gpu))

    def _execute(self, job: Job, host: str) -> Outcome:
        if not self.gpus:
            return execute(job, host, self.command, self._started)
        seat = self._seats.get()
        job.env = {**job.env, "CUDA_VISIBLE_DEVICES": seat}
        try:
            return execute(job, host, self.command, self._started)
        finally:
            self._seats.put(seat)

    def _started(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._live.add(proc)

    def run(self, jobs: list[Job], on_done: OnDone) -> None:
        host = socket.gethostname()
        pool = ThreadPoolExecutor(max_workers=max(1, self.workers))
        futures = {pool.submit(self._execute, job, host): job for job in jobs}
        try:
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                for fut in done:
                    job = futures[fut]
                    try:
                        outcome = fut.result()
                    except Exception as e:  # the run could not even start (e.g. its log is unwritable)
                        outcome = Outcome(-1, 0.0, host, error=f"{type(e).__name__}: {e}")
                    for follow in on_done(job, outcome) or []:
                        queued = pool.submit(self._execute, follow, host)
                        futures[queued] = follow
                        pending.add(queued)
        except KeyboardInterrupt:
            for fut in futures:
                fut.cancel()
            with self._lock:
                live = list(self._live)
            stop_children(live)
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def import_ray():
    try:
        import ray
    except ImportError:
        raise VaseError("--ray needs Ray: pip install -e \".[grid]\" (or pip install 'ray>=2.9')") from None
    return ray


@dataclass
class RayBackend:
    """Every run as one Ray task with `threads` CPUs and `gpus_per_run` GPUs; Ray places the tasks
    on the cluster's nodes.

    `address` is a running cluster's address ("auto": the one this machine belongs to); None
    starts a Ray instance on this machine for the duration of the grid.
    """

    threads: int
    address: str | None = None
    gpus_per_run: float = 0.0  # a fraction lets several runs share one GPU; Ray sets CUDA_VISIBLE_DEVICES

    def run(self, jobs: list[Job], on_done: OnDone) -> None:
        ray = import_ray()
        started_here = not ray.is_initialized()
        if started_here:
            options = {"logging_level": logging.WARNING, "log_to_driver": False}
            if self.address is None:
                options["include_dashboard"] = False
            ray.init(address=self.address, **options)
        host = socket.gethostname()
        task = ray.remote(num_cpus=self.threads, num_gpus=self.gpus_per_run, max_retries=0)(execute)
        refs = {}

        def submit(job: Job) -> None:
            if (Path(job.run_dir) / "config.json").is_file():  # a resume: its checkpoints go along, in case
                job.files = pack_dir(job.run_dir)                # Ray places it elsewhere (see `execute`)
            refs[task.remote(job, host)] = job

        for job in jobs:
            submit(job)
        try:
            while refs:
                done, _ = ray.wait(list(refs), num_returns=1)
                job = refs.pop(done[0])
                try:
                    outcome = ray.get(done[0])
                except Exception as e:  # a node or worker died: the run failed, the grid goes on
                    outcome = Outcome(-1, 0.0, "?", error=f"{type(e).__name__}: {e}")
                receive(job, outcome)
                for follow in on_done(job, outcome) or []:
                    submit(follow)
        except KeyboardInterrupt:
            for ref in refs:
                ray.cancel(ref)  # a KeyboardInterrupt in the task, which stops its run (see `execute`)
            ray.wait(list(refs), num_returns=len(refs), timeout=STOP_GRACE_S + 5)
            raise
        finally:
            if started_here:
                ray.shutdown()


def backend_for(threads: int, workers: int | None = None, ray: bool = False, ray_address: str | None = None,
                gpus: int = 0, runs_per_gpu: int = 1, device: str = "auto") -> LocalBackend | RayBackend:
    """The backend that `vase grid`'s options ask for: Ray with `ray` or an address, else this machine.
    Options that contradict each other are refused before anything starts (with --dry-run too)."""
    if (ray or ray_address) and workers is not None:
        raise VaseError("--workers is for runs on this machine; with --ray each run holds --threads CPUs "
                        "and Ray decides how many run at once")
    if gpus and (ray or ray_address or workers is not None):
        raise VaseError("--gpus places runs on this machine's GPUs (--runs-per-gpu at a time on each); "
                        "drop --workers, and with --ray use --runs-per-gpu alone")
    if ray or ray_address:
        # The driver may have no GPU while the cluster's nodes do: decide from the options alone.
        gpu_share = 1.0 / runs_per_gpu if device.startswith("cuda") or runs_per_gpu > 1 else 0.0
        return RayBackend(threads, ray_address, gpu_share)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return LocalBackend(workers or max(1, cores // threads), gpus=gpus, runs_per_gpu=runs_per_gpu)
