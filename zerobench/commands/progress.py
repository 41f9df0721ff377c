"""A progress bar with an ETA for the commands that can take a while (estimate,
predict, plot, compare), shown only once they have taken more than a few seconds and
only on a terminal: quick commands and logs stay as they were."""

from __future__ import annotations

import threading
import time


class Progress:
    """``with Progress(total, "estimate") as p: ... p.advance("config 3")``.

    ``total`` may be None until the work knows it (:meth:`set_total`). The bar appears
    ``after_s`` seconds after the start (a timer thread), below the lines printed
    meanwhile; on a console that is not a terminal it never appears."""

    def __init__(self, total: int | None, what: str, after_s: float = 2.0, console=None):
        self.total, self.what, self.after_s = total, what, after_s
        self.done, self.description = 0, what
        self._console = console
        self._bar = None  # rich.progress.Progress once shown
        self._task = None
        self._lock = threading.Lock()  # the timer thread and the caller both touch the bar
        self._timer: threading.Timer | None = None
        self._started = time.monotonic()

    def __enter__(self) -> Progress:
        self._timer = threading.Timer(self.after_s, self._show)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _show(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        with self._lock:
            console = self._console or Console()
            if self._bar is not None or not console.is_terminal:
                return
            self._bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=True)
            self._task = self._bar.add_task(self.description, total=self.total, completed=self.done)
            self._bar.start()

    def set_total(self, total: int) -> None:
        with self._lock:
            self.total = total
            if self._bar is not None:
                self._bar.update(self._task, total=total)

    def advance(self, description: str | None = None, steps: int = 1) -> None:
        """``steps`` more items done; ``description`` says what comes next."""
        with self._lock:
            self.done += steps
            self.description = f"{self.what}: {description}" if description else self.description
            if self._bar is not None:
                self._bar.update(self._task, completed=self.done, description=self.description)

    def print(self, line: str) -> None:
        """Print a line (above the bar, when it shows: rich redirects stdout meanwhile)."""
        print(line, flush=True)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            if self._bar is not None:
                self._bar.stop()
                self._bar = None
