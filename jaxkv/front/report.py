"""What a command says on stderr as it works (stdout holds only the answer): its steps in
brackets, the seconds since the process started, and the programs it compiled or read from
JAX's persistent compilation cache."""

import os
import sys
import time

IMPORTED = time.perf_counter()
BUILT = "/jax/core/compile/backend_compile_duration"  # a program compiled, or read from the cache
READ = "/jax/compilation_cache/cache_hits"  # a program read from the persistent cache


def status(message: str) -> None:
    """One step of the command, on stderr."""
    print(f"[{message}]", file=sys.stderr, flush=True)


def since_start() -> float:
    """Seconds since this process started, the interpreter's start and the imports included
    (where there is no /proc: since this module was imported)."""
    try:
        with open("/proc/self/stat") as f:  # field 22, after the command's name in brackets
            ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - IMPORTED


class Compiles:
    """The programs JAX builds while open, as jax.monitoring reports them:
    `with Compiles() as c: ...`, then c.said() tells compiled programs from those read from the
    persistent compilation cache (a program already in this process is neither)."""

    def __enter__(self):
        import jax.monitoring

        self.built = self.read = 0
        jax.monitoring.register_event_duration_secs_listener(self._built)
        jax.monitoring.register_event_listener(self._read)
        return self

    def __exit__(self, *exc):
        import jax.monitoring

        jax.monitoring.unregister_event_duration_listener(self._built)
        jax.monitoring.unregister_event_listener(self._read)

    def _built(self, event, seconds, **_):
        self.built += event == BUILT

    def _read(self, event, **_):
        self.read += event == READ

    def said(self) -> str:
        compiled = self.built - self.read
        programs = lambda n: f"{n} program{'s' * (n != 1)}"  # noqa: E731
        if compiled and self.read:
            return f"compiled {programs(compiled)}, read {self.read} from the compile cache"
        if compiled:
            return f"compiled {programs(compiled)}"
        if self.read:
            return f"read {programs(self.read)} from the compile cache"
        return "nothing compiled"
