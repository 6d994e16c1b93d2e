"""Live progress of a run: one rich progress bar per dataset on a terminal, plain lines otherwise.

The caller owns the polling (``read_state`` every second or so) and hands the states to
``ProgressView.update``, and each finished dataset's final state to ``ProgressView.finish``, so
the last frame shows every dataset as it ended; this module only keeps rates and renders. Plain
mode exists for ``docker compose logs`` and CI, where a redrawn bar would be hundreds of garbage
lines: it writes at most one batch of lines every ``PLAIN_INTERVAL_S``, plus one whenever a
dataset changes state.

While bars are live, log records go through rich's own handler on the bars' console (and Python
warnings through logging), so a line is printed above the bars instead of through them.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from typing import IO, Any

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, Progress, TaskID, TextColumn

from common.batches import line, summary
from common.batches import states as batch_states
from common.throttle import ThrottleSnapshot
from producer.state import DatasetState

#: Plain mode: seconds between two progress batches (state changes are printed at once).
PLAIN_INTERVAL_S = 10.0
#: How a finished dataset's bar says why it ended (``Summary.end_reason``).
END_WORDS = {"budget": "budget", "budget_usd": "$ budget", "run_budget": "run $ budget", "complete": "all prompts"}
#: Rates are measured over this much history: long enough to smooth the lumpy arrival of rows
#: (one row can carry 30k tokens), short enough to show a stall within a minute.
RATE_WINDOW_S = 30.0


class TokenRate:
    """Kept tokens per second over a sliding window of (time, kept tokens) observations.

    Tolerates irregular sampling, repeated timestamps and a counter that goes back to zero (the
    dataset was reset for a new run: history is dropped).
    """

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def observe(self, t_s: float, kept_tokens: int) -> float | None:
        """Records one observation; returns tokens/s, or None until two observations exist."""
        samples = self._samples
        if samples and kept_tokens < samples[-1][1]:
            samples.clear()
        if not samples or t_s > samples[-1][0]:
            samples.append((t_s, kept_tokens))
        # Keep exactly one observation older than the window, so the rate spans the full window.
        while len(samples) > 2 and t_s - samples[1][0] >= self.window_s:
            samples.popleft()
        return self.rate()

    def rate(self) -> float | None:
        if len(self._samples) < 2:
            return None
        (t0, k0), (t1, k1) = self._samples[0], self._samples[-1]
        return (k1 - k0) / (t1 - t0)


def eta_s(state: DatasetState, rate: float | None) -> float | None:
    """Seconds until the budget is used at the current rate; None when unknown or not running."""
    if state.state != "active" or not rate or rate <= 0 or not state.limit:
        return None
    return max(0.0, state.limit - state.kept_tokens) / rate


def fmt_tokens(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def fmt_usd(st: DatasetState) -> str:
    """Dollars spent (every billed answer) against the dataset's limit and the run's, if any."""
    text = f"${st.spent_usd:,.2f}" + (f"/${st.budget_usd:,.2f}" if st.budget_usd else "")
    if st.run_budget_usd:
        text += f" run ${st.run_spent_usd:,.2f}/${st.run_budget_usd:,.2f}"
    return text


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # closed stream
        return False


class ProgressView:
    """Renders dataset states; ``live=None`` picks bars for a terminal and plain lines otherwise."""

    def __init__(self, datasets: list[str], *, live: bool | None = None, stream: IO[str] | None = None) -> None:
        self._stream: IO[str] = stream if stream is not None else sys.stderr
        self.live = _is_terminal(self._stream) if live is None else live
        self._datasets = list(datasets)
        self._rates: dict[str, TokenRate] = {}
        self._latest: dict[str, DatasetState] = {}
        self._closed = False
        # plain mode: when the last batch went out (state time) and what each line last said
        self._last_batch_s: float | None = None
        self._printed: dict[str, tuple[str, int, int, int]] = {}
        self._printed_state: dict[str, str] = {}
        self._progress: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        #: Datasets finished (``finish``): their final state stays, later updates are ignored.
        self._finished: dict[str, str] = {}
        self._logging: _LiveLogging | None = None
        #: Open batches were shown last time (a row or line says "none open" once they all landed).
        self._batches_shown = False
        #: Each dataset's open batches and their requests, as the last update saw them: a dataset
        #: whose admission ended shows what it still has out while the next one runs.
        self._out: dict[str, tuple[int, int]] = {}
        if self.live:
            # force_terminal: live=True on a non-tty stream is a deliberate request for bars.
            console = Console(file=self._stream, force_terminal=True)
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(bar_width=32),
                TextColumn("{task.fields[used]}", justify="right"),
                TextColumn("{task.fields[rows]}", justify="right"),
                TextColumn("{task.fields[failed]}", justify="right"),
                TextColumn("{task.fields[rate]}", justify="right"),
                TextColumn("{task.fields[eta]}", justify="right"),
                TextColumn("{task.fields[state]}"),
                console=console,
                refresh_per_second=2,
            )
            for ds in self._datasets:
                self._add_task(ds)
            self._progress.start()
            self._logging = _LiveLogging(console)

    # --- public ----------------------------------------------------------------------------

    def update(self, states: list[DatasetState], throttle: ThrottleSnapshot | None = None,
               batches: list[dict[str, Any]] | None = None) -> None:
        """``throttle``: the fleet's upstream throttle (``FleetThrottle.snapshot``), shown as one
        more row: requests in flight against the current limit, and the share answered 429.
        ``batches``: the open Batch API batches (``common/batches.open_batches``; None in a run
        with no batch-mode dataset), one more row: how many, their requests, the oldest's age and
        how many are in each state."""
        if self._closed:
            return
        states = [st for st in states if st.dataset not in self._finished]
        if batches is not None:
            self._out = batches_out(batches)
        rates: dict[str, float | None] = {}
        for st in states:
            rates[st.dataset] = self._rates.setdefault(st.dataset, TokenRate()).observe(st.t_s, st.kept_tokens)
            self._latest[st.dataset] = st
        if self._progress is not None:
            for st in states:
                self._render_bar(st, rates[st.dataset])
            if throttle is not None:
                self._render_throttle(throttle)
            if batches is not None:
                self._render_batches(batches)
        else:
            self._plain(states, rates, throttle, batches)

    def finish(self, state: DatasetState, end_reason: str = "", throttle: ThrottleSnapshot | None = None,
               batches: list[dict[str, Any]] | None = None) -> None:
        """The dataset's final state (read once it was finalized): its bar (or a last plain line)
        shows these figures and "done" from now on, whatever a later, older read says. ``throttle``
        and ``batches``: the fleet's throttle and open batches then, so the last dataset's end
        leaves those rows current too."""
        if self._closed:
            return
        self._finished[state.dataset] = end_reason
        self._latest[state.dataset] = state
        rate = self._rates.setdefault(state.dataset, TokenRate()).rate()
        if self._progress is not None:
            self._render_bar(state, rate)
            if throttle is not None:
                self._render_throttle(throttle)
            if batches is not None:
                self._render_batches(batches)

    def notice(self, text: str) -> None:
        """A one-off line between the bars (or the plain lines), e.g. "Redis unreachable, retrying"."""
        if self._closed:
            return
        if self._progress is not None:
            self._progress.console.print(text)
            return
        self._write([f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}"])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._progress is not None:
            try:
                self._progress.refresh()
                self._progress.stop()
            finally:
                if self._logging is not None:
                    self._logging.stop()
            return
        # A final line for every dataset whose last printed line is out of date.
        lines = [
            self._line(st, self._rates[ds].rate())
            for ds, st in self._latest.items()
            if st.state and self._printed.get(ds) != _signature(st)
        ]
        self._write(lines)

    def __enter__(self) -> ProgressView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- live bars ---------------------------------------------------------------------------

    def _add_task(self, dataset: str) -> TaskID:
        assert self._progress is not None
        task = self._progress.add_task(
            dataset, total=1, completed=0, used="-", rows="rows 0", failed="failed 0", rate="-", eta="ETA -",
            state="waiting"
        )
        self._tasks[dataset] = task
        return task

    def _render_bar(self, st: DatasetState, rate: float | None) -> None:
        assert self._progress is not None
        task = self._tasks.get(st.dataset)
        if task is None:
            task = self._add_task(st.dataset)
        if not st.state:
            return  # not opened yet: keep "waiting"
        done = st.dataset in self._finished
        if done:
            eta, state = "", _done_word(self._finished[st.dataset])
        else:
            eta = "ETA " + (fmt_duration(eta_s(st, rate)) if st.state == "active" else "done")
            state = self._state_word(st)
        self._progress.update(
            task,
            total=max(st.limit, 1),
            completed=min(st.kept_tokens, max(st.limit, 1)),
            used=f"{fmt_tokens(st.kept_tokens)}/{fmt_tokens(st.limit)} tok {100 * st.budget_fraction:5.1f}% "
            + fmt_usd(st),
            rows=f"rows {st.rows:,}",
            failed=f"failed {st.failed:,}",
            rate=f"{fmt_tokens(rate)} tok/s" if rate is not None else "- tok/s",
            eta=eta,
            state=state,
        )

    def _render_throttle(self, t: ThrottleSnapshot) -> None:
        assert self._progress is not None
        task = self._tasks.get(_THROTTLE_ROW)
        if task is None:
            task = self._add_task(_THROTTLE_ROW)
        limit = t.limit if t.limit is not None else max(t.in_flight, 1)
        self._progress.update(
            task, total=max(limit, 1), completed=min(t.in_flight, limit),
            used=f"in flight {t.in_flight:,}/{_fmt_limit(t.limit)}", rows=f"429s {100 * t.throttled_share:.1f}%",
            failed=f"of {t.ok + t.throttled:,}", rate="", eta="", state=_throttle_word(t),
        )

    def _render_batches(self, batches: list[dict[str, Any]]) -> None:
        assert self._progress is not None
        if not batches and not self._batches_shown:
            return  # no batch submitted yet: no row
        self._batches_shown = True
        task = self._tasks.get(_BATCHES_ROW)
        if task is None:
            task = self._add_task(_BATCHES_ROW)
        requests = sum(b["requests"] for b in batches)
        answered = sum(b["completed"] + b["failed"] for b in batches)
        oldest = max((b["age_s"] for b in batches), default=None)
        self._progress.update(
            task, total=max(requests, 1), completed=min(answered, requests),
            used=f"{len(batches):,} open, {requests:,} requests", rows=f"oldest {fmt_duration(oldest)}",
            failed=f"answered {answered:,}", rate="", eta="", state=_batch_states(batches) or "none open",
        )

    # --- plain lines -------------------------------------------------------------------------

    def _plain(self, states: list[DatasetState], rates: dict[str, float | None],
               throttle: ThrottleSnapshot | None = None, batches: list[dict[str, Any]] | None = None) -> None:
        if not states:
            return
        now = max(st.t_s for st in states)
        changed = {st.dataset for st in states if st.state and st.state != self._printed_state.get(st.dataset)}
        due = self._last_batch_s is None or now - self._last_batch_s >= PLAIN_INTERVAL_S
        batch = [st for st in states if st.dataset in changed or (due and st.state == "active")]
        if not batch:
            return
        if due:
            self._last_batch_s = now
        lines = [self._line(st, rates[st.dataset]) for st in batch]
        if due and throttle is not None and any(st.state == "active" for st in batch):
            lines.append(throttle_line(throttle, now))
        if due and batches is not None and (batches or self._batches_shown):
            # Every due batch while any is open, and once more when the last one landed.
            self._batches_shown = bool(batches)
            lines.append(batches_line(batches, now))
        self._write(lines)

    def _line(self, st: DatasetState, rate: float | None) -> str:
        self._printed[st.dataset] = _signature(st)
        self._printed_state[st.dataset] = st.state
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st.t_s))
        rate_text = f"{rate:.1f}" if rate is not None else "-"
        word = "done" if st.dataset in self._finished else _state_word(st)
        return (
            f"{stamp} progress dataset={st.dataset} state={word} "
            f"kept_tokens={st.kept_tokens}/{st.limit} ({100 * st.budget_fraction:.1f}%) "
            f"spent_usd={st.spent_usd:.4f}/{st.budget_usd or '-'} run_spent_usd={st.run_spent_usd:.4f}/"
            f"{st.run_budget_usd or '-'} rows={st.rows} failed={st.failed} in_flight={st.in_flight} queued={st.queued} "
            f"rate_tok_s={rate_text} eta={fmt_duration(eta_s(st, rate))}"
            + (f" batches_out={self._out[st.dataset][0]}" if st.dataset in self._out else "")
        )

    def _state_word(self, st: DatasetState) -> str:
        """Its budget's state, and the batches it has out (``active · 3 batches out (120 requests)``)."""
        word = _state_word(st)
        if st.dataset in self._out:
            n, requests = self._out[st.dataset]
            word += f" · {n} batch{'es' if n > 1 else ''} out ({requests:,} requests)"
        return word

    def _write(self, lines: list[str]) -> None:
        if lines:
            self._stream.write("".join(line + "\n" for line in lines))
            self._stream.flush()


