"""Projection beyond the measured device counts (issue 29): collective bytes per step against hand calculations,
the fit against synthetic sweeps whose true cost model is known, leave-one-out, and the report section.

Tolerances stated here and in README: from a profiled sweep with 0.5 % noise on every measured time, the fit
recovers each tier's bandwidth within 5 %, the overlap within 0.03 and compute within 2 %, and its leave-one-out
error stays under 2 %. Without noise all of them are exact to 1e-9.
"""

import json
import random

import pytest
import yaml
from conftest import run_cli

from launch import config
from launch.config import schema
from launch.core import collectives, interconnects
from launch.core.projection import Point, Table, fit, leave_one_out
from launch.report import projection as report_projection, report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
H100 = "NVIDIA H100 80GB HBM3"
GB = 1e9

# --------------------------------------------------------------------------- bytes per step, by hand

# tiny: d_model 64, 2 layers, d_ff 128, vocab 256. Per block: 2 norms (64 each), wq/wk/wv/wo (64x64), w1/w3 (64x128),
# w2 (128x64); root: embeddings (256x64), final norm (64), lm head (64x256).
TINY_BLOCKS = 2 * (2 * 64 + 4 * 64 * 64 + 2 * 64 * 128 + 128 * 64)  # 82,176
TINY_ROOT = 256 * 64 + 64 + 64 * 256  # 32,832
TINY_NORMS = 2 * 2 * 64 + 64  # 320
# 300m: d_model 1024, 20 layers, d_ff 2816, vocab 32000.
M300_BLOCKS = 20 * (2 * 1024 + 4 * 1024 * 1024 + 3 * 1024 * 2816)  # 256,942,080
M300_ROOT = 32000 * 1024 + 1024 + 1024 * 32000  # 65,537,024
M300_NORMS = 20 * 2 * 1024 + 1024  # 41,984


def _per_step(model, framework, mesh, batch, accum=1, per_node=8, **model_overrides):
    cfg = config.load([f"model={model}", f"framework={framework}", *(f"model.{k}={v}" for k, v in model_overrides.items())])
    full = {"data": 1, "fsdp": 1, "tensor": 1, **mesh}
    return collectives.per_step(cfg.model, framework, full, batch, accum, per_node)


def _total(colls, op=None, tier=None):
    return sum(c.bytes for c in colls if (op is None or c.op == op) and (tier is None or c.tier == tier))


def test_torch_fsdp_bytes_tiny():
    colls = _per_step("tiny", "torch", {"fsdp": 4}, 8)
    assert TINY_BLOCKS + TINY_ROOT == 115008
    by_what = {c.what.split(",")[0].split(" (")[0]: c for c in colls}
    assert by_what["block parameters"].bytes == 2 * 3 / 4 * TINY_BLOCKS * 4  # fp32, forward + backward
    assert by_what["root parameters"].bytes == 3 / 4 * TINY_ROOT * 4  # root gathered once
    assert by_what["gradients"].bytes == 3 / 4 * (TINY_BLOCKS + TINY_ROOT) * 4
    assert _total(colls) == 936576 and _total(colls, tier="inter") == 0
    # 3 ranks: dim 0 padded to equal shards (64 -> 66, 128 -> 129, 256 -> 258)
    blocks3 = 2 * (2 * 66 + 4 * 66 * 64 + 2 * 66 * 128 + 129 * 64)
    root3 = 258 * 64 + 66 + 66 * 256
    colls = _per_step("tiny", "torch", {"fsdp": 3}, 6)
    assert _total(colls, collectives.ALL_GATHER) == pytest.approx(2 / 3 * (2 * blocks3 + root3) * 4)
    assert _total(colls, collectives.REDUCE_SCATTER) == pytest.approx(2 / 3 * (blocks3 + root3) * 4)
    # one fp32 rank runs no FSDP; bf16 uses the compute dtype for gathers
    assert _per_step("tiny", "torch", {}, 8) == []
    bf16 = _per_step("tiny", "torch", {"fsdp": 4}, 8, dtype="bf16")
    assert _total(bf16, collectives.ALL_GATHER) == 3 / 4 * (2 * TINY_BLOCKS + TINY_ROOT) * 2
    assert _total(bf16, collectives.REDUCE_SCATTER) == 3 / 4 * (TINY_BLOCKS + TINY_ROOT) * 4  # reduce_dtype fp32


