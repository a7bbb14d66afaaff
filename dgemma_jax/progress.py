"""Progress bars for the two slow parts of a start: reading (and quantizing) the weights, and compiling.

Both use `tqdm.auto`: a widget in a notebook (Colab), a text bar on a terminal. A Hub download shows
huggingface_hub's own bars.

    with compiling():            # counts each program jax compiles (or reads from its cache) meanwhile
        model.generate("...")

    load_hf(path, progress=tensor_bar("reading"))
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterable, Iterator

import jax.monitoring

# jax records this duration (with the program's name) once per program it compiles or reads from its
# persistent cache (`jax._src.dispatch.BACKEND_COMPILE_EVENT`)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def tensor_bar(desc: str = "reading weights") -> Callable[[Iterable], Iterator]:
    """A wrapper for the loaders' `progress=` argument: one bar step per parameter read."""
    from tqdm.auto import tqdm  # deferred: tqdm.auto probes for IPython, only worth it when a bar is shown

    return lambda items: iter(tqdm(items, desc=desc, unit=" tensors"))


@contextlib.contextmanager
def compiling(desc: str = "compiling", refresh_seconds: float = 1.0):
    """A bar counting the programs compiled while the block runs, with the last one's name and seconds,
    and the time elapsed (refreshed every `refresh_seconds`, so that a long compile shows it is alive).
    The bar's count is returned by the context (`as bar`: `bar.n`)."""
    from tqdm.auto import tqdm  # deferred: as above

    bar = tqdm(desc=desc, unit=" programs", bar_format="{desc}: {n} programs, {elapsed} {postfix}")
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
