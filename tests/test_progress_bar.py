"""Progress bars (vase/progress_bar.py): tqdm's bar on a terminal; in a log file one dated line per
redraw, no carriage returns, redraws spaced by the interval, and a training's logged steps adding
no lines of their own."""
from __future__ import annotations

import io
import re
import time

import vase.progress_bar as progress_module
from vase.config import build_config
from vase.progress_bar import LogLines, progress_bar
from vase.trainer import Trainer, prepare_run_dir

DATED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def lines_of(text: str) -> list[str]:
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert all(DATED.match(line) for line in lines), lines
    return lines


def test_off_a_terminal_each_redraw_is_a_dated_line_of_its_own():
    out = io.StringIO()
    bar = progress_bar(100, "vase grid", initial=10, stream=out, every_s=0.0)
    for _ in range(3):
        bar.update(1)
    bar.set_postfix(runs="0/6 done")
    bar.close()
    lines = lines_of(out.getvalue())
    # the opening line, three updates, the postfix's redraw and the closing one
    assert len(lines) == 6
    assert [re.search(r"(\d+)/100", line).group(1) for line in lines] == ["10", "11", "12", "13", "13", "13"]
    assert "runs=0/6 done" in lines[-1] and "vase grid" in lines[0]


def test_off_a_terminal_redraws_are_spaced_by_the_interval():
    out = io.StringIO()
    bar = progress_bar(10_000, "vase train", stream=out, every_s=3600.0)
    for _ in range(10_000):
        bar.update(1)
    bar.close()
    lines = lines_of(out.getvalue())
    assert len(lines) == 2 and " 0/10000 " in lines[0] and " 10000/10000 " in lines[1]


def test_on_a_terminal_it_is_tqdms_bar():
    out = Terminal()
    bar = progress_bar(5, "vase train", stream=out)
    bar.update(5)
    bar.close()
    assert "\r" in out.getvalue() and not DATED.match(out.getvalue().lstrip("\r"))


def test_in_a_notebook_it_is_tqdms_bar(monkeypatch):
    import tqdm.autonotebook

    class Widget(tqdm.std.tqdm):  # what tqdm.autonotebook holds inside a Jupyter kernel
        pass

    monkeypatch.setattr(tqdm.autonotebook, "tqdm", Widget)
    out = io.StringIO()  # a kernel's standard error is no terminal
    bar = progress_bar(5, "vase train", stream=out, every_s=3600.0)
    bar.update(5)
    bar.close()
    assert "\r" in out.getvalue() and not DATED.match(out.getvalue().lstrip("\r"))


def test_log_lines_drop_tqdms_clearing_and_keep_text():
    out = io.StringIO()
    lines = LogLines(out, clock=lambda: 0.0)
    for text in ("\r" + " " * 40, "\n", "\rbar 3/5   ", "paused SDA-disentangled-s0"):
        lines.write(text)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(0.0))
    assert out.getvalue() == f"{stamp} bar 3/5\n{stamp} paused SDA-disentangled-s0\n"


def test_a_training_in_a_log_writes_lines_and_no_line_per_logged_step(tmp_path, capsys, monkeypatch):
    # 8 steps logged every step: with eq. 8's loss redrawn at each logged step, the log would
    # get a line per step; it gets the opening and closing lines only.
    from tests.test_callbacks import SETTINGS  # two sprite environments of 4 steps

    cfg = build_config("cpu", SETTINGS + ["train.log_every=1", f"data.root={tmp_path / 'data'}"])
    run = tmp_path / "run"
    trainer = Trainer(cfg, run, progress=True, callbacks=[])
    prepare_run_dir(run, cfg, resume=False)
    capsys.readouterr()  # the sprites' rendering bars
    trainer.train()
    bars = [line for line in lines_of(capsys.readouterr().err) if "vase train" in line]
    assert len(bars) <= 3 and " 0/8 " in bars[0] and " 8/8 " in bars[-1]

    monkeypatch.setattr(progress_module, "LOG_EVERY_S", 0.0)
    again = tmp_path / "again"
    trainer = Trainer(cfg, again, progress=True, callbacks=[])
    prepare_run_dir(again, cfg, resume=False)
    capsys.readouterr()
    trainer.train()
    bars = [line for line in lines_of(capsys.readouterr().err) if "vase train" in line]
    assert len(bars) >= 9  # a line per step when the interval is 0
