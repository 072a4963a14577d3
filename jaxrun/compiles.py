"""Every XLA compilation of this process, from JAX's own monitoring events (`jax.monitoring`).

JAX reports each compilation through `jax.monitoring`: the duration of tracing a function
(`/jax/core/compile/jaxpr_trace_duration`), of lowering it to StableHLO
(`/jax/core/compile/jaxpr_to_mlir_module_duration`) and of the XLA compile
(`/jax/core/compile/backend_compile_duration`, which includes the persistent-cache lookup), and the
cache's outcome inside that compile (`/jax/compilation_cache/compile_requests_use_cache`, then
`/jax/compilation_cache/cache_hits` on a hit). `CompileMonitor` turns each backend compile into one
event for `launch.core.compiles`: seconds = its tracing + lowering + XLA time (tracing and lowering
matched by the function's name: `jit(f)` compiles what tracing `f` gave), `cache` hit, miss (the cache was asked and had nothing) or off.

A function traced but never compiled (`jax.eval_shape`) leaves a trace time that no compile
claims; it is dropped. `take_train_step` lets the engine report its own train-step compiles with
the wall time it measured around them and the cache outcome seen meanwhile.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional

import jax

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
BACKEND_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_REQUEST_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def _jit_name(module_name: str) -> str:
    """`jit(_train_step)` or `jit__train_step` (the module XLA compiles) -> `_train_step` (the function)."""
    if module_name.startswith("jit(") and module_name.endswith(")"):
        return module_name[4:-1]
    return module_name[4:] if module_name.startswith("jit_") else module_name


class CompileMonitor:
    """Listens to jax.monitoring for the life of the process; `drain` returns the compilations since."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: List[Dict[str, Any]] = []
        self._trace: Dict[str, float] = {}
        self._lower: Dict[str, float] = {}
        self._cache_asked = self._cache_hit = False
        jax.monitoring.register_event_listener(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)

    def close(self) -> None:
        jax.monitoring.unregister_event_listener(self._on_event)
        jax.monitoring.unregister_event_duration_listener(self._on_duration)

    def _on_event(self, event: str, **kwargs: Any) -> None:
        if event == CACHE_REQUEST_EVENT:
            self._cache_asked = True
        elif event == CACHE_HIT_EVENT:
            self._cache_hit = True

    def _on_duration(self, event: str, duration: float, **kwargs: Any) -> None:
        name = str(kwargs.get("fun_name", ""))
        with self._lock:
            if event == TRACE_EVENT:
                self._trace[name] = self._trace.get(name, 0.0) + duration
            elif event == LOWER_EVENT:
                self._lower[name] = self._lower.get(name, 0.0) + duration
            elif event == BACKEND_EVENT:
                function = _jit_name(name)
                trace = self._trace.pop(function, 0.0)
                lower = self._lower.pop(name, 0.0)
                cache = "hit" if self._cache_hit else ("miss" if self._cache_asked else "off")
                self._cache_asked = self._cache_hit = False
                self._events.append({"seconds": trace + lower + duration, "function": function, "cache": cache,
                                     "backend_s": duration, "trace_s": trace, "lower_s": lower,
                                     "reason": f"jit of {function}" + (" (persistent cache hit)" if cache == "hit" else "")})

    def drain(self) -> List[Dict[str, Any]]:
        with self._lock:
            out, self._events = self._events, []
            self._trace.clear()  # traced and never compiled (eval_shape): nothing to claim them
            self._lower.clear()
        return out

    def take_train_step(self, seconds: float, reason: str, recompile: bool) -> Dict[str, Any]:
        """The event of a train-step compile the engine timed itself (lower + compile): the wall time
        it measured, with the backend compile's cache outcome and time from the events seen meanwhile
        (which it replaces)."""
        seen = self.drain()
        ours: Optional[Dict[str, Any]] = next((e for e in seen if e["function"] == "_train_step"), None)
        rest = [e for e in seen if e is not ours]
        with self._lock:
            self._events = rest + self._events  # anything else compiled meanwhile keeps its own event
        return {"seconds": seconds, "function": "_train_step", "cache": ours["cache"] if ours else "off",
                "backend_s": ours["backend_s"] if ours else None, "reason": reason, "recompile": recompile}
