"""Progress bars that suit where they are written: tqdm's bar on a terminal, and in a log file (a
grid or a training under `nohup … > log`, a cluster's batch job) one dated line per `LOG_EVERY_S`
seconds.

tqdm redraws its bar with carriage returns, which a terminal overwrites and a file keeps: a long
grid's log would be one line of megabytes that `tail` prints whole. Off a terminal the same bar is
written through `LogLines`, which turns each redraw into a line of its own, and tqdm's
`mininterval` spaces the redraws out.
"""
from __future__ import annotations

import sys
import time
from typing import IO, Callable

from tqdm import autonotebook, std
from tqdm.auto import tqdm

LOG_EVERY_S = 60.0  # one progress line a minute in a log: a 40-hour study writes 2,400 lines


class LogLines:
    """A text stream for tqdm that writes each redraw of a bar as one dated line."""

    def __init__(self, stream: IO[str], clock: Callable[[], float] = time.time):
        self.stream = stream
        self.clock = clock

    def write(self, text: str) -> None:
        # tqdm writes "\r" + bar + padding to redraw, "\r" + spaces to clear and "\n" to close.
        line = text.replace("\r", "").strip()
        if line:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.clock()))
            self.stream.write(f"{stamp} {line}\n")
            self.flush()

    def flush(self) -> None:
        self.stream.flush()


def is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def in_notebook() -> bool:
    """Whether tqdm draws its bars as a notebook's widgets, which a log's lines would slow to one a
    minute: tqdm.autonotebook picks its notebook class only inside a Jupyter kernel."""
    return autonotebook.tqdm is not std.tqdm


def progress_bar(total: int, desc: str, initial: int = 0, unit: str = "step", disable: bool = False,
                 stream: IO[str] | None = None, every_s: float | None = None, **kwargs) -> tqdm:
    """tqdm's bar on `stream` (default: standard error) when it is a terminal, or in a notebook;
    otherwise the same bar as a dated line at most every `every_s` seconds (default
    `LOG_EVERY_S`), in ASCII."""
    stream = sys.stderr if stream is None else stream
    every_s = LOG_EVERY_S if every_s is None else every_s
    if disable or is_terminal(stream) or in_notebook():
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=disable, file=stream, **kwargs)
    # tqdm's monitor thread redraws a bar whose updates come slower than `maxinterval` (10 s by
    # default), which would space the lines by 10 s instead of `every_s`.
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=LogLines(stream), mininterval=every_s,
                maxinterval=max(every_s, 10.0), ascii=True, **kwargs)
