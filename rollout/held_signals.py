"""Signals around the embedded Ray's start and stop, in the main thread (the only one that may set handlers):
Ctrl-C and SIGTERM held while Ray starts or stops, and a default SIGTERM turned into `sys.exit` meanwhile."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Iterator

HELD = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM (unless ignored) until the block ends, then raise the first again for its handler:
    a `ray.init` interrupted part way leaves processes that `ray.shutdown` does not know. Setting the handlers
    again also undoes `ray.shutdown`'s reset of SIGTERM's, which Python would not notice."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = {sig: signal.getsignal(sig) for sig in HELD}
    handlers = {sig: handler for sig, handler in handlers.items() if handler not in (None, signal.SIG_IGN)}
    held: list[int] = []
    for sig in handlers:
        signal.signal(sig, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if held:
        signal.raise_signal(held[0])


def exit_on_sigterm() -> None:
    """While the embedded Ray runs, a default SIGTERM exits through `sys.exit`, as Ray's own handler does in the
    main thread, so that the exit hook stops Ray and removes its session directory."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit)


def default_sigterm_again() -> None:
    """Undo `exit_on_sigterm` once the embedded Ray has stopped (a library leaves no handler behind)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is _exit:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _exit(signum: int, frame: object) -> None:
    sys.exit(signum)
