"""Issue 27: TPU slices against a real GCS API, with PyTorch through TorchTPU.

gs:// is gcp-storage-emulator on 127.0.0.1 (tests/gcs_emulator.py): Orbax (etils, TensorStore),
gcsfs, google-cloud-storage and DCP run their real code against it. The slice is the strict gcloud
emulation (tests/fake_gcloud), which runs the PyTorch ranks for real, started by the same torchrun
command with the same TorchTPU environment as on a slice, on the CPU with gloo standing in for
torch_tpu's tpu_dist (torch_tpu cannot run without chips).
"""

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from conftest import ROOT, run_cell, run_cli, summary
from test_tpu import NODE, Fake, _args, _verbs, no_worker_left  # noqa: F401  (the fixture: no worker left behind)

GCLOUD = ROOT / "tests" / "fake_gcloud" / "gcloud"


@pytest.fixture
def fake(tmp_path, gcs):
    return Fake(tmp_path, gcs)


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------- the GCS emulator itself

def test_a_client_that_stalls_mid_request_holds_no_other_client_up(gcs):
    """The emulator handled one connection at a time, without a timeout, so a client that connected and
    stalled blocked every other one. Cloud Storage serves clients side by side: with a connection stalled
    after its headers and another half-way through its body, a write and a read by another client still
    answer at once, and the upload cut short stores nothing."""
    import socket

    host, port = gcs.url.split("//", 1)[1].split(":")
    stalled = [socket.create_connection((host, int(port)), timeout=10) for _ in range(2)]
    try:
        stalled[0].sendall(b"GET /storage/v1/b HTTP/1.1\r\nHost: x\r\n")  # no blank line: the headers never end
        stalled[1].sendall(f"POST /upload/storage/v1/b/{gcs.bucket}/o?uploadType=media&name=half HTTP/1.1\r\n"
                           "Host: x\r\nContent-Length: 100\r\n\r\n0123456789".encode())  # 10 of 100 bytes
        t0 = time.monotonic()  # urllib with a timeout: a blocked emulator fails the test instead of hanging it
        put = urllib.request.Request(f"{gcs.url}/upload/storage/v1/b/{gcs.bucket}/o?uploadType=media&name=other%2Fa",
                                     data=b"1", method="POST", headers={"Content-Type": "application/octet-stream"})
        urllib.request.urlopen(put, timeout=10).read()
        got = urllib.request.urlopen(f"{gcs.url}/storage/v1/b/{gcs.bucket}/o/other%2Fa?alt=media", timeout=10).read()
        assert got == b"1" and time.monotonic() - t0 < 10
    finally:
        for c in stalled:
            c.close()
    assert not gcs.fs().exists(f"{gcs.bucket}/half")  # the upload that never finished wrote nothing


def test_emulator_behaves_like_gcs_where_checkpoints_care(gcs):
    """No rename (gcsfs's moveTo is refused, so a move is a copy and a delete), directories are only
    prefixes of object names, and a listing is of what is there now."""
    fs = gcs.fs()
    b = gcs.bucket
    fs.mkdir(f"{b}/empty-dir")  # a "directory" with nothing in it is nothing
    assert not fs.exists(f"{b}/empty-dir")
    fs.pipe_file(f"{b}/ck/step_1/a", b"1")
    fs.pipe_file(f"{b}/ck/step_1/sub/b", b"2")
    assert fs.isdir(f"{b}/ck/step_1") and fs.ls(f"{b}/ck", detail=False) == [f"{b}/ck/step_1"]
    req = urllib.request.Request(f"{gcs.url}/storage/v1/b/{b}/o/ck%2Fstep_1%2Fa/moveTo/o/ck%2Fx", method="POST", data=b"")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 501  # objects.moveTo: not there, as on a flat bucket; gcsfs copies and deletes
    fs.rm(f"{b}/ck/step_1/a")
    fs.rm(f"{b}/ck/step_1/sub/b")
    fs.invalidate_cache()
    assert not fs.exists(f"{b}/ck/step_1") and fs.ls(f"{b}", detail=False) == []


