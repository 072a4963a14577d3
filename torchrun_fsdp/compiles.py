"""Every torch.compile compilation of this process, from Dynamo's own records.

torch 2.13 has no public API for compile metrics; these are the records behind `TORCH_LOGS` and
tlparse, read where Dynamo keeps them:
- `torch._dynamo.utils.get_compilation_metrics()`: one `CompilationMetrics` per compiled frame (a
  forward: `entire_frame_compile_time_s` is Dynamo's trace + AOTAutograd + Inductor for it,
  `compile_id` "F/A" is frame F's attempt A, so A > 0 is a recompile, with `recompile_reason`; the
  code after a graph break is a frame of its own, `torch_dynamo_resume_in_<function>_at_<line>`) and
  one per backward that AOTAutograd compiled lazily at its first backward
  (`is_forward` False, `duration_us`; a backward served by AOTAutograd's cache has none), with the
  persistent caches' hit and miss counts (`cache`: hit | miss | off, like JAX's);
- `torch._dynamo.utils.counters`: `stats.unique_graphs` (graphs compiled) and `graph_break`
  (reason -> count) for the run's totals.
An eager model never imports Dynamo, and nothing compiled is then nothing to report: `drain` looks
only when `torch._dynamo` is loaded.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Dict, List, Set, Tuple

COMPILE_ID = re.compile(r"(\d+)/(\d+)")
RESUME_PREFIX = "torch_dynamo_resume_in_"  # the frame Dynamo compiles for the code after a graph break


def _attempt(compile_id: Any) -> int:
    m = COMPILE_ID.search(str(compile_id or ""))
    return int(m.group(2)) if m else 0


def _cache(m: Any) -> str:
    """torch.compile's persistent caches (AOTAutograd's and Inductor's FX graph cache, local or remote):
    hit when they served the compile, miss when they were asked and had nothing, off when neither was."""
    def count(*names: str) -> int:
        return sum(int(getattr(m, n, 0) or 0) for n in names)
    hits = count("aotautograd_local_cache_hit_count", "aotautograd_remote_cache_hit_count",
                 "inductor_fx_local_cache_hit_count", "inductor_fx_remote_cache_hit_count")
    misses = count("aotautograd_local_cache_miss_count", "aotautograd_remote_cache_miss_count",
                   "inductor_fx_local_cache_miss_count", "inductor_fx_remote_cache_miss_count")
    return "miss" if misses else "hit" if hits else "off"


def event(m: Any) -> Dict[str, Any]:
    """One CompilationMetrics as a compile event (launch.core.compiles)."""
    forward = m.is_forward is not False
    recompile = _attempt(m.compile_id) > 0
    resumed = str(m.co_name or "").startswith(RESUME_PREFIX)
    if forward:
        seconds = m.entire_frame_compile_time_s
        what = f"the code after a graph break ({m.co_name})" if resumed else m.co_name
        if m.recompile_reason:
            reason = f"recompile of {what}: {str(m.recompile_reason).strip()}"
        else:
            reason = f"first compile of {what}"
        if m.fail_reason:
            reason += f" (failed: {m.fail_reason})"
    else:
        seconds = (m.duration_us / 1e6 if m.duration_us is not None
                   else (m.inductor_cumulative_compile_time_us or 0) / 1e6)
        reason = f"backward of frame {m.compile_id}, compiled at its first backward"
    return {"seconds": seconds, "reason": reason, "recompile": recompile, "compile_id": str(m.compile_id),
            "cache": _cache(m),
            "what": "forward" if forward else "backward", "function": m.co_name,
            "inductor_s": m.inductor_compile_time_s, "graph_breaks": m.num_graph_breaks if forward else None,
            "after_graph_break": resumed, "recompile_reason": m.recompile_reason}


class CompileLog:
    """Dynamo's records not reported yet (`drain`) and its totals (`totals`)."""

    def __init__(self) -> None:
        self._seen: Set[Tuple[Any, ...]] = set()

    def drain(self) -> List[Dict[str, Any]]:
        if "torch._dynamo" not in sys.modules:
            return []
        from torch._dynamo.utils import get_compilation_metrics
        out = []
        for m in get_compilation_metrics():
            key = (m.compile_id, m.is_forward, m.start_time_us, m.start_time, m.duration_us)
            if key in self._seen:
                continue
            self._seen.add(key)
            out.append(event(m))
        return out

    def totals(self) -> Dict[str, Any]:
        """graphs and graph_breaks from Dynamo's counters (null when nothing was compiled)."""
        if "torch._dynamo" not in sys.modules:
            return {"graphs": None, "graph_breaks": None}
        from torch._dynamo.utils import counters
        graphs = int(counters["stats"].get("unique_graphs", 0))
        breaks = int(sum(counters["graph_break"].values()))
        if not graphs and not breaks:
            return {"graphs": None, "graph_breaks": None}
        return {"graphs": graphs, "graph_breaks": breaks}
