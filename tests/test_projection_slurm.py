"""The projection end to end on a real emulated sweep: JAX and PyTorch on 1, 2 and 4 devices of the 2-node SLURM
cluster (partition `gpu`, two tasks per node, so the 4-device cells cross nodes), profiled, then
`scaleout report RUN --project 8,16` on the run directory.

The devices are CPU processes of one machine: the test checks the machinery (bytes per tier from the real cells'
meshes, the profile's shares, the fit, leave-one-out, the section and the plot) and that the report refuses to call
it a prediction. Skipped with a reason without the cluster; failed instead when CI is set.
"""

import json

import pytest
from conftest import run_cli
from test_slurm_multinode import QUEUE_WAIT_S, _cancel_run_jobs, _cli_args, gpu_partition  # noqa: F401 (fixture)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_projection_of_a_two_node_sweep(gpu_partition, tmp_path):  # noqa: F811
    run = tmp_path / "runs" / "proj"
    common = ["sweep.devices=[1,2,4]", "train.steps=9", "profile.steps=[6,7]", "checkpoint.every=0",
              "checkpoint.async=false", "run.name=proj", "slurm.wait=true"]
    try:
        p = run_cli(["sweep", *_cli_args(tmp_path, *common)], cwd=tmp_path, timeout=QUEUE_WAIT_S + 900)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    finally:
        _cancel_run_jobs(run)
    p = run_cli(["report", str(run), "--project", "8,16"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads((run / "report.json").read_text())
    sec = doc["projection"]
    assert sec["project_to"] == [8, 16] and sec["warning"] and doc["hardware"]["simulated_devices_share_host"]
    assert set(sec["contenders"]) == {"jax", "torch"}
    for name, e in sec["contenders"].items():
        assert e["error"] is None, (name, e["error"])
        assert [m["devices"] for m in e["measured"]] == [1, 2, 4] and e["devices_per_node"] == 2
        bytes4 = e["measured"][2]["bytes"]
        assert bytes4["inter"] > 0 and bytes4["intra"] == 0, bytes4  # FSDP over 4 = two nodes of two
        assert e["measured"][1]["bytes"]["intra"] > 0 and e["measured"][1]["bytes"]["inter"] == 0
        assert all(m["profiled"] for m in e["measured"]), name
        assert set(e["leave_one_out"]) == {"1", "2", "4"}
        assert e["fit"]["measured_tiers"] == ["intra", "inter"]
        assert e["fit"]["source"]["overhead"].startswith("measured: profile of"), e["fit"]["source"]
        assert not e["trustworthy"] and e["why_not"] == "simulated CPU devices"
        assert [q["devices"] for q in e["projections"]] == [8, 16] and all(q["bytes"]["inter"] > 0 for q in e["projections"])
    assert {(r["a"], r["b"]) for r in sec["ratios"]} == {("jax", "torch")}
    md = (run / "report.md").read_text()
    assert "**Not a prediction:**" in md and "2 devices per node (slurm.devices_per_node)" in md
    assert (run / "projection.png").read_bytes()[:8] == PNG_MAGIC
