"""The report's projection: each contender's step time, throughput and efficiency at device counts it
was not measured at (`report.project_to`, `scaleout report RUN_DIR --project 16,32,64`).

Per contender (the cells of the sweep's first `sweep.extra` combination), every finished cell
becomes a point of `launch.core.projection`: its measured step time, tokens per step, the bytes
each device sends per step on each interconnect tier (`launch.core.collectives`, from the cell's
model, mesh and batch) and, where the cell was profiled, the collective and overhead shares of its
traced steps. The cost model fitted to them is evaluated at each requested device count with the
mesh the contender's parallel settings give there; the largest leave-one-out error e over the measured
device counts gives the error band (projected / (1 + e) to projected / (1 - e)) and decides whether a
projection is trustworthy (`report.project_max_error`). The section also names the device count at
which each contender's efficiency falls below `report.efficiency_floor` and compares every pair of
contenders at the projected counts.

How the section is shown (markdown and `projection.png`): `launch.report.projection_view`. Nothing here
needs jax or torch.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from launch.config import ConfigError, contenders, resolve_parallel
from launch.config.schema import ModelConfig, ReportConfig
from launch.core import collectives, interconnects
from launch.core.projection import Fit, Point, ProjectionError, Table, fit, leave_one_out
from launch.report import compare

SEARCH_LIMIT = 1 << 17  # the efficiency-floor search stops here
CELL_NAME = re.compile(r"^(?P<contender>.+?)-d(?P<devices>\d+)(?:-(?P<variant>.+))?$")
SIMULATED = ("the devices are simulated CPU devices sharing the host's cores: compute per device is not constant as "
             "the model assumes (more devices share the same cores) and the 'bandwidth' is the speed of copies between "
             "processes of one machine, so these projections exercise the method and say nothing about GPUs or TPUs")


def contender_of(row: Dict[str, Any]) -> str:
    """A cell's contender: the one its report row names, else the one its config records
    (`launch.config.contenders.name_of`, which also names cells written before contenders existed)."""
    if row.get("contender"):
        return str(row["contender"])
    cfg = row.get("_cfg") or {"framework": row.get("framework")}
    return contenders.name_of(cfg)


def variant_of(row: Dict[str, Any]) -> str:
    """The sweep.extra part of a cell's name (`jax-d2-remat_full` -> `remat_full`), '' if none."""
    if "variant" in row and row["variant"] is not None:
        return str(row["variant"])
    m = CELL_NAME.match(str(row.get("cell", "")))
    return (m.group("variant") or "") if m else ""


def settings(rows: List[Dict[str, Any]], project_to: Optional[List[int]] = None) -> Dict[str, Any]:
    """The report.* keys the projection reads, from the first cell's config (older configs: defaults);
    `project_to` (the CLI's --project) replaces report.project_to."""
    defaults = ReportConfig()
    given = dict((rows[0].get("_cfg") or {}).get("report") or {}) if rows else {}
    out = {k: given.get(k, getattr(defaults, k)) for k in
           ("project_to", "project_max_error", "efficiency_floor", "devices_per_node", "network")}
    if project_to is not None:
        out["project_to"] = list(project_to)
    out["project_to"] = sorted(int(n) for n in out["project_to"])
    return out


# --------------------------------------------------------------------------- cells -> points

def _model(cfg: Dict[str, Any]) -> ModelConfig:
    known = set(ModelConfig.__dataclass_fields__)
    return ModelConfig(**{k: v for k, v in (cfg.get("model") or {}).items() if k in known})


def _mesh(cfg: Dict[str, Any], devices: int) -> Dict[str, int]:
    p = cfg.get("parallel") or {}
    data, fsdp, tensor = resolve_parallel(devices, int(p.get("data", 1)), int(p.get("fsdp", -1)), int(p.get("tensor", 1)))
    return {"data": data, "fsdp": fsdp, "tensor": tensor}