def test_torch_hsdp_and_dp_bytes_300m():
    """HSDP over 2 nodes of 4: gathers and reduce-scatters within a node, the replicas' all-reduce across nodes."""
    colls = _per_step("300m", "torch", {"data": 2, "fsdp": 4}, 64, per_node=4, dtype="bf16")
    assert M300_BLOCKS + M300_ROOT == 322479104
    assert _total(colls, collectives.ALL_GATHER, "intra") == 2 * 3 / 4 * M300_BLOCKS * 2 + 3 / 4 * M300_ROOT * 2
    assert _total(colls, collectives.REDUCE_SCATTER, "intra") == 3 / 4 * 322479104 * 4
    assert _total(colls, collectives.ALL_REDUCE, "inter") == 2 * 1 / 2 * (322479104 / 4) * 4
    assert _total(colls, tier="inter") == _total(colls, collectives.ALL_REDUCE)
    # plain DP in torch (HSDP with shards of one): only the all-reduce of whole gradients
    dp = _per_step("300m", "torch", {"data": 8}, 64)
    assert _total(dp) == _total(dp, collectives.ALL_REDUCE) == 2 * 7 / 8 * 322479104 * 4


def test_jax_fsdp_dp_and_grad_accum_bytes():
    # tiny, FSDP over 4, bf16, 2 micro-batches: weights gathered twice per micro-batch, reduced once per micro-batch
    colls = _per_step("tiny", "jax", {"fsdp": 4}, 8, accum=2, dtype="bf16")
    weights = TINY_BLOCKS + TINY_ROOT - TINY_NORMS
    assert _total(colls, collectives.ALL_GATHER) == 2 * 2 * 3 / 4 * weights * 2
    assert _total(colls, collectives.REDUCE_SCATTER) == 2 * 3 / 4 * weights * 4
    assert _total(colls, collectives.ALL_REDUCE) == pytest.approx(2 * 2 * 3 / 4 * TINY_NORMS * 4)  # replicated norms
    # 300m, pure data parallel over 8, fp32: every gradient all-reduced
    dp = _per_step("300m", "jax", {"data": 8}, 64)
    assert _total(dp) == pytest.approx(2 * 7 / 8 * 322479104 * 4)
    assert _total(dp, collectives.ALL_GATHER) == 0