_THROTTLE_ROW = "upstream"
_BATCHES_ROW = "batches"


def _batch_states(batches: list[dict[str, Any]]) -> str:
    return ", ".join(f"{s} {n}" for s, n in batch_states(batches).items())


def _fmt_limit(limit: float | None) -> str:
    return "unbounded" if limit is None else f"{limit:,.0f}"


def _throttle_word(t: ThrottleSnapshot) -> str:
    return f"paused {t.pause_ms_left / 1000:.1f}s" if t.pause_ms_left else "sending"


def batches_out(batches: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """Open batches by dataset: how many, and their requests."""
    out: dict[str, tuple[int, int]] = {}
    for b in batches:
        n, requests = out.get(b["dataset"], (0, 0))
        out[b["dataset"]] = (n + 1, requests + b["requests"])
    return out


def batch_lines(batches: list[dict[str, Any]]) -> list[str]:
    """Open Batch API batches (``common/batches.open_batches``): a summary, then one line each."""
    if not batches:
        return []
    return [f"batches: {summary(batches)}", *(f"  {line(b)}" for b in sorted(batches, key=lambda b: -b["age_s"]))]


def batches_line(batches: list[dict[str, Any]], t_s: float) -> str:
    """One plain line for the open batches (``batches=0`` once the last one landed)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t_s))
    oldest = max((b["age_s"] for b in batches), default=0.0)
    states = ",".join(f"{s}:{n}" for s, n in batch_states(batches).items())
    return (f"{stamp} batches open={len(batches)} requests={sum(b['requests'] for b in batches)} "
            f"answered={sum(b['completed'] + b['failed'] for b in batches)} oldest_s={oldest:.0f} "
            f"states={states or '-'}")


def throttle_line(t: ThrottleSnapshot, t_s: float) -> str:
    """One plain line for the fleet's upstream throttle."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t_s))
    return (
        f"{stamp} throttle limit={_fmt_limit(t.limit)} in_flight={t.in_flight} "
        f"throttled_share={100 * t.throttled_share:.1f}% answers={t.ok + t.throttled} "
        f"paused_ms={t.pause_ms_left}"
    )


def _state_word(st: DatasetState) -> str:
    return st.state or "waiting"


def _done_word(end_reason: str) -> str:
    why = END_WORDS.get(end_reason, end_reason)
    return f"done: {why}" if why else "done"


class _LiveLogging:
    """The root logger's handlers, swapped for rich's handler on the live console until ``stop``.

    rich redirects ``sys.stderr`` while live, but a line written in pieces, or by a handler that
    holds the real stderr, lands between the bars. ``RichHandler`` prints through the console, which
    draws the line above the bars and the bars again below it. The filters of the handlers it
    stands in for move with it: the API key is scrubbed as before (common/logs.py)."""

    def __init__(self, console: Console) -> None:
        self._root = logging.getLogger()
        self._saved = self._root.handlers[:]
        handler = RichHandler(console=console, show_path=False, markup=False, rich_tracebacks=False,
                              log_time_format="%Y-%m-%d %H:%M:%S")
        handler.setFormatter(logging.Formatter("%(processName)s %(name)s: %(message)s"))
        for old in self._saved:
            for flt in old.filters:
                handler.addFilter(flt)
        self.handler = handler
        self._root.handlers[:] = [handler]
        # warnings.warn writes to stderr by itself; through logging it reaches the handler above.
        self._warnings_were_captured = getattr(logging, "_warnings_showwarning", None) is not None
        logging.captureWarnings(True)

    def stop(self) -> None:
        if self._root.handlers == [self.handler]:
            self._root.handlers[:] = self._saved
        if not self._warnings_were_captured:
            logging.captureWarnings(False)


def _signature(st: DatasetState) -> tuple[str, int, int, int]:
    return (st.state, st.kept_tokens, st.rows, st.failed)
