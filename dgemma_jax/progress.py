"""Progress bars for the two slow parts of a start: reading (and quantizing) the weights, and compiling.

Both use `tqdm.auto`: a widget in a notebook (Colab), a text bar on a terminal. A Hub download shows
huggingface_hub's own bars. The commands (`dgemma generate`, `chat`, `serve`) report both through a
`StartReport`: bars on a terminal, a few plain lines on stderr when it is a pipe or a file.

    with compiling():            # counts each program jax compiles (or reads from its cache) meanwhile
        model.generate("...")

    load_hf(path, progress=tensor_bar("reading"))
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Callable, Iterable, Iterator

import jax.monitoring

from dgemma_jax.compile_cache import CompileCounter

# jax records this duration (with the program's name) once per program it compiles or reads from its
# persistent cache (`jax._src.dispatch.BACKEND_COMPILE_EVENT`)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def tensor_bar(desc: str = "reading weights") -> Callable[[Iterable], Iterator]:
    """A wrapper for the loaders' `progress=` argument: one bar step per parameter read."""
    from tqdm.auto import tqdm  # deferred: tqdm.auto probes for IPython, only worth it when a bar is shown

    return lambda items: iter(tqdm(items, desc=desc, unit=" tensors"))


@contextlib.contextmanager
def compiling(desc: str = "compiling", refresh_seconds: float = 1.0, leave: bool = True):
    """A bar counting the programs compiled while the block runs, with the last one's name and seconds,
    and the time elapsed (refreshed every `refresh_seconds`, so that a long compile shows it is alive).
    The bar's count is returned by the context (`as bar`: `bar.n`). leave=False: the bar clears itself
    when the block ends."""
    from tqdm.auto import tqdm  # deferred: as above

    bar = tqdm(desc=desc, unit=" programs", bar_format="{desc}: {n} programs, {elapsed} {postfix}", leave=leave)
    lock = threading.Lock()

    def on_duration(event: str, seconds: float, **kwargs) -> None:
        if event != COMPILE_EVENT:
            return
        with lock:
            bar.set_postfix_str(f"(last: {kwargs.get('fun_name', '?')}, {seconds:.1f} s)", refresh=False)
            bar.update(1)

    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(refresh_seconds):
            with lock:
                bar.refresh()

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    ticker = threading.Thread(target=tick, name="dgemma-compile-bar", daemon=True)
    ticker.start()
    try:
        yield bar
    finally:
        stop.set()
        ticker.join()
        jax.monitoring.unregister_event_duration_listener(on_duration)
        bar.close()


class StartReport:
    """Load and compile progress of a command on `stream` (stderr): a terminal gets bars (`tensor_bar`,
    a compile bar that clears itself when done), anything else a few lines: what is loading and what is
    compiling (once it has taken `announce_after` seconds), what was loaded in how long, one line per
    program that took a second or more, and the count after. The line about a quick load (one not
    announced) waits until a program compiles, a compile block ends or a slow step is announced: an
    input the command refuses right after a quick load gets its one error line alone.

        report = StartReport()
        with report.loading("bundled model") as wrap:     # wrap: the loaders' `progress=`
            load_checkpoint(None, progress=wrap)
        with report.compiling():
            engine.generate(...)
    """

    def __init__(self, stream=None, enabled: bool = True, announce_after: float = 3.0):
        self.stream = sys.stderr if stream is None else stream
        self.enabled, self.announce_after = enabled, announce_after
        self.tty = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self._compiled_once = False
        self._held: list[str] = []  # lines waiting for the run to go on (see the class docstring)
        self._lock = threading.Lock()

    def _line(self, text: str | None = None) -> None:
        """The held lines, then `text` (None: only the held ones)."""
        with self._lock:
            for line in self._held + ([text] if text is not None else []):
                print(f"dgemma: {line}", file=self.stream, flush=True)
            self._held.clear()

    def _hold(self, text: str) -> None:
        with self._lock:
            self._held.append(text)

    @contextlib.contextmanager
    def _announced(self, text: str):
        """`text` as a line once the block has run `announce_after` seconds (never for a block that ends
        sooner, an error included); yields an Event set once the line is out."""
        fired, ended, gate = threading.Event(), [False], threading.Lock()

        def announce():
            with gate:  # the block's end and the line cannot cross: once it has ended, no line
                if not ended[0]:
                    self._line(text)
                    fired.set()

        timer = threading.Timer(self.announce_after, announce)
        timer.daemon = True
        timer.start()
        try:
            yield fired
        finally:
            timer.cancel()
            with gate:
                ended[0] = True

    @contextlib.contextmanager
    def loading(self, what: str):
        """Yields the `progress=` wrapper for the loaders (None when off). A terminal: a bar over the
        tensors (a Hugging Face checkpoint); else a line once it has taken `announce_after` seconds, and one
        with the time and tensor count after (held: see the class)."""
        if not self.enabled:
            yield None
            return
        count = [0]

        def counted(items):
            for x in items:
                count[0] += 1
                yield x

        t0 = time.perf_counter()
        with self._announced(f"loading {what} ...") as announced:
            yield tensor_bar(f"reading {what}") if self.tty else counted
        read = f", {count[0]} tensors read" if count[0] else ""
        done = f"loaded {what} in {time.perf_counter() - t0:.1f} s{read}"
        self._line(done) if announced.is_set() else self._hold(done)  # a slow load: said at once

    @contextlib.contextmanager
    def compiling(self):
        """Around a call that may compile: a terminal gets `compiling`'s bar (cleared when the block ends);
        anything else a line once the first such call has taken `announce_after` seconds, one per program
        that took a second or more, and one with the count and seconds after a call that compiled (the
        first always, later ones from a second)."""
        if not self.enabled:
            yield
            return
        if self.tty:
            with compiling(leave=False):
                yield
            return
        first = not self._compiled_once
        self._compiled_once = True
        counter = CompileCounter()

        def on_duration(event: str, seconds: float, **kwargs) -> None:
            if event != COMPILE_EVENT:
                return
            name = kwargs.get("fun_name", "a program")
            self._line(f"{name} compiled (or read from the cache) in {seconds:.1f} s" if seconds >= 1.0 else None)

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        try:
            with self._announced("compiling the programs (or reading them from the compilation cache) ...") \
                    if first else contextlib.nullcontext():
                yield
        finally:
            jax.monitoring.unregister_event_duration_listener(on_duration)
        c = counter.counts()
        self._line()
        if (c["compiled"] or c["cache_hits"]) and (first or c["compile_s"] >= 1.0):
            self._line(f"{c['compiled']} program(s) compiled in {c['compile_s']:.1f} s, {c['cache_hits']} read from "
                       "the compilation cache")