def test_jax_tensor_parallel_bytes_300m():
    """fsdp=4 x tensor=2 on 8 devices: FSDP moves half of each weight (the tensor shard), and 4 activation
    all-reduces per layer + 2 of (16 sequences x 2048 x 1024, bf16) cross the tensor pairs."""
    colls = _per_step("300m", "jax", {"fsdp": 4, "tensor": 2}, 64, dtype="bf16")
    per_rank = (M300_BLOCKS + M300_ROOT - M300_NORMS) / 2
    assert _total(colls, collectives.ALL_GATHER) == 2 * 3 / 4 * per_rank * 2
    assert _total(colls, collectives.REDUCE_SCATTER) == 3 / 4 * per_rank * 4
    act = [c for c in colls if c.axis == "tensor"]
    assert len(act) == 1 and act[0].count == 4 * 20 + 2
    assert act[0].bytes == (4 * 20 + 2) * 2 * 1 / 2 * (64 // 4) * 2048 * 1024 * 2
    full = [c for c in _per_step("300m", "jax", {"fsdp": 4, "tensor": 2}, 64, dtype="bf16", remat="full") if c.axis == "tensor"]
    assert full[0].count == 6 * 20 + 2  # the recomputed forward's two per layer
    # tiers: tensor pairs are neighbours, so with 4 devices per node they stay inside it while fsdp groups cross
    tiers = {c.axis: c.tier for c in _per_step("300m", "jax", {"fsdp": 4, "tensor": 2}, 64, per_node=4)}
    assert tiers["tensor"] == "intra" and tiers["fsdp"] == "inter"


def test_group_tier_follows_the_row_major_layout():
    mesh = {"data": 2, "fsdp": 4, "tensor": 1}
    assert collectives.group_tier(mesh, ("fsdp",), 4) == "intra"
    assert collectives.group_tier(mesh, ("data",), 4) == "inter"
    assert collectives.group_tier(mesh, ("data", "fsdp"), 8) == "intra"
    assert collectives.group_tier(mesh, ("fsdp",), 2) == "inter"


def test_network_choices_are_the_table():
    field = {f.name: f for f in schema.ReportConfig.__dataclass_fields__.values()}["network"]
    assert set(field.metadata["choices"]) == set(interconnects.NETWORKS)


# --------------------------------------------------------------------------- the fit on synthetic sweeps

def _truth(devices, traffic, *, c, overhead, bw, overlap, scaling="weak", anchor=1):
    compute = c * (anchor / devices if scaling == "strong" else 1.0)
    raw = sum(traffic[t] / bw[t] for t in traffic if traffic[t])
    return compute + overhead + (1 - overlap) * raw, raw


def _points(truth, devices=(1, 2, 4, 8, 16), per_node=4, profiled=(1, 4, 16), noise=0.0, scaling="weak", seed=0,
            framework="jax", model="300m"):
    rng = random.Random(seed)
    cfg = config.load([f"model={model}", "model.dtype=bf16", f"framework={framework}"])
    out = []
    for n in devices:
        batch = 8 * n if scaling == "weak" else 8 * devices[-1]
        traffic = collectives.by_tier(collectives.per_step(cfg.model, framework, {"data": 1, "fsdp": n, "tensor": 1},
                                                           batch, 1, per_node))
        step, raw = _truth(n, traffic, scaling=scaling, anchor=devices[0], **truth)
        step *= 1 + noise * rng.uniform(-1, 1)
        share = overhead = None
        if n in profiled:
            share = raw * (1 + noise * rng.uniform(-1, 1)) / step
            overhead = truth["overhead"] / step
        out.append(Point(n, step, batch * 2048, traffic, f"{framework}-d{n}", share, overhead))
    return out


TABLE = Table({"intra": 450 * GB, "inter": 50 * GB}, {"intra": "NVLink 4", "inter": "NDR"})
TRUTH = {"c": 0.5, "overhead": 0.02, "bw": {"intra": 20 * GB, "inter": 4 * GB}, "overlap": 0.6}


@pytest.mark.parametrize("noise", [0.0, 0.005])
def test_fit_recovers_bandwidth_and_overlap_from_a_profiled_sweep(noise):
    """1-16 devices, 4 per node (so 8 and 16 cross nodes), profiled at 1, 4 and 16: both bandwidths, the overlap,
    compute and overhead come back; leave-one-out predicts every left-out count."""
    pts = _points(TRUTH, noise=noise)
    f = fit(pts, "weak", TABLE)
    tol = 1e-9 if noise == 0 else 0.05
    for tier, true in TRUTH["bw"].items():
        assert f.bandwidth[tier] == pytest.approx(true, rel=tol), tier
        assert "profiled collective time" in f.source[f"bandwidth.{tier}"]
    assert f.overlap == pytest.approx(0.6, abs=1e-9 if noise == 0 else 0.03)
    assert f.compute_s == pytest.approx(0.5, rel=1e-9 if noise == 0 else 0.02)
    assert f.overhead_s == pytest.approx(0.02, rel=1e-9 if noise == 0 else 0.05)
    assert f.source["overlap"].startswith("fitted")
    loo = leave_one_out(pts, "weak", TABLE)
    assert set(loo) == {1, 2, 4, 8, 16}
    assert max(abs(e) for e in loo.values()) < (1e-9 if noise == 0 else 0.02), loo
    # the projection at 64 devices is the truth's
    cfg = config.load(["model=300m", "model.dtype=bf16", "framework=jax"])
    t64 = collectives.by_tier(collectives.per_step(cfg.model, "jax", {"data": 1, "fsdp": 64, "tensor": 1}, 512, 1, 4))
    assert f.step_time(64, t64) == pytest.approx(_truth(64, t64, **TRUTH)[0], rel=1e-9 if noise == 0 else 0.02)


def test_without_a_profile_the_bandwidth_is_an_effective_one():
    """Step times alone cannot separate bandwidth and overlap: the fit reports bandwidth / (1 - overlap) with the
    overlap at 0, says so, and projects the same step times."""
    pts = [Point(p.devices, p.step_s, p.tokens_per_step, p.traffic, p.cell) for p in _points(TRUTH)]
    f = fit(pts, "weak", TABLE)
    for tier, true in TRUTH["bw"].items():
        assert f.bandwidth[tier] == pytest.approx(true / (1 - 0.6), rel=1e-9)
        assert "effective" in f.source[f"bandwidth.{tier}"]
    assert f.overlap == 0 and "not identifiable without a profile" in f.source["overlap"]
    assert f.overhead_s == 0 and "folded into compute" in f.source["overhead"]
    for p in pts:
        assert f.step_time(p.devices, p.traffic) == pytest.approx(p.step_s, rel=1e-9)


def test_a_tier_no_cell_measured_comes_from_the_table_scaled():
    """Cells on one node only (1-8 devices, 8 per node): the network's bandwidth is the table's, scaled by the fraction
    of the datasheet the sweep achieved within the node. A truth built the same way is projected exactly."""
    truth = {"c": 0.3, "overhead": 0.0, "bw": {"intra": 0.4 * 450 * GB, "inter": 0.4 * 50 * GB}, "overlap": 0.5}
    pts = _points(truth, devices=(1, 2, 4, 8), per_node=8, profiled=(4,))
    f = fit(pts, "weak", TABLE)
    assert f.measured_tiers == ["intra"]
    assert f.bandwidth["inter"] == pytest.approx(0.4 * 50 * GB, rel=1e-9)
    assert f.source["bandwidth.inter"].startswith("not measured: table (NDR) x 0.4")
    cfg = config.load(["model=300m", "model.dtype=bf16"])
    t32 = collectives.by_tier(collectives.per_step(cfg.model, "jax", {"data": 1, "fsdp": 32, "tensor": 1}, 256, 1, 8))
    assert t32["inter"] > 0 and t32["intra"] == 0
    assert f.step_time(32, t32) == pytest.approx(_truth(32, t32, **truth)[0], rel=1e-9)
    # no table entry (CPU): the other tier is assumed equal to the measured one, and says so
    g = fit(pts, "weak", Table({"intra": None, "inter": None}, {"intra": "none", "inter": "none"}))
    assert g.bandwidth["inter"] == g.bandwidth["intra"] and "assumed equal" in g.source["bandwidth.inter"]


def test_strong_scaling_overhead_measured_by_a_profile():
    """Strong scaling: compute divides by N, the overhead does not. For FSDP from one device, step times alone cannot
    tell them apart (bytes grow like (N - 1) / N, the same shape as overhead against compute / N): the fit says so,
    takes the overhead as 0 and still projects the truth; a profile of the 1-device cell measures it."""
    truth = {"c": 2.0, "overhead": 0.05, "bw": {"intra": 20 * GB, "inter": 4 * GB}, "overlap": 0.0}
    pts = [Point(p.devices, p.step_s, p.tokens_per_step, p.traffic, p.cell)
           for p in _points(truth, scaling="strong", profiled=())]
    f = fit(pts, "strong", TABLE)
    assert f.overhead_s == 0 and "do not tell the overhead apart" in f.notes[0]
    cfg = config.load(["model=300m", "model.dtype=bf16"])
    t64 = collectives.by_tier(collectives.per_step(cfg.model, "jax", {"data": 1, "fsdp": 64, "tensor": 1}, 128, 1, 4))
    expect = _truth(64, t64, scaling="strong", **truth)[0]
    assert f.step_time(64, t64) == pytest.approx(expect, rel=1e-9)
    assert max(abs(e) for e in leave_one_out(pts, "strong", TABLE).values()) < 1e-9
    g = fit(_points(truth, scaling="strong", profiled=(1,)), "strong", TABLE)
    assert g.overhead_s == pytest.approx(0.05, rel=1e-9) and g.source["overhead"].startswith("measured: profile of jax-d1")
    assert g.compute_s == pytest.approx(2.0, rel=1e-9) and g.compute(16) == pytest.approx(2.0 / 16, rel=1e-9)
    assert g.step_time(64, t64) == pytest.approx(expect, rel=1e-9)


def test_leave_one_out_exposes_a_model_that_does_not_hold():
    """Per-device compute that grows with N (what simulated CPU devices sharing cores do) is outside the model: the
    leave-one-out error says so."""
    pts = _points(TRUTH, profiled=())
    bent = [Point(p.devices, p.step_s * p.devices ** 0.3, p.tokens_per_step, p.traffic, p.cell) for p in pts]
    loo = leave_one_out(bent, "weak", TABLE)
    assert max(abs(e) for e in loo.values()) > 0.1, loo
    assert leave_one_out(bent[:2], "weak", TABLE) == {}  # two points: nothing to validate against


# --------------------------------------------------------------------------- the report section

def _write_cell(run, name, cfg, summary, device_kind=H100, profile=None):
    d = run / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    recs = [{"kind": "start", "framework": cfg["framework"], "devices": cfg["devices"], "device_kind": device_kind,
             "host_cores": 64, "host": "n1"}]
    recs += [{"kind": "step", "step": i, "loss": 5.0 - i / 10} for i in (1, 2, 3)]
    if profile:
        recs.append({"kind": "profile", "process": 0, "steps": [5, 6], "breakdown": [], "error": None, "mean": profile})
    recs.append({"kind": "summary", "framework": cfg["framework"], "devices": cfg["devices"], "processes": cfg["devices"],
                 "status": "ok", **summary})
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def _synthetic_run(run, contenders, devices=(1, 2, 4, 8), per_node=4, profiled=(), device_kind=H100, extra=(), bend=0.0,
                   model="300m"):
    """A weak-scaling sweep of 300m (bf16, FSDP) whose step times follow each contender's true cost model exactly
    (times devices ** bend: compute that grows with N, outside the model). `contenders`: name -> (framework, truth,
    config overrides)."""
    names = []
    for name, (fw, truth, more) in contenders.items():
        for n in devices:
            batch = 8 * n
            cfg_obj = config.load([f"framework={fw}", f"devices={n}", f"train.global_batch={batch}", f"model={model}",
                                   "model.dtype=bf16", "target=slurm", f"slurm.devices_per_node={per_node}", *extra,
                                   *(o for o in more if not o.startswith("contender="))])
            cfg = config.to_dict(cfg_obj)
            cfg.update(dict(o.split("=", 1) for o in more if o.startswith("contender=")))  # issue 26's key
            traffic = collectives.by_tier(collectives.per_step(cfg_obj.model, fw, config.mesh_shape(cfg_obj), batch, 1,
                                                               per_node))
            step, raw = _truth(n, traffic, **truth)
            step *= n ** bend
            tokens = batch * cfg_obj.model.seq_len
            profile = None
            if n in profiled:
                profile = {"trace_s": step, "measured_s": step, "collectives": raw,
                           "matmul_attention": truth["c"] - truth["overlap"] * raw, "other_compute": 0.0,
                           "host_data": 0.0, "idle": truth["overhead"]}
            summary = {"tokens_per_s": tokens / step, "tokens_per_s_per_device": tokens / step / n, "step_time_mean_s": step,
                       "step_time_p50_s": step, "step_time_p90_s": step, "time_to_first_step_s": 10.0, "compile_s": 5.0,
                       "mfu": 0.4, "steps": 100, "final_loss": 2.0, "error": None}
            cell = f"{name}-d{n}"
            _write_cell(run, cell, cfg, summary, device_kind, profile)
            names.append(cell)
    (run / "sweep.json").write_text(json.dumps({"scaling": "weak", "cells": [{"name": n} for n in names]}))


CONTENDERS = {
    "jax": ("jax", TRUTH, ()),
    "torch": ("torch", {"c": 0.6, "overhead": 0.0, "bw": {"intra": 20 * GB, "inter": 4 * GB}, "overlap": 0.3}, ()),
    "torch-compile": ("torch", {"c": 0.45, "overhead": 0.0, "bw": {"intra": 20 * GB, "inter": 4 * GB}, "overlap": 0.3},
                      ("torch.compile=true",)),
}


def test_report_project_on_a_run_directory(tmp_path):
    """`scaleout report RUN --project 16,32,64` on an existing run directory: the section (every contender, the
    leave-one-out error next to each projection, the pairwise ratios, the efficiency floor), report.json and the
    plot; a bad --project is one sentence, exit 2, nothing written."""
    run = tmp_path / "run"
    _synthetic_run(run, CONTENDERS, devices=(1, 2, 4, 8, 16), profiled=(1, 4, 16))
    p = run_cli(["report", str(run), "--project", "16,x"], cwd=tmp_path)
    assert p.returncode == 2 and "--project '16,x' is not valid" in p.stderr and "Traceback" not in p.stderr
    assert not (run / "report.json").exists()
    p = run_cli(["report", str(run), "--project", "32,64,128"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    doc = json.loads((run / "report.json").read_text())
    sec = doc["projection"]
    assert sec["project_to"] == [32, 64, 128] and list(sec["contenders"]) == ["jax", "torch", "torch-compile"]
    for name, e in sec["contenders"].items():
        assert set(e["leave_one_out"]) == {"1", "2", "4", "8", "16"} and e["max_abs_error"] < 1e-9, name
        assert e["trustworthy"] and [q["devices"] for q in e["projections"]] == [32, 64, 128]
        for q in e["projections"]:
            assert q["low"] < q["tokens_per_s_per_device"] * (1 + 1e-6) and q["bytes"]["inter"] > 0
    jax64 = sec["contenders"]["jax"]["projections"][1]
    cfg = config.load(["model=300m", "model.dtype=bf16", "framework=jax"])
    t64 = collectives.by_tier(collectives.per_step(cfg.model, "jax", {"data": 1, "fsdp": 64, "tensor": 1}, 512, 1, 4))
    assert jax64["step_s"] == pytest.approx(_truth(64, t64, **TRUTH)[0], rel=1e-9)
    pairs = {(r["a"], r["b"], r["devices"]) for r in sec["ratios"]}
    assert ("jax", "torch", 64) in pairs and ("jax", "torch-compile", 128) in pairs and ("torch", "torch-compile", 32) in pairs
    floor = sec["contenders"]["jax"]["floor"]
    assert floor["devices"] == 8 and floor["measured"]  # 8 devices is the first to cross nodes
    md = (run / "report.md").read_text()
    section = md[md.index("## Projection beyond the measured device counts"):]
    assert "leave-one-out error: 1 dev +0.0%, 2 dev" in section and "overlap 60% of communication hidden" in section
    assert "bandwidth across nodes: 4 GB/s" in section and "falls below 80% at 8 devices" in section
    assert "jax / torch-compile" in section and "![projection.png](projection.png)" in section
    assert (run / "projection.png").read_bytes()[:8] == PNG_MAGIC
    assert "projection.png" in doc["plots"]


def test_project_to_from_the_config_and_the_efficiency_floor(tmp_path):
    """report.project_to in the cells' config projects without --project; the floor search finds the projected count
    where efficiency first drops below report.efficiency_floor (here: the first count that crosses nodes, whose
    network no cell measured: flagged)."""
    run = tmp_path / "run"
    truth = {"c": 0.5, "overhead": 0.0, "bw": {"intra": 20 * GB, "inter": 20 / 450 * 50 * GB}, "overlap": 0.9}
    _synthetic_run(run, {"jax": ("jax", truth, ())}, devices=(1, 2, 4), per_node=4, profiled=(1, 4),
                   extra=("report.project_to=[8,16]", "report.efficiency_floor=0.95"))
    out = report.write(run)
    e = json.loads(out["json"].read_text())["projection"]["contenders"]["jax"]
    assert [q["devices"] for q in e["projections"]] == [8, 16]
    assert e["floor"] == {"devices": 8, "last_above": 4, "measured": False}
    assert e["projections"][0]["unmeasured_tiers"] == ["inter"]
    assert "not measured: table (InfiniBand NDR" in e["fit"]["source"]["bandwidth.inter"]
    assert e["projections"][0]["step_s"] == pytest.approx(0.5 + 0.1 * e["projections"][0]["bytes"]["inter"] / truth["bw"]["inter"])
    md = out["md"].read_text()
    assert "falls below 95% at 8 devices (projected; last above: 4)" in md and "across nodes: not measured" in md


def test_a_count_the_mesh_rule_cannot_fill_is_named(tmp_path):
    run = tmp_path / "run"
    truth = {"c": 0.5, "overhead": 0.0, "bw": {"intra": 20 * GB, "inter": 4 * GB}, "overlap": 0.5}
    _synthetic_run(run, {"torch": ("torch", truth, ())}, devices=(4, 8, 16), per_node=4,
                   extra=("parallel.fsdp=4", "parallel.data=-1"))
    e = json.loads(report.write(run, [6, 32])["json"].read_text())["projection"]["contenders"]["torch"]
    assert "cannot fill devices=6" in e["projections"][0]["error"]
    assert e["projections"][1]["mesh"] == {"data": 8, "fsdp": 4, "tensor": 1}
    assert e["max_abs_error"] < 1e-9  # HSDP: gathers in the node, replicas across nodes, both fitted


def test_contenders_are_keyed_by_their_recorded_name(tmp_path):
    """A cell's `contender` (issue 26's key) names it; without one, the framework does (torch.compile: torch-compile)."""
    run = tmp_path / "run"
    truth = {"c": 0.5, "overhead": 0.0, "bw": {"intra": 20 * GB, "inter": 4 * GB}, "overlap": 0.0}
    _synthetic_run(run, {"jax-unrolled": ("jax", truth, ("contender=jax-unrolled", "model.scan_layers=false")),
                         "torch-compile": ("torch", truth, ("torch.compile=true",))})
    sec = json.loads(report.write(run, [16])["json"].read_text())["projection"]
    assert list(sec["contenders"]) == ["torch-compile", "jax-unrolled"]
    assert [(r["a"], r["b"]) for r in sec["ratios"]] == [("torch-compile", "jax-unrolled")]
    assert report_projection.contender_of({"framework": "torch", "_cfg": {"framework": "torch"}}) == "torch"


def test_a_projection_that_fails_leave_one_out_is_labelled(tmp_path):
    """Compute per device growing like N^0.3 is outside the model: leave-one-out errors beyond report.project_max_error
    label every projection not trustworthy, the band is what that error allows, and the curve is drawn dashed."""
    run = tmp_path / "run"
    _synthetic_run(run, {"jax": ("jax", TRUTH, ())}, devices=(1, 2, 4, 8, 16), profiled=(1, 4, 16), bend=0.3)
    out = report.write(run, [32, 64])
    e = json.loads(out["json"].read_text())["projection"]["contenders"]["jax"]
    worst = e["max_abs_error"]
    assert worst > 0.1 and not e["trustworthy"] and "exceeds 10% (report.project_max_error)" in e["why_not"]
    assert worst == max(abs(v) for v in e["leave_one_out"].values())
    for q in e["projections"]:
        assert not q["trustworthy"]
        assert q["low"] == pytest.approx(q["tokens_per_s_per_device"] / (1 + worst))
        assert q["high"] == (pytest.approx(q["tokens_per_s_per_device"] / (1 - worst)) if worst < 1 else None)
    md = out["md"].read_text()
    assert "**not trustworthy** (leave-one-out error" in md and "| 32 |" in md
    assert (run / "projection.png").read_bytes()[:8] == PNG_MAGIC


def test_simulated_cpu_devices_are_never_a_prediction(tmp_path):
    run = tmp_path / "run"
    _synthetic_run(run, {"jax": ("jax", TRUTH, ())}, device_kind="cpu")
    out = report.write(run, [16])
    doc = json.loads(out["json"].read_text())
    e = doc["projection"]["contenders"]["jax"]
    assert doc["hardware"]["simulated_devices_share_host"] and doc["projection"]["warning"]
    assert not e["trustworthy"] and e["why_not"] == "simulated CPU devices"
    assert not e["projections"][0]["trustworthy"]
    assert "no table entry for 'cpu'" in e["table"]["source"]["intra"]
    md = out["md"].read_text()
    assert "**Not a prediction:** the devices are simulated CPU devices" in md and "**not trustworthy**" in md


def test_report_with_project_imports_neither_framework(tmp_path):
    from test_light_imports import _run
    run = tmp_path / "run"
    _synthetic_run(run, {"jax": ("jax", TRUTH, ())}, devices=(1, 2, 4))
    out = _run(["report", str(run), "--project", "8,16"], tmp_path)
    assert out["code"] == 0 and out["heavy"] == [], out
    assert json.loads((run / "report.json").read_text())["projection"]["contenders"]["jax"]["projections"]


def test_one_measured_count_is_not_validated(tmp_path):
    """One device count: nothing to validate against (not trustworthy); the table gives a GPU's bandwidths with no
    overlap assumed; a device the table does not know cannot be projected, and the report names the tier."""
    run = tmp_path / "run"
    _synthetic_run(run, {"jax": ("jax", TRUTH, ())}, devices=(1,))
    e = json.loads(report.write(run, [8])["json"].read_text())["projection"]["contenders"]["jax"]
    assert not e["trustworthy"] and e["why_not"] == "only 1 measured device count(s): leave-one-out needs 3"
    assert e["fit"]["source"]["overlap"] == "assumed 0: no measured cell communicates"
    assert e["fit"]["bandwidth_bytes_per_s"]["inter"] == 50 * GB and e["projections"][0]["low"] is None
    run = tmp_path / "cpu"
    _synthetic_run(run, {"jax": ("jax", TRUTH, ())}, devices=(1,), device_kind="cpu")
    out = report.write(run, [8])
    e = json.loads(out["json"].read_text())["projection"]["contenders"]["jax"]
    assert e["projections"][0]["error"].startswith("the inter tier's bandwidth is unknown")
    assert "cannot project: the inter tier's bandwidth is unknown" in out["md"].read_text()


def test_counts_the_frameworks_would_refuse_are_named(tmp_path):
    """JAX shards d_model over fsdp: tiny (d_model 64) cannot go to 128 devices of FSDP; PyTorch pads its shards and
    can. Under strong scaling a count with fewer sequences than data-parallel ranks cannot be run either."""
    run = tmp_path / "run"
    truth = {"c": 0.5, "overhead": 0.0, "bw": {"intra": 20 * GB, "inter": 4 * GB}, "overlap": 0.0}
    _synthetic_run(run, {"jax": ("jax", truth, ()), "torch": ("torch", truth, ())}, model="tiny")
    sec = json.loads(report.write(run, [64, 128])["json"].read_text())["projection"]["contenders"]
    assert "error" not in sec["jax"]["projections"][0]
    assert "model.d_model=64 is not divisible by the fsdp axis size 128" in sec["jax"]["projections"][1]["error"]
    assert "error" not in sec["torch"]["projections"][1]