def node_size(cfg: Dict[str, Any], device_kind: str, largest: int, override: Optional[int]) -> Tuple[int, str]:
    """Devices per fast-interconnect domain, and where that number comes from."""
    if override:
        return int(override), "report.devices_per_node"
    if interconnects.is_tpu(device_kind) and interconnects.tpu_domain(device_kind):
        return int(interconnects.tpu_domain(device_kind)), f"the largest {device_kind} slice"
    if cfg.get("target") == "slurm":
        return int((cfg.get("slurm") or {}).get("devices_per_node", 8)), "slurm.devices_per_node"
    return largest, f"the largest cell run on one host ({largest}); set report.devices_per_node to say more"


def layout(cfg: Dict[str, Any], devices: int, global_batch: int, per_node: int) -> Dict[str, Any]:
    """Mesh, collectives and bytes per tier of `cfg`'s contender at `devices`; raises ConfigError when its
    parallel settings or batch do not fit that count."""
    mesh = _mesh(cfg, devices)
    train = cfg.get("train") or {}
    accum = int(train.get("grad_accum", 1))
    model, framework = _model(cfg), str(cfg.get("framework"))
    dp = mesh["data"] * mesh["fsdp"]
    # the mesh-dependent rules of launch.config.validate (its other rules hold for every N of a valid cell)
    if global_batch < 1 or global_batch % (dp * accum):
        raise ConfigError(f"a global batch of {global_batch} sequences does not split over {dp} data-parallel ranks "
                          f"x train.grad_accum={accum}")
    if framework == "jax" and model.d_model % mesh["fsdp"]:
        raise ConfigError(f"model.d_model={model.d_model} is not divisible by the fsdp axis size {mesh['fsdp']} (JAX "
                          "shards d_model over fsdp)")
    if any(n % mesh["tensor"] for n in (model.n_heads, model.d_ff, model.vocab_size)):
        raise ConfigError(f"the tensor axis size {mesh['tensor']} does not divide n_heads, d_ff and vocab_size")
    coll = collectives.per_step(model, framework, mesh, global_batch, accum, per_node)
    return {"mesh": mesh, "collectives": coll, "traffic": collectives.by_tier(coll)}


def _point(row: Dict[str, Any], per_node: int) -> Point:
    cfg = row["_cfg"]
    step = row.get("step_time_mean_s") or row.get("step_time_p50_s")
    tokens = row["tokens_per_s"] * step
    lay = layout(cfg, row["devices"], int(row.get("global_batch") or cfg["train"]["global_batch"]), per_node)
    share = overhead = None
    prof = row.get("_profile") or {}
    mean = prof.get("mean") or {}
    if not prof.get("error") and mean.get("trace_s"):
        share = (mean.get("collectives") or 0.0) / mean["trace_s"]
        overhead = ((mean.get("host_data") or 0.0) + (mean.get("idle") or 0.0)) / mean["trace_s"]
    return Point(row["devices"], float(step), float(tokens), lay["traffic"], row["cell"], share, overhead)


def _table(device_kind: str, network: Optional[str]) -> Table:
    intra, inter = interconnects.intra_link(device_kind), interconnects.inter_link(device_kind, network)
    bw = {"intra": intra.bytes_per_s if intra else None, "inter": inter.bytes_per_s if inter else None}
    src = {"intra": f"{intra.name}, {intra.source}" if intra else f"no table entry for {device_kind!r}",
           "inter": f"{inter.name}, {inter.source}" if inter else f"no table entry for {device_kind!r}"}
    return Table(bw, src)


# --------------------------------------------------------------------------- the section

def section(rows: List[Dict[str, Any]], scaling: str, hw: Dict[str, Any], opts: Dict[str, Any],
            order: Sequence[str] = ()) -> Optional[Dict[str, Any]]:
    """What report.json keeps under `projection`, contenders in `order` (the report's; built-ins first
    otherwise); None when report.project_to is empty."""
    if not opts["project_to"]:
        return None
    base = variant_of(rows[0]) if rows else ""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("tokens_per_s") and variant_of(r) == base
          and (r.get("step_time_mean_s") or r.get("step_time_p50_s"))]
    names = compare.contender_order([{"contender": contender_of(r)} for r in ok], order)
    simulated = bool(hw.get("simulated_devices_share_host"))
    out: Dict[str, Any] = {"project_to": opts["project_to"], "max_error": opts["project_max_error"],
                           "efficiency_floor": opts["efficiency_floor"], "scaling": scaling, "variant": base or None,
                           "warning": SIMULATED if simulated else None, "contenders": {}, "ratios": []}
    for name in names:
        mine = sorted((r for r in ok if contender_of(r) == name), key=lambda r: r["devices"])
        out["contenders"][name] = _contender(mine, scaling, opts, simulated)
    out["ratios"] = _ratios(out["contenders"], opts["project_to"])
    return _finite(out)


