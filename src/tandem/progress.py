"""Progress bars for long work (loading, answering, capturing, training, auditing, benchmarks):
tqdm's bar on a terminal; where stderr is a log (CI, nohup, a pipe) the same status as a plain
line at most every LOG_LINE_EVERY_S seconds, so an hour of training is never silent and a log
holds no carriage-return redraws."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm

LOG_LINE_EVERY_S = 30.0


class _Lines:
    """A stream for tqdm that writes each redraw as a line of its own."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress(iterable=None, **kwargs) -> tqdm:
    """tqdm(iterable, **kwargs) drawn as a bar on a terminal, as lines elsewhere (disable=True
    still turns it off)."""
    if sys.stderr.isatty():
        return tqdm(iterable, **kwargs)
    kwargs.setdefault("disable", False)
    kwargs["leave"] = True  # a log keeps its last line: a transient bar would end on its first
    return tqdm(iterable, file=_Lines(sys.stderr), mininterval=LOG_LINE_EVERY_S, maxinterval=LOG_LINE_EVERY_S,
                ascii=True, ncols=100, **kwargs)
