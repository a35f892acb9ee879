"""`vase bench`: the plain child process. The code as it was before the speed work runs in a fresh
Python process whose allocator is left at glibc's defaults, driven over pipes by this one."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from vase import conv_paths
from vase.bench_steps import Variant
from vase.bench_variants import Spec


def _worker_main() -> None:
    """Child process loop (`python -c "from vase.bench_child import _worker_main; _worker_main()"`): build
    variants and time steps on request, pickled messages over stdin/stdout. glibc's allocator is left
    at its defaults here (conv_paths.keep_freed_memory is not applied), as in a process that never tuned it."""
    import pickle

    conv_paths._allocator_tuned = True
    # The protocol owns the original stdout; anything printed goes to stderr.
    reply = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    variants: dict[str, Variant] = {}
    while True:
        try:
            msg = pickle.load(requests)
        except EOFError:
            return
        try:
            if msg[0] == "quit":
                answer = ("ok", None)
            elif msg[0] == "threads":
                if msg[1] > 0:
                    torch.set_num_threads(msg[1])
                answer = ("ok", torch.get_num_threads())
            elif msg[0] == "build":
                variants[msg[1].key] = Variant(msg[1])
                answer = ("ok", None)
            elif msg[0] == "run":
                answer = ("ok", variants[msg[1]].run(msg[2]))
            elif msg[0] == "info":
                answer = ("ok", variants[msg[1]].info())
            else:
                answer = ("error", f"unknown request {msg[0]!r}")
        except Exception as e:  # report to the parent instead of hanging it
            answer = ("error", f"{type(e).__name__}: {e}")
        pickle.dump(answer, reply)
        reply.flush()
        if msg[0] == "quit":
            return


class PlainProcess:
    """A fresh Python process running `_worker_main`; it runs only while this process waits for it, so
    the two never compete for the cores."""

    def __init__(self, threads: int):
        import pickle

        self._pickle = pickle
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from vase.bench_child import _worker_main; _worker_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        # The same thread count as this process (the library default is the same in both).
        self.call("threads", threads if threads > 0 else torch.get_num_threads())

    def call(self, *msg):
        self._pickle.dump(msg, self.proc.stdin)
        self.proc.stdin.flush()
        try:
            status, value = self._pickle.load(self.proc.stdout)
        except EOFError:
            raise RuntimeError(f"the bench child process exited (code {self.proc.poll()})") from None
        if status != "ok":
            raise RuntimeError(f"bench child process: {value}")
        return value

    def close(self) -> None:
        try:
            self.call("quit")
        except (OSError, RuntimeError, EOFError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class RemoteVariant:
    def __init__(self, spec: Spec, plain: PlainProcess):
        self.spec, self.plain = spec, plain
        plain.call("build", spec)

    def run(self, n: int) -> list[dict]:
        return self.plain.call("run", self.spec.key, n)

    def info(self) -> dict:
        return self.plain.call("info", self.spec.key)