def _finite(obj: Any) -> Any:
    """`obj` with every non-finite number (an unbounded or unknown bandwidth) as None: report.json stays JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _contender(rows: List[Dict[str, Any]], scaling: str, opts: Dict[str, Any], simulated: bool) -> Dict[str, Any]:
    cfg = rows[-1]["_cfg"]
    kind = str((rows[-1].get("_start") or {}).get("device_kind") or "unknown")
    per_node, per_node_src = node_size(cfg, kind, max(r["devices"] for r in rows), opts["devices_per_node"])
    table = _table(kind, opts["network"])
    entry: Dict[str, Any] = {"cells": [r["cell"] for r in rows], "device_kind": kind, "devices_per_node": per_node,
                             "devices_per_node_source": per_node_src, "tiers": interconnects.tier_names(kind),
                             "table": {"bandwidth_bytes_per_s": table.bandwidth, "source": table.source},
                             "parallel": dict(cfg.get("parallel") or {}), "fit": None, "error": None,
                             "leave_one_out": {}, "max_abs_error": None, "trustworthy": False, "why_not": None,
                             "measured": [], "projections": [], "floor": None, "curve": []}
    try:
        points = [_point(r, per_node) for r in rows]
    except ConfigError as e:
        entry["error"] = f"a measured cell's layout cannot be rebuilt: {e}"
        return entry
    base = rows[0]["tokens_per_s_per_device"]
    for r, p in zip(rows, points):
        entry["measured"].append({"devices": r["devices"], "cell": r["cell"], "step_s": p.step_s,
                                  "tokens_per_s_per_device": r["tokens_per_s_per_device"],
                                  "efficiency": r["tokens_per_s_per_device"] / base, "bytes": p.traffic,
                                  "profiled": p.collective_share is not None})
    try:
        model = fit(points, scaling, table)
    except ProjectionError as e:
        entry["error"] = str(e)
        return entry
    entry["fit"] = model.as_dict()
    loo = leave_one_out(points, scaling, table)
    entry["leave_one_out"] = loo
    errors = [abs(e) for e in loo.values() if e is not None]
    entry["max_abs_error"] = max(errors) if errors and len(errors) == len(loo) else None
    if simulated:
        entry["why_not"] = "simulated CPU devices"
    elif len(points) < 3:
        entry["why_not"] = f"only {len(points)} measured device count(s): leave-one-out needs 3"
    elif entry["max_abs_error"] is None:
        entry["why_not"] = "leave-one-out could not refit every subset"
    elif entry["max_abs_error"] > opts["project_max_error"]:
        entry["why_not"] = (f"leave-one-out error {100 * entry['max_abs_error']:.1f}% exceeds "
                            f"{100 * opts['project_max_error']:.0f}% (report.project_max_error)")
    entry["trustworthy"] = entry["why_not"] is None
    band = entry["max_abs_error"]
    per_device_batch = (rows[0].get("global_batch") or cfg["train"]["global_batch"]) / rows[0]["devices"]

    def at(n: int) -> Dict[str, Any]:
        batch = int(round(per_device_batch * n)) if scaling == "weak" else int(rows[0].get("global_batch") or 0)
        try:
            lay = layout(cfg, n, batch, per_node)
        except ConfigError as e:
            return {"devices": n, "error": str(e)}
        return _evaluate(model, n, lay, base, band, entry["trustworthy"], model.measured_tiers)

    entry["projections"] = [at(n) for n in opts["project_to"]]
    entry["floor"] = _floor(entry, at, opts["efficiency_floor"], opts["project_to"])
    lo, hi = rows[0]["devices"], max([*opts["project_to"], rows[-1]["devices"]])
    grid = sorted({*(lo << k for k in range(0, 40) if lo << k <= hi), *opts["project_to"], *(r["devices"] for r in rows)})
    entry["curve"] = [{k: v for k, v in p.items() if k != "collectives"} for p in (at(n) for n in grid) if "error" not in p]
    return entry


def _evaluate(model: Fit, n: int, lay: Dict[str, Any], base: float, band: Optional[float], trusted: bool,
              measured_tiers: List[str]) -> Dict[str, Any]:
    traffic = lay["traffic"]
    unknown = [t for t, b in traffic.items() if b > 0 and math.isnan(model.bandwidth.get(t, math.nan))]
    if unknown:
        return {"devices": n, "error": f"the {', '.join(unknown)} tier's bandwidth is unknown: no measured cell used it "
                                      "and the interconnect table has no entry for this device"}
    step = model.step_time(n, traffic)
    tps = model.tokens_per_step(n) / n / step
    new_tiers = [t for t, b in traffic.items() if b > 0 and t not in measured_tiers]
    return {"devices": n, "mesh": lay["mesh"], "step_s": step, "compute_s": model.compute(n), "overhead_s": model.overhead_s,
            "communication_s": model.communication(traffic), "bytes": traffic,
            "collectives": collectives.as_dicts(lay["collectives"]), "tokens_per_s_per_device": tps,
            **_band(tps, band, ""), **_band(tps / base, band, "efficiency_"), "efficiency": tps / base,
            "unmeasured_tiers": new_tiers, "trustworthy": trusted}


def _band(value: float, error: Optional[float], prefix: str) -> Dict[str, Optional[float]]:
    """The measured value a prediction with leave-one-out error up to `error` allows (error = predicted / measured
    - 1): value / (1 + error) to value / (1 - error), the top unbounded (None) from an error of 100 %; both None
    without an error."""
    if error is None:
        return {f"{prefix}low": None, f"{prefix}high": None, f"{prefix}high_unbounded": False}
    return {f"{prefix}low": value / (1 + error), f"{prefix}high": value / (1 - error) if error < 1 else None,
            f"{prefix}high_unbounded": error >= 1}


def _floor(entry: Dict[str, Any], at: Callable[[int], Dict[str, Any]], floor: float, project_to: List[int]) -> Dict[str, Any]:
    """The first device count (measured, then doubling past the largest measured one) whose efficiency is below
    `floor`, with the last count above it."""
    last_above: Optional[int] = None
    for m in entry["measured"]:
        if m["efficiency"] < floor:
            return {"devices": m["devices"], "last_above": last_above, "measured": True}
        last_above = m["devices"]
    n = entry["measured"][-1]["devices"]
    limit = max(SEARCH_LIMIT, *project_to)
    candidates = sorted({*(n << k for k in range(1, 40) if n << k <= limit), *(d for d in project_to if d > n)})
    for c in candidates:
        p = at(c)
        if "error" in p:
            return {"devices": None, "last_above": last_above, "measured": False, "stopped": f"at {c} devices: {p['error']}"}
        if p["efficiency"] < floor:
            return {"devices": c, "last_above": last_above, "measured": False}
        last_above = c
    return {"devices": None, "last_above": last_above, "measured": False, "stopped": f"not below it up to {limit} devices"}


def _ratios(entries: Dict[str, Dict[str, Any]], counts: List[int]) -> List[Dict[str, Any]]:
    out = []
    for a, b in itertools.combinations(list(entries), 2):
        pa = {p["devices"]: p for p in entries[a]["projections"] if "error" not in p}
        pb = {p["devices"]: p for p in entries[b]["projections"] if "error" not in p}
        for n in counts:
            if n not in pa or n not in pb:
                continue
            x, y = pa[n], pb[n]
            low = x["low"] / y["high"] if x["low"] is not None and y["high"] else None  # None: 0 (b unbounded above)
            high = x["high"] / y["low"] if x["high"] is not None and y["low"] else None  # None: unbounded
            banded = x["low"] is not None and y["low"] is not None
            out.append({"a": a, "b": b, "devices": n, "ratio": x["tokens_per_s_per_device"] / y["tokens_per_s_per_device"],
                        "low": (low or 0.0) if banded else None, "high": high if banded else None,
                        "high_unbounded": banded and high is None,
                        "trustworthy": bool(x["trustworthy"] and y["trustworthy"])})
    return out
