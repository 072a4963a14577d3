"""A cost model of a step fitted to measured cells, to project a contender's step time to device counts
it was not measured at, and the leave-one-out check that says how far to trust it.

The model, for one contender and mesh shape, at N devices:

    step(N) = compute(N) + overhead + exposure * sum over tiers t of bytes_t(N) / bandwidth_t

- bytes_t(N): what each device sends per step on tier t (`launch.core.collectives`), from the
  model and the mesh at N; so `sum bytes_t / bandwidth_t` is the collectives' raw time.
- exposure = 1 - overlap: the part of the raw communication time the step does not hide behind
  compute (0: fully overlapped, 1: not at all).
- compute(N) = compute at the anchor (the smallest measured device count N_a) times 1 under weak
  scaling (per-device work constant) or N_a / N under strong scaling (the global batch divided).
- overhead: per-step time that neither computes nor communicates (host work, dispatch, idle), the
  same at every N. Under weak scaling it cannot be told apart from compute and does not change a
  projection; it is reported only where a profile measured it.

What is measured and what is fitted (the report prints which, for every number):

- compute at the anchor: the anchor's measured step time minus its overhead and exposed
  communication (all of it when the anchor does not communicate, e.g. one device).
- overhead: measured by the profile breakdown (`host_data + idle` share of the smallest profiled
  cell, times its step time) where a cell was profiled; else fitted under strong scaling when the
  other cells determine it, else 0 (under weak scaling it is folded into compute).
- bandwidth of a tier the profiled cells use: fitted to their raw communication time (the profile's
  `collectives` share of a traced step times the measured step time) by least squares over tiers.
- overlap: fitted to the measured step times given those bandwidths (each point's step time minus
  the anchor's, scaled for strong scaling, against its raw communication time minus the anchor's),
  clamped to [0, 1]. Without a profile, step times cannot tell bandwidth from overlap: the overlap
  is then taken as 0 and each measured tier gets an *effective* bandwidth, bandwidth / (1 - overlap),
  fitted to the step times; a projection is the same either way, only the two numbers differ.
- a measured tier no profile covers: its bandwidth is fitted to the step times as above (given the
  profiled overlap where there is one). Tiers the cells cannot tell apart are tied together in the
  interconnect table's ratio (`launch.core.interconnects`), or taken as equal without a table entry.
- a tier no measured cell used: the table's figure times the fitted/table ratio of a measured tier
  (the fraction of the datasheet the sweep achieved carries over, overlap included), or the table's
  figure when nothing was measured, or, with no table entry (CPU), the measured tier's bandwidth.

Leave-one-out: for each measured device count, fit on the others and predict it; the error is the
predicted throughput over the measured one, minus 1. It needs three measured device counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

from launch.core.interconnects import TIERS


class ProjectionError(ValueError):
    """The measured points cannot support a fit (one sentence: why)."""


@dataclass(frozen=True)
class Point:
    """One measured cell of a contender."""
    devices: int
    step_s: float  # steady-state mean step time
    tokens_per_step: float  # global tokens per optimizer step
    traffic: Dict[str, float]  # bytes each device sends per step, by tier
    cell: str = ""
    collective_share: Optional[float] = None  # profile: share of the traced step with a collective running
    overhead_share: Optional[float] = None  # profile: share of the traced step in host/data work or idle

    def raw(self, bandwidth: Dict[str, float]) -> float:
        """Seconds the collectives of the tiers in `bandwidth` take at those bandwidths, with no overlap."""
        return sum(self.traffic.get(t, 0.0) / b for t, b in bandwidth.items() if self.traffic.get(t, 0.0) > 0)


@dataclass(frozen=True)
class Table:
    """Datasheet bandwidths (bytes/s) per tier where known, with where each figure comes from."""
    bandwidth: Dict[str, Optional[float]]
    source: Dict[str, str]


@dataclass
class Fit:
    scaling: str
    anchor_devices: int
    anchor_tokens_per_step: float
    compute_s: float  # at the anchor
    overhead_s: float
    exposure: float  # 1 - overlap
    bandwidth: Dict[str, float]  # bytes/s per tier
    source: Dict[str, str] = field(default_factory=dict)  # per parameter: how it was obtained
    notes: List[str] = field(default_factory=list)
    measured_tiers: List[str] = field(default_factory=list)

    @property
    def overlap(self) -> float:
        return 1.0 - self.exposure

    def compute(self, devices: int) -> float:
        return self.compute_s * (self.anchor_devices / devices if self.scaling == "strong" else 1.0)

    def communication(self, traffic: Dict[str, float]) -> float:
        """Exposed communication seconds per step for this traffic."""
        return self.exposure * sum(b / self.bandwidth[t] for t, b in traffic.items() if b > 0)

    def step_time(self, devices: int, traffic: Dict[str, float]) -> float:
        return self.compute(devices) + self.overhead_s + self.communication(traffic)

    def tokens_per_step(self, devices: int) -> float:
        scale = devices / self.anchor_devices if self.scaling == "weak" else 1.0
        return self.anchor_tokens_per_step * scale

    def throughput_per_device(self, devices: int, traffic: Dict[str, float]) -> float:
        return self.tokens_per_step(devices) / devices / self.step_time(devices, traffic)

    def as_dict(self) -> Dict[str, object]:
        return {"scaling": self.scaling, "anchor_devices": self.anchor_devices, "compute_s": self.compute_s,
                "overhead_s": self.overhead_s, "overlap": self.overlap, "exposure": self.exposure,
                "bandwidth_bytes_per_s": dict(self.bandwidth), "measured_tiers": list(self.measured_tiers),
                "source": dict(self.source), "notes": list(self.notes)}


def _lstsq(columns: Sequence[Sequence[float]], y: Sequence[float]) -> Optional[np.ndarray]:
    """Least-squares coefficients, or None when the columns do not determine them (rank deficient)."""
    a = np.array(columns, dtype=float).T
    if a.size == 0:
        return None
    norms = np.linalg.norm(a, axis=0)  # bytes (1e9) next to seconds (1): compare the columns' directions only
    if not np.all(norms > 0):
        return None
    a = a / norms
    if np.linalg.matrix_rank(a) < a.shape[1]:
        return None
    return np.linalg.lstsq(a, np.array(y, dtype=float), rcond=None)[0] / norms


def _profiled(points: Sequence[Point], measured: List[str]) -> tuple:
    """(bandwidth per tier the profiles determine, the profiled cells): raw communication time of each profiled
    cell that communicates (its collective share x its step time) = sum over tiers of bytes / bandwidth, solved
    by least squares for the tiers those cells use."""
    cells = [p for p in points if p.collective_share is not None and any(p.traffic.get(t, 0) > 0 for t in measured)]
    tiers = [t for t in measured if any(p.traffic.get(t, 0) > 0 for p in cells)]
    if not cells:
        return {}, []
    inverse = _lstsq([[p.traffic.get(t, 0.0) for p in cells] for t in tiers], [p.collective_share * p.step_s for p in cells])
    if inverse is None or not all(u > 0 for u in inverse):
        return {}, cells
    return {t: 1.0 / u for t, u in zip(tiers, inverse)}, cells


def fit(points: Sequence[Point], scaling: str, table: Table) -> Fit:
    """The cost model that fits `points` (one contender, one mesh rule); raises ProjectionError when they
    cannot determine it."""
    if scaling not in ("weak", "strong"):
        raise ProjectionError(f"scaling={scaling!r} is neither weak nor strong")
    pts = sorted(points, key=lambda p: p.devices)
    if not pts:
        raise ProjectionError("no measured cell")
    if len({p.devices for p in pts}) != len(pts):
        raise ProjectionError("two measured cells have the same device count")
    anchor, rest = pts[0], pts[1:]
    notes: List[str] = []
    source: Dict[str, str] = {}
    measured = [t for t in TIERS if any(p.traffic.get(t, 0) > 0 for p in pts)]
    known, profiled = _profiled(pts, measured)
    prof_names = ", ".join(p.cell or str(p.devices) for p in profiled)
    for t in known:
        source[f"bandwidth.{t}"] = f"fitted: profiled collective time of {prof_names}"
    if profiled and not known:
        notes.append(f"the profiled collective time of {prof_names} does not determine a bandwidth per tier; not used")
    free = [t for t in measured if t not in known]

    overhead: Optional[float] = None
    with_share = [p for p in pts if p.overhead_share is not None]
    if with_share:
        overhead = with_share[0].overhead_share * with_share[0].step_s
        source["overhead"] = (f"measured: profile of {with_share[0].cell}, host/data + idle "
                              f"{100 * with_share[0].overhead_share:.1f}% of its step")

    # step_i - step_a * w_i = e * (R_i - R_a w_i) + sum_free x_t (bytes_it - bytes_at w_i) + overhead * (1 - w_i)
    w = [anchor.devices / p.devices if scaling == "strong" else 1.0 for p in rest]
    y = [p.step_s - anchor.step_s * wi for p, wi in zip(rest, w)]
    cols: Dict[str, List[float]] = {}
    if known:
        cols["e"] = [p.raw(known) - anchor.raw(known) * wi for p, wi in zip(rest, w)]
    for t in free:
        cols[t] = [p.traffic.get(t, 0.0) - anchor.traffic.get(t, 0.0) * wi for p, wi in zip(rest, w)]
    cols = {k: c for k, c in cols.items() if any(abs(v) > 0 for v in c)}
    if overhead is None and scaling == "strong":
        cols["overhead"] = [1.0 - wi for wi in w]
    elif overhead is not None:
        y = [yi - overhead * (1.0 - wi) for yi, wi in zip(y, w)]
    coef = _solve(cols, y, len(rest), free, table, notes)
    if "overhead" in coef:
        overhead = coef.pop("overhead")
        source["overhead"] = "fitted: strong-scaling step times"
        if overhead < 0:
            notes.append(f"the fitted overhead came out negative ({1e3 * overhead:.3g} ms) and is taken as 0")
            overhead = 0.0
    if overhead is None:
        overhead = 0.0
        source["overhead"] = ("folded into compute (weak scaling: the same at every N)" if scaling == "weak"
                              else "assumed 0: the measured cells do not determine it")

    bandwidth: Dict[str, float] = dict(known)
    if known and "e" in coef:
        exposure = coef.pop("e")
        if exposure > 1.0:
            notes.append(f"the step time grows {exposure:.2f}x as fast as the profiled collective time (contention, "
                         "stragglers or a wrong byte count?); overlap taken as 0")
        elif exposure < 0.0:
            notes.append("the step time shrinks as the profiled collective time grows; overlap taken as 100%")
        exposure = min(1.0, max(0.0, exposure))
        source["overlap"] = f"fitted: step times, given the profiled collective time of {prof_names}"
        identified = True
    elif known:
        exposure = 1.0
        source["overlap"] = "assumed 0: no two measured cells differ in profiled communication"
        identified = True
    else:
        exposure = 1.0
        identified = False
        source["overlap"] = ("not identifiable without a profile (step times cannot tell bandwidth from overlap): 0 is "
                             "used and the bandwidths are effective ones, bandwidth / (1 - overlap)") if free else \
            "assumed 0: no measured cell communicates"
    for t in free:
        x = coef.get(t)
        if x is None:
            continue
        if x <= 0 or exposure == 0:
            bandwidth[t] = float("inf")
            source[f"bandwidth.{t}"] = "fitted: unbounded (step times do not grow with this tier's bytes)"
            continue
        bandwidth[t] = exposure / x
        source[f"bandwidth.{t}"] = ("fitted: step times, given the profiled overlap" if identified
                                    else "fitted: step times (effective, overlap included)")
    _unmeasured(bandwidth, table, [t for t in measured if t in bandwidth], source, notes)
    compute = anchor.step_s - overhead - exposure * anchor.raw(bandwidth)
    source["compute"] = f"measured: {anchor.cell or anchor.devices} step time" + (
        " minus its overhead and exposed communication" if compute != anchor.step_s else "")
    if not compute > 0:
        raise ProjectionError(f"the fit leaves no compute time at {anchor.devices} device(s) (overhead and exposed "
                              "communication exceed the measured step)")
    return Fit(scaling, anchor.devices, anchor.tokens_per_step, compute, overhead, exposure, bandwidth, source, notes,
               measured)


def _solve(cols: Dict[str, List[float]], y: List[float], n: int, free: List[str], table: Table,
           notes: List[str]) -> Dict[str, float]:
    """Least-squares coefficients for `cols`; when they are not all determined: drop the overhead (0), then tie
    the free tiers together (the table's ratio, or equal), then leave the free tiers to `_unmeasured`."""
    if not cols or not n:
        return {}
    names = list(cols)
    got = _lstsq([cols[k] for k in names], y) if len(names) <= n else None
    if got is not None:
        return dict(zip(names, (float(v) for v in got)))
    if "overhead" in cols:
        notes.append("the measured cells do not tell the overhead apart from communication (e.g. FSDP's bytes "
                     "grow like (N - 1) / N, as a fixed overhead does against compute / N): taken as 0; a profile "
                     "measures it")
        return _solve({k: v for k, v in cols.items() if k != "overhead"}, y, n, free, table, notes)
    tied = [t for t in free if t in cols]
    if len(tied) > 1:
        ref = {t: (table.bandwidth.get(t) or 1.0) for t in tied}
        if not all(table.bandwidth.get(t) for t in tied):
            ref = {t: 1.0 for t in tied}
        merged = [sum(cols[t][i] / ref[t] * ref[tied[0]] for t in tied) for i in range(len(y))]
        how = "the table's ratio" if len(set(ref.values())) > 1 else "assumed equal"
        notes.append(f"the measured cells do not separate the tiers' bandwidths: tied together ({how})")
        rest = {k: v for k, v in cols.items() if k not in tied}
        got = _solve({**rest, tied[0]: merged}, y, n, [tied[0]], table, notes)
        if tied[0] in got:
            for t in tied[1:]:
                got[t] = got[tied[0]] * ref[tied[0]] / ref[t]
        return got
    if tied and "e" in cols:
        notes.append(f"the measured cells do not separate the {tied[0]} tier from the profiled one")
        return _solve({k: v for k, v in cols.items() if k not in tied}, y, n, [], table, notes)
    return {}


def _unmeasured(bandwidth: Dict[str, float], table: Table, fitted: List[str], source: Dict[str, str],
                notes: List[str]) -> None:
    """Bandwidths, in place, for the tiers the measured cells did not determine (`fitted` are those they did)."""
    scaled = [(t, bandwidth[t] / table.bandwidth[t]) for t in fitted
              if table.bandwidth.get(t) and 0 < bandwidth[t] < float("inf")]
    finite = [t for t in fitted if 0 < bandwidth[t] < float("inf")]
    for t in TIERS:
        if t in fitted:
            continue
        tab = table.bandwidth.get(t)
        if tab and scaled:
            ref, ratio = scaled[0]
            bandwidth[t] = tab * ratio
            source[f"bandwidth.{t}"] = (f"not measured: table ({table.source[t]}) x {ratio:.3g}, the fitted/table "
                                        f"ratio of the {ref} tier")
        elif tab:
            bandwidth[t] = tab
            source[f"bandwidth.{t}"] = f"not measured: table ({table.source[t]})"
        elif finite:
            bandwidth[t] = bandwidth[finite[0]]
            source[f"bandwidth.{t}"] = f"not measured, no table entry: assumed equal to the {finite[0]} tier"
        else:
            bandwidth[t] = float("nan")
            source[f"bandwidth.{t}"] = "unknown: not measured and no table entry"


def leave_one_out(points: Sequence[Point], scaling: str, table: Table) -> Dict[int, Optional[float]]:
    """Per measured device count: the error of the throughput the model fitted on the others predicts for it
    (predicted / measured - 1); None where the others cannot be fitted. Empty with fewer than 3 points."""
    pts = sorted(points, key=lambda p: p.devices)
    if len(pts) < 3:
        return {}
    out: Dict[int, Optional[float]] = {}
    for i, left in enumerate(pts):
        try:
            f = fit(pts[:i] + pts[i + 1:], scaling, table)
        except ProjectionError:
            out[left.devices] = None
            continue
        predicted = f.step_time(left.devices, left.traffic)
        out[left.devices] = left.step_s / predicted - 1.0 if np.isfinite(predicted) and predicted > 0 else None
    return out
