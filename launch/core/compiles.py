"""Compile records: every compilation of a trainer process, one `compile` record each, and their totals.

An engine reports the compilations it saw since it was last asked (`Engine.compile_events`, plain
dicts taken from the framework's own instrumentation: `jax.monitoring` events for JAX, Dynamo's
compilation metrics for torch.compile). The loop asks after each phase, stamps every event with
the step it happened in and the phase, writes it and totals them for the summary:

    compile  step      0 before the first step, else the step during which it happened
             scope     train (the train step: ahead of time, or inside a step: a new shape, a recompile),
                       eval (the held-out loss), setup (initialisation, restore, the matmul calibration)
             seconds   the compilation's time (JAX: tracing + lowering + XLA, or the wall time of the
                       ahead-of-time compile; torch.compile: Dynamo's whole-frame time for a forward, the
                       lazy backward's compile time)
             reason    why it compiled, in words
             recompile true for a compilation of code that had been compiled before (another shape, a
                       failed guard)
             and what the framework says: JAX `function`, `cache` (hit | miss | off: the persistent
             compilation cache), `backend_s`; torch.compile `compile_id`, `what` (forward | backward),
             `function`, `inductor_s`, `graph_breaks`, `recompile_reason`

Summary totals (`CompileLog.totals`):
    compile_s, compiles    the train scope: what the comparison calls the contender's compile (a
                           torch.compile forward and its lazy backward are one compile; both count in
                           the seconds)
    recompiles             train-scope compiles of code compiled before
    later_compile_s        the train scope's seconds after the run's first step (not in its start-up)
    cache_hits, cache_misses   JAX's persistent cache over the train scope (null for torch)
    other_compile_s, other_compiles   eval and setup
    and the engine's own totals (`Engine.compile_totals`: torch.compile's graphs and graph breaks).
Eager PyTorch compiles nothing: compiles 0 and compile_s 0.0, which the report shows as "none".
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set

SCOPES = ("setup", "train", "eval")


def counts_as_compile(rec: Dict[str, Any]) -> bool:
    """A record that counts as one compile (a torch.compile backward is part of its forward's)."""
    return rec.get("what") != "backward"


class CompileLog:
    """The compile records of one trainer process, written through `writer` as they are taken."""

    def __init__(self, writer: Any):
        self.writer = writer
        self.records: List[Dict[str, Any]] = []

    def take(self, engine: Any, scope: str, step: int) -> List[Dict[str, Any]]:
        """Ask `engine` for its compilations since the last call; write and keep each as a record of
        `scope` at `step`. Returns the new records."""
        new = []
        for event in engine.compile_events():
            rec = {"step": step, "scope": scope, "seconds": None, "reason": None, "recompile": False, **event}
            self.writer.write("compile", **rec)
            new.append(rec)
        self.records += new
        return new

    def train_steps(self) -> Set[int]:
        """Steps (>= 1) during which the train step compiled: they are not steady-state steps."""
        return {r["step"] for r in self.records if r["scope"] == "train" and r["step"] >= 1}

    def totals(self, engine_totals: Optional[Dict[str, Any]] = None, first_step: int = 1) -> Dict[str, Any]:
        """The summary's compile fields; `first_step` is the run's first step (`later_compile_s`: the
        train step's compile seconds after it, which time_to_first_step_s does not contain)."""
        train = [r for r in self.records if r["scope"] == "train"]
        other = [r for r in self.records if r["scope"] != "train"]
        cached = [r for r in train if r.get("cache") in ("hit", "miss")]
        return {
            "compile_s": sum(r["seconds"] or 0.0 for r in train),
            "compiles": sum(1 for r in train if counts_as_compile(r)),
            "recompiles": sum(1 for r in train if counts_as_compile(r) and r.get("recompile")),
            "later_compile_s": sum(r["seconds"] or 0.0 for r in train if r["step"] > first_step),
            "cache_hits": sum(1 for r in cached if r["cache"] == "hit") if cached else None,
            "cache_misses": sum(1 for r in cached if r["cache"] == "miss") if cached else None,
            "other_compile_s": sum(r["seconds"] or 0.0 for r in other),
            "other_compiles": sum(1 for r in other if counts_as_compile(r)),
            **(engine_totals or {}),
        }