def _http(method, url, data=None):
    req = urllib.request.Request(url, method=method, data=data, headers={"content-type": "application/octet-stream"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def test_emulator_answers_generations_and_preconditions_as_gcs_does(gcs):
    """What TensorStore (Orbax's arrays) relies on (tests/gcs_emulator_server.py): a media download names the
    object's generation in `x-goog-generation`, and request preconditions hold: a failed match is 412, a
    failed not-match 304, `ifGenerationMatch=0` is "no live object", a missing object is 404 first."""
    api, up = f"{gcs.url}/storage/v1/b/{gcs.bucket}/o", f"{gcs.url}/upload/storage/v1/b/{gcs.bucket}/o?uploadType=media"
    code, _, body = _http("POST", f"{up}&name=m&ifGenerationMatch=0", b"one")
    assert code == 200
    gen = json.loads(body)["generation"]
    code, headers, body = _http("GET", f"{api}/m?alt=media")
    assert (code, body, headers["x-goog-generation"], headers["x-goog-metageneration"]) == (200, b"one", gen, "1")
    assert headers["x-goog-stored-content-length"] == "3" and "crc32c=" in headers["x-goog-hash"]
    assert _http("POST", f"{up}&name=m&ifGenerationMatch=0", b"two")[0] == 412  # create-only: it exists
    assert _http("POST", f"{up}&name=m&ifGenerationMatch=1", b"two")[0] == 412
    assert _http("GET", f"{api}/m?alt=media&ifGenerationNotMatch={gen}")[0] == 304
    assert _http("GET", f"{api}/m?alt=media&ifGenerationMatch=1")[0] == 412
    assert _http("GET", f"{api}/m?ifMetagenerationMatch=2")[0] == 412
    assert _http("DELETE", f"{api}/m?ifGenerationMatch=1")[0] == 412
    assert _http("GET", f"{api}/nothing?alt=media&ifGenerationMatch=0")[0] == 404
    assert _http("POST", f"{up}&name=new&ifGenerationMatch=5", b"x")[0] == 412
    code, _, body = _http("POST", f"{up}&name=m&ifGenerationMatch={gen}", b"two")
    assert code == 200 and json.loads(body)["generation"] != gen
    assert _http("GET", f"{api}/m?alt=media&ifGenerationNotMatch={gen}")[2] == b"two"
    assert _http("DELETE", f"{api}/m?ifGenerationMatch={json.loads(body)['generation']}")[0] < 300
    assert _http("GET", f"{api}/m")[0] == 404


def test_tensorstore_commits_on_gs_from_two_handles(tmp_path, gcs):
    """OCDBT on gs:// (Orbax's array format) through TensorStore's own GCS driver, two handles on one database,
    each with its own cache, as two opens of a checkpoint have: a handle that read the manifest commits after it
    (the first revalidation of a cached manifest: failed with "Malformed StorageGeneration" on the stock
    emulator, whose downloads carry no generation), and commits in turn keep every key (the stock emulator
    ignored ifGenerationMatch, so a stale handle's commit silently dropped the other's)."""
    code = f"""
import tensorstore as ts
spec = {{"driver": "ocdbt", "base": {{"driver": "gcs", "bucket": "{gcs.bucket}", "path": "db/"}}}}
def handle():
    return ts.KvStore.open(spec, context=ts.Context({{"cache_pool": {{"total_bytes_limit": 10_000_000}}}})).result()
a = handle()
a.write("k0", b"v0").result()
b = handle()
assert b.read("k0").result().value == b"v0"
b.write("k1", b"v1").result()
a.write("k2", b"v2").result()
print(sorted(k.decode() for k in handle().list().result()))
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, **gcs.env})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["['k0',", "'k1',", "'k2']"]


def test_orbax_on_gs_goes_through_gcsfs(tmp_path, gcs):
    """Without gcsfs, Orbax's gs:// path fails, as it would on a slice whose setup forgot the gcs extra."""
    code = ("import sys; sys.modules['gcsfs'] = None\n"
            "import orbax.checkpoint as ocp, numpy as np\n"
            f"m = ocp.CheckpointManager('gs://{gcs.bucket}/o', options=ocp.CheckpointManagerOptions(create=True))\n"
            "m.save(1, args=ocp.args.StandardSave({'w': np.ones(2)})); m.wait_until_finished()\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, **gcs.env})
    assert p.returncode != 0 and "gcsfs" in p.stderr, p.stderr[-2000:]
    p = subprocess.run([sys.executable, "-c", code.split("\n", 1)[1]], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env={**os.environ, **gcs.env})
    assert p.returncode == 0, p.stderr[-2000:]
    assert gcs.fs().exists(f"{gcs.bucket}/o/1/commit_success.txt")  # on gs:// Orbax commits with a file, not a rename


def test_dcp_steps_on_gs_commit_last_keep_n_and_set_aside(tmp_path, gcs):
    """torchrun_fsdp.storage on gs://: a step is visible only once COMMIT is written (last), keep-N
    removes old steps, a leftover of an interrupted save is cleared before a new save of that step, and a
    damaged step is set aside as step_<N>.corrupt without its marker."""
    code = f"""
import os, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo")
from torchrun_fsdp.storage import StepStore
st = StepStore("gs://{gcs.bucket}/ck")
for step in (1, 2, 3):
    st.prepare(step)
    dcp.save({{"w": torch.arange(4.) * step}}, **st.dcp_args(st.staging_path(step)))
    if step == 3:
        assert [s for s, _ in st.complete()] == [1, 2], st.complete()  # written, not committed
    st.commit(step, {{"step": step}})
    st.prune(2)
assert [s for s, _ in st.complete()] == [2, 3]
sd = {{"w": torch.zeros(4)}}
dcp.load(sd, checkpoint_id=st.step_path(3))
assert sd["w"].tolist() == [0., 3., 6., 9.] and st.read_meta(3) == {{"step": 3}}
st.prepare(3)  # a new save of step 3: the old one is gone first
assert [s for s, _ in st.complete()] == [2]
print(st.set_aside(2))
print(sorted(n.rsplit("/", 1)[-1] for n in st.fs.ls(st.root, detail=False)))
"""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, **gcs.env, "PORT": str(port), "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert lines[-2] == f"gs://{gcs.bucket}/ck/step_2.corrupt" and lines[-1] == "['step_2.corrupt']"
    assert not gcs.fs().exists(f"{gcs.bucket}/ck/step_2.corrupt/COMMIT")


# --------------------------------------------------------------------------- gcloud, stricter

def test_scp_to_all_workers_needs_the_key_in_the_agent(fake):
    """gcloud's VerifyKeyInAgent: an ssh-agent holding other keys fails `scp --worker=all` on a multi-host
    slice; one scp per worker (what the target does) never asks."""
    fake.make_vm("my-vm", acc="v4-16")
    src = fake.state / "hello.txt"
    src.write_text("hi")
    try:
        env = {**os.environ, **fake.env, "FAKE_GCLOUD_AGENT": "other-keys"}
        base = [str(GCLOUD), "compute", "tpus", "tpu-vm", "scp", str(src), "my-vm:hello.txt", "--zone=us-central2-b"]
        p = subprocess.run([*base, "--worker=all"], env=env, capture_output=True, text=True)
        assert p.returncode == 1 and "SSH Key is not present in the SSH agent" in p.stderr, p.stderr
        for w in (0, 1):
            assert subprocess.run([*base, f"--worker={w}"], env=env, capture_output=True, text=True).returncode == 0
        assert (fake.worker(1, "my-vm") / "hello.txt").read_text() == "hi"
        p = subprocess.run([*base, "--worker=all"], env={**env, "FAKE_GCLOUD_AGENT": "gcloud-key"}, capture_output=True)
        assert p.returncode == 0
    finally:
        fake.delete_vm("q-my-vm")


def test_emulator_takes_the_documented_flags_only(fake):
    """create: the documented GA flags (--network, --labels, ...), unknown ones refused; ssh/scp: IAP exists only on
    alpha (gcloud: "IAP and Batching are not available for GA"); a queued resource past --valid-until-duration
    while waiting is never provisioned."""
    base = ["compute", "tpus", "queued-resources", "create", "q", "--node-id=n", "--accelerator-type=v4-8",
            "--runtime-version=tpu-ubuntu2204-base", "--zone=us-central2-b"]
    p = fake.gcloud(*base, "--network=net", "--subnetwork=sub", "--service-account=sa@p.iam.gserviceaccount.com",
                    "--labels=team=ml", "--internal-ips", "--valid-until-duration=1h", check=False)
    assert p.returncode == 0, p.stderr
    p = fake.gcloud(*base[:4], "q2", *base[5:], "--netwrok=net", check=False)
    assert p.returncode == 2 and "unrecognized arguments: --netwrok=net" in p.stderr
    p = fake.gcloud(*base[:4], "q3", *base[5:], "--valid-until-duration=soon", check=False)
    assert p.returncode == 2 and "Failed to parse duration" in p.stderr
    env = {**fake.env, "FAKE_GCLOUD_QR_OUTCOME": "WAITING_FOR_RESOURCES"}
    subprocess.run([str(GCLOUD), *base[:4], "w", *base[5:6], "--node-id=w", *base[6:], "--valid-until-duration=1s"],
                   env={**os.environ, **env}, check=True, capture_output=True)
    time.sleep(1.3)
    p = fake.gcloud("compute", "tpus", "queued-resources", "describe", "w", "--zone=us-central2-b", "--format=value(state.state)")
    assert p.stdout.strip() == "FAILED"
    for _ in range(3):
        fake.gcloud("compute", "tpus", "queued-resources", "describe", "q", "--zone=us-central2-b")
    ssh = ["compute", "tpus", "tpu-vm", "ssh", "n", "--zone=us-central2-b", "--command=true"]
    p = fake.gcloud(*ssh, "--tunnel-through-iap", check=False)
    assert p.returncode == 2 and "unrecognized arguments: --tunnel-through-iap" in p.stderr
    assert fake.gcloud("alpha", *ssh, "--tunnel-through-iap", "--internal-ip").returncode == 0
    for q in ("q", "w"):
        fake.gcloud("compute", "tpus", "queued-resources", "delete", q, "--zone=us-central2-b", "--force", "--quiet")


def test_create_and_ssh_args_and_valid_until_reach_gcloud(tmp_path, fake):
    """tpu.create_args / tpu.ssh_args land in the real commands (the strict emulation accepts them), and the
    queued resource is valid for as long as the launcher waits (tpu.timeout_s)."""
    p = run_cli(_args(tmp_path, fake, "devices=4", "tpu.timeout_s=120.5", "tpu.create_args=[--network=net,--labels=team=ml]",
                      "tpu.ssh_args=[--internal-ip,--tunnel-through-iap]", "train.steps=1", "tpu.python=python3.10"),
                cwd=tmp_path, env=fake.env, timeout=300)
    assert p.returncode == 2 and "is Python 3.10 on the workers" in p.stderr, p.stderr[-2000:]  # stopped after ssh/scp ran
    calls = fake.calls()
    create = calls[0]
    assert "--valid-until-duration=121s" in create and "--network=net" in create and "--labels=team=ml" in create
    vm = [c for c in calls if "tpu-vm" in c[:4] and c[3:5] != ["tpu-vm", "describe"]]
    assert vm and all(c[0] == "alpha" and "--internal-ip" in c and "--tunnel-through-iap" in c for c in vm), vm
    assert fake.deleted() == [NODE]


def test_ai_zones_are_accepted():
    from launch import config
    from launch.launcher import rundir
    from launch.targets.tpu import target as tpu
    cfg = config.load(["target=tpu", "tpu.generation=v6e", "devices=4", "tpu.zone=us-central1-ai1a", "checkpoint.dir=gs://b/c"])
    tpu.validate(cfg)
    assert "--zone=us-central1-ai1a" in tpu.plan_commands(rundir.cell_config(cfg, "c"), __import__("pathlib").Path("/r/c"))[0]


# --------------------------------------------------------------------------- PyTorch through TorchTPU

def test_torch_tpu_environment_is_computed_and_checked_as_torch_tpu_does():
    from launch.core import torch_tpu_env as t
    env = t.launch_env(["10.0.0.2", "10.0.0.3"], 4, 1, master_port=29512, session="7")
    assert env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")[4] == "10.0.0.3:8070" and env["WORLD_SIZE"] == "8"
    assert env["MASTER_ADDR"] == "10.0.0.2" and env["NNODES"] == "2" and env["NODE_RANK"] == "1"
    rank = {**env, "RANK": "5", "LOCAL_RANK": "1"}
    t.check(rank)
    for change, word in [({"NNODES": "3"}, "NNODES=3"), ({"TPU_WORKER_HOSTNAMES": ""}, "TPU_WORKER_HOSTNAMES is unset"),
                         ({"MASTER_ADDR": "10.0.0.3"}, "MASTER_ADDR=10.0.0.3"), ({"NODE_RANK": "2"}, "NODE_RANK=2"),
                         ({"TORCH_TPU_SLICEBUILDER_ADDRESSES": "10.0.0.2:8070"}, "TORCH_TPU_SLICEBUILDER_ADDRESSES="),
                         ({"WORLD_SIZE": "4"}, "WORLD_SIZE=4"), ({"RANK": "1"}, "RANK=1 LOCAL_RANK=1"),
                         ({"TORCH_TPU_XPROF_SESSION_ID": ""}, "TORCH_TPU_XPROF_SESSION_ID")]:
        with pytest.raises(t.LaunchEnvError, match=re.escape(word)):
            t.check({**rank, **change})
    assert t.torchrun_args(env) == ["-m", "torch.distributed.run", "--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.2",
                                    "--master_port=29512", "--nproc_per_node=4"]


def test_plan_shows_every_command_of_a_torch_cell_on_a_slice(scaleout):
    code, out, err = scaleout("plan", "--json", "target=tpu", "framework=torch", "tpu.generation=v4", "devices=8",
                              "run.dir=/runs", "run.name=exp", "checkpoint.dir=gs://my-bucket/ckpt")
    assert code == 0, err
    cmds = json.loads(out)["commands"]
    text = "\n".join(cmds)
    assert cmds[0].startswith("gcloud compute tpus queued-resources create scaleout-exp") and "--valid-until-duration=3600s" in cmds[0]
    assert "tpu-vm describe scaleout-exp" in cmds[2] and "internal IPs" in cmds[2]
    assert sum("tpu-vm scp '/runs/exp/tpu/" in c for c in cmds) == 2 and "--worker=all" not in "".join(c for c in cmds if " scp " in c)
    setup = next(c for c in cmds if "uv venv" in c)
    assert "../venv-torch" in setup and "--extra torch --extra gcs" in setup and "--override torch-tpu.txt -r torch-tpu.txt" in setup
    assert "download.pytorch.org/whl/cpu" in setup
    starts = [c for c in cmds if "setsid nohup" in c]
    assert len(starts) == 2
    for i, c in enumerate(starts):
        assert f"--worker={i}" in c and f"NODE_RANK={i}" in c and "NNODES=2" in c and "WORLD_SIZE=8" in c
        assert "<worker-0-ip>,<worker-1-ip>" in c and "TORCH_TPU_DEVICES_PER_HOST=4" in c and "<worker-1-ip>:8073" in c
        assert f"../venv-torch/bin/python -m torch.distributed.run --nnodes=2 --node_rank={i} " in c
        assert "--nproc_per_node=4 -m torchrun_fsdp --config runs/exp/torch-d8/config.yaml" in c
    assert sum("tail -c +1" in c for c in cmds) == 2 and cmds[-1].endswith("--force --quiet")
    assert "torch_tpu" not in text.replace("torch-tpu.txt", "")  # no bootstrap of torch_tpu's on the workers


def test_plan_compile_of_a_torch_tpu_cell_says_it_is_the_pytorch_estimate(scaleout):
    code, out, err = scaleout("plan", "--compile", "target=tpu", "framework=torch", "tpu.generation=v4", "devices=8",
                              "checkpoint.dir=gs://b/c")
    assert code == 0, err
    assert "TorchTPU has no compile without TPU chips, so this is the PyTorch estimate" in out
    assert "datasheet HBM of tpu v4" in out


def test_input_files_are_shipped_to_the_workers(tmp_path):
    """data.source=file and model.init=hf:DIR: the workers' config points at the copies under ~/scaleout/inputs."""
    from launch import config
    from launch.launcher import rundir
    from launch.targets.tpu import commands
    data = tmp_path / "tok.bin"
    np.arange(5000, dtype=np.uint16).__mod__(256).astype(np.uint16).tofile(data)
    (tmp_path / "tok.bin.meta.json").write_text("{}")
    hf = tmp_path / "hfdir"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    cfg = config.load(["target=tpu", "tpu.generation=v4", "devices=8", "data.source=file", f"data.path={data}",
                       "checkpoint.dir=gs://b/c"])
    cfg = config.replace(cfg, {"model.init": f"hf:{hf}"})
    cell = rundir.cell_config(cfg, "jax-d8")
    remote = commands.remote_config_text(cell, "jax-d8")
    assert re.search(r"path: \$\{oc.env:HOME\}/scaleout/inputs/tok.bin-[0-9a-f]{12}/tok.bin", remote), remote
    assert re.search(r"init: hf:\$\{oc.env:HOME\}/scaleout/inputs/hfdir-[0-9a-f]{12}/hfdir", remote), remote
    c = commands.Commands(cell, "v", "jax-d8")
    ship = c.ship_inputs(2)
    assert ship[0][4:6] == ["ssh", "scaleout-tiny"] and ship[0][-1].startswith("--command=mkdir -p scaleout/inputs/")
    scps = ship[1:]
    assert len(scps) == 6 and sorted(a[5] for a in scps) == sorted([str(data)] * 2 + [str(data) + ".meta.json"] * 2 + [str(hf)] * 2)
    assert all(("--recurse" in a) == (a[5] == str(hf)) for a in scps)


@pytest.mark.slow
def test_token_file_reaches_the_workers_of_a_slice(tmp_path, fake):
    """A data.source=file cell on the emulated slice trains on the copy shipped to the worker. On a slice the
    worker cannot see the launcher's disk; the emulated one could, so the slice is kept and the worker's own
    config is read: its data.path is the shipped copy in the worker's home, byte for byte the launcher's file."""
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    tok = tmp_path / "d" / "tok.bin"
    p = run_cli(["prepare-data", str(text), str(tok), "--val-fraction", "0.1"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    p = run_cli(_args(tmp_path, fake, "devices=4", "train.steps=2", "tpu.keep=true", "data.source=file", f"data.path={tok}"),
                cwd=tmp_path, env=fake.env, timeout=600)
    try:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert summary(_records(tmp_path / "runs" / "t" / "jax-d4" / "metrics.jsonl"))["status"] == "ok"
        scps = [c for c in fake.calls() if c[2:4] == ["tpu-vm", "scp"] and c[4].endswith("tok.bin")]
        assert len(scps) == 1 and scps[0][5].startswith("scaleout-t:scaleout/inputs/tok.bin-")
        home = fake.worker(0)
        remote = next(home.glob("scaleout/*/runs/t/jax-d4/config.yaml")).read_text()
        m = re.search(r"path: \$\{oc.env:HOME\}/(scaleout/inputs/tok.bin-[0-9a-f]{12}/tok.bin)", remote)
        assert m, remote
        assert (home / m.group(1)).read_bytes() == tok.read_bytes()
        assert (home / (m.group(1) + ".meta.json")).read_bytes() == (tmp_path / "d" / "tok.bin.meta.json").read_bytes()
    finally:
        fake.delete_vm(NODE)


@pytest.mark.slow
def test_torch_worker_crash_stops_the_others_and_deletes_the_slice(tmp_path, fake):
    """framework=torch on a 2-worker slice (8 ranks, torchrun on each worker): rank 4, on worker 1, crashes at step
    3; torchrun ends worker 1's ranks, the launcher stops worker 0's and deletes the slice."""
    p = run_cli(_args(tmp_path, fake, "framework=torch", "train.steps=200", "checkpoint.every=1000"), cwd=tmp_path,
                env={**fake.env, "FAKE_TPU_ENV_SCALEOUT_FAULT": "crash@3:p4", "FAKE_GCLOUD_AGENT": "other-keys"}, timeout=900)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    # which worker is named first is a race: worker 0's ranks fail at once on the lost gloo connection
    assert re.search(r"worker [01] exited with code 1; the other workers were stopped", p.stderr), p.stderr[-3000:]
    log1 = (tmp_path / "runs" / "t" / "torch-d8" / "logs" / "worker-1.log").read_text()
    assert "[scaleout] error (rank 4): RuntimeError: injected crash at step 3" in log1  # its peers then lose rank 4
    assert fake.deleted() == [NODE] and fake.node_processes() == []
    recs = _records(tmp_path / "runs" / "t" / "torch-d8" / "metrics.jsonl")
    assert recs[0]["kind"] == "start" and any(r["kind"] == "step" and r["step"] == 2 for r in recs)


@pytest.mark.slow
def test_jax_and_torch_side_by_side_on_a_slice_with_gcs_checkpoints(tmp_path, fake):
    """One sweep, both frameworks, on the same emulated 2-worker slice shape (v4-16: JAX 2 processes, PyTorch 8
    ranks through torchrun), checkpoints on the GCS emulator (two saves per cell: on the stock emulator the
    second JAX save died in TensorStore, tests/gcs_emulator_server.py), one report. The launcher's ssh-agent
    holds other keys, which `scp --worker=all` would trip over. Resume and the fallback from a damaged step:
    the tests below, per framework."""
    sweep = [a for a in _args(tmp_path, fake, "train.steps=4", "checkpoint.every=2", "checkpoint.keep=2") if a != "run"]
    p = run_cli(["sweep", *sweep, "sweep.frameworks=[jax,torch]", "sweep.devices=[8]"], cwd=tmp_path,
                env={**fake.env, "FAKE_GCLOUD_AGENT": "other-keys"}, timeout=1500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = {r["cell"]: r for r in json.loads((tmp_path / "runs" / "t" / "report.json").read_text())["cells"]}
    assert set(rows) == {"jax-d8", "torch-d8"} and all(r["status"] == "ok" for r in rows.values()), rows
    assert rows["jax-d8"]["processes"] == 2 and rows["torch-d8"]["processes"] == 8
    fs, b = fake.gcs.fs(), fake.bucket
    for step in (2, 4):
        assert fs.exists(f"{b}/ckpt/t/jax-d8/{step}/commit_success.txt"), fs.find(f"{b}/ckpt/t/jax-d8")
        assert fs.exists(f"{b}/ckpt/t/torch-d8/step_{step}/COMMIT"), fs.find(f"{b}/ckpt/t/torch-d8")
    assert fake.deleted() == [NODE] * 2


def _damaged_fallback(tmp_path, fake, framework):
    """Checkpoints every 2 steps on gs://, stopped after 4; step 4 damaged (a data object removed); the rerun
    falls back to step 2, sets step 4 aside and continues with exactly the losses of the first run."""
    base = _args(tmp_path, fake, f"framework={framework}", "train.steps=6", "checkpoint.every=2", "checkpoint.keep=3")
    cell = f"{framework}-d8"
    first = run_cli([*base, "train.stop_after=4"], cwd=tmp_path, env=fake.env, timeout=1200)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run = tmp_path / "runs" / "t" / cell
    before = {r["step"]: r["loss"] for r in _records(run / "metrics.jsonl") if r["kind"] == "step"}
    fs, root = fake.gcs.fs(), f"{fake.bucket}/ckpt/t/{cell}"
    step4 = "step_4" if framework == "torch" else "4"
    data = [k for k in fs.find(f"{root}/{step4}") if k.endswith(".distcp") or "/d/" in k]
    assert data, fs.find(f"{root}/{step4}")
    fs.rm(data[0])
    again = run_cli(base, cwd=tmp_path, env=fake.env, timeout=1200)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    s = summary(_records(run / "metrics.jsonl"))
    assert s["status"] == "ok" and s["steps"] == 6 and s["resumed_from_step"] == 2, s
    assert "is damaged and is skipped" in (run / "logs" / "worker-0.log").read_text()
    fs.invalidate_cache()
    assert fs.exists(f"{root}/{step4}.corrupt")  # set aside; the rerun then saved a new step 4 of its own
    after = {r["step"]: r["loss"] for r in _records(run / "metrics.jsonl") if r["kind"] == "step"}
    np.testing.assert_allclose([after[k] for k in (3, 4)], [before[k] for k in (3, 4)], rtol=1e-5)


@pytest.mark.slow
def test_torch_checkpoint_on_gcs_resumes_and_falls_back_from_a_damaged_step(tmp_path, fake):
    _damaged_fallback(tmp_path, fake, "torch")


@pytest.mark.slow
def test_jax_checkpoint_on_gcs_resumes_and_falls_back_from_a_damaged_step(tmp_path, fake):
    _damaged_fallback(tmp_path, fake, "jax")


def test_a_step_removal_on_gs_cut_short_leaves_no_complete_looking_step(gcs, monkeypatch):
    """Keep-N, a leftover cleared before a new save, a set-aside: on gs:// a step goes object by object, so its
    completion marker goes first; a removal cut short after that leaves an incomplete step (skipped), never a
    complete-looking one with objects missing."""
    import gcsfs
    from launch.core import objstore
    from torchrun_fsdp.storage import COMMIT, StepStore
    st = StepStore(f"gs://{gcs.bucket}/ck")
    for name in ("__0_0.distcp", ".metadata", "meta.json", COMMIT):
        st.fs.pipe_file(f"{gcs.bucket}/ck/step_1/{name}", b"x")
    assert [s for s, _ in st.complete()] == [1]

    def cut_short(self, path, recursive=False, **kwargs):
        raise OSError("connection reset")  # the bulk delete never happens

    with monkeypatch.context() as m:
        m.setattr(gcsfs.GCSFileSystem, "rm", cut_short)
        with pytest.raises(OSError):
            objstore.remove(st.step_path(1))
    assert st.complete() == [] and st.fs.exists(f"{gcs.bucket}/ck/step_1/__0_0.distcp")


@pytest.mark.slow
def test_torch_async_checkpoints_on_gs_go_through_the_checkpoint_process(tmp_path, gcs):
    """checkpoint.async=true (the default) on gs://: DCP's checkpoint process receives the storage writer through a
    pipe, so the copy-for-rename writer must pickle (a closure did not: every async save to gs:// failed)."""
    p, recs = run_cell(tmp_path, "framework=torch", "devices=2", "train.steps=4", "checkpoint.every=2",
                       "checkpoint.keep=2", "checkpoint.async=true", f"checkpoint.dir=gs://{gcs.bucket}/ck",
                       env=gcs.env, timeout=900)
    s = summary(recs)
    assert s["status"] == "ok" and s["steps"] == 4 and s.get("checkpoint_saves") == 2, s
    fs = gcs.fs()
    for step in (2, 4):
        assert fs.exists(f"{gcs.bucket}/ck/tiny/torch-d2/step_{step}/COMMIT"), fs.find(f"{gcs.bucket}/ck")
