"""The environment TorchTPU's multi-host start needs, computed and checked the way `torch_tpu` 0.2.0 does.

On a slice, `python -m torch.tpu.distributed` (torch_tpu's `set_tpu_launch_env`) turns
`TPU_WORKER_HOSTNAMES` (the workers, in worker order), `TORCH_TPU_DEVICES_PER_HOST` and `NODE_RANK`
into the variables every rank must agree on, then `torchrun --nnodes --node_rank --master_addr
--master_port --nproc_per_node=<chips per host>` starts one process per chip:

    TORCH_TPU_SLICEBUILDER_ADDRESSES  <host>:<TORCH_TPU_BASE_PORT (8070) + i> for every host, i < devices per host
    NNODES                            the number of hosts
    MASTER_ADDR                       the first host
    MASTER_PORT                       torch_tpu's default is 29500; scaleout picks one per job (below)
    TORCH_TPU_XPROF_SESSION_ID        one value for every host (torch_tpu defaults to the parent's clock,
                                      which differs per host when each host computes it)
    WORLD_SIZE                        the number of addresses

scaleout computes them itself (`launch_env`), so `scaleout plan` can show the exact command per
worker and no worker runs torch_tpu's bootstrap. `check` is what every rank asks before joining the
process group: the rules `set_tpu_launch_env` applies (and the ones its comments say make a
mismatched launch hang instead of fail), each broken one a sentence naming the variable.

Standard library only: the launcher (`launch.targets.tpu`) and the PyTorch trainer both use it.
"""

from __future__ import annotations

import hashlib
from typing import Dict, List, Mapping, Sequence

BASE_PORT = 8070  # TORCH_TPU_BASE_PORT's default in torch_tpu
MASTER_PORT_RANGE = (29500, 29900)  # torch_tpu's default is 29500; a port per job keeps two jobs apart


def master_port(job: str) -> int:
    """The rendezvous port of a job: within MASTER_PORT_RANGE, fixed by the job id (the same on every worker)."""
    lo, hi = MASTER_PORT_RANGE
    return lo + int(hashlib.sha256(job.encode()).hexdigest(), 16) % (hi - lo)


def session_id(job: str) -> str:
    """TORCH_TPU_XPROF_SESSION_ID: one number per job, the same on every host."""
    return str(int(hashlib.sha256(b"xprof:" + job.encode()).hexdigest()[:15], 16))


def launch_env(hosts: Sequence[str], devices_per_host: int, node_rank: int, master_port: int,
               session: str, base_port: int = BASE_PORT) -> Dict[str, str]:
    """Worker `node_rank`'s environment for torchrun, as `python -m torch.tpu.distributed` prints it
    (plus its inputs, which torch_tpu reads again in every rank)."""
    hosts = list(hosts)
    return {
        "TPU_WORKER_HOSTNAMES": ",".join(hosts),
        "TORCH_TPU_DEVICES_PER_HOST": str(devices_per_host),
        "TORCH_TPU_BASE_PORT": str(base_port),
        "TORCH_TPU_SLICEBUILDER_ADDRESSES": ",".join(f"{h}:{base_port + i}" for h in hosts for i in range(devices_per_host)),
        "TORCH_TPU_XPROF_SESSION_ID": session,
        "NNODES": str(len(hosts)),
        "NODE_RANK": str(node_rank),
        "MASTER_ADDR": hosts[0],
        "MASTER_PORT": str(master_port),
        "WORLD_SIZE": str(len(hosts) * devices_per_host),
    }


def torchrun_args(env: Mapping[str, str]) -> List[str]:
    """`python -m torch.distributed.run ...` for one worker: static rendezvous on the first host."""
    return ["-m", "torch.distributed.run", f"--nnodes={env['NNODES']}", f"--node_rank={env['NODE_RANK']}",
            f"--master_addr={env['MASTER_ADDR']}", f"--master_port={env['MASTER_PORT']}",
            f"--nproc_per_node={env['TORCH_TPU_DEVICES_PER_HOST']}"]


class LaunchEnvError(RuntimeError):
    """The environment a TorchTPU rank was started with is not one torch_tpu would run with."""


def _int(env: Mapping[str, str], name: str) -> int:
    value = (env.get(name) or "").strip()
    if not value.isdigit():
        raise LaunchEnvError(f"{name}={value or '(unset)'} is not a non-negative integer; TorchTPU's multi-host start "
                             "needs it (scaleout's TPU target sets it)")
    return int(value)


def check(env: Mapping[str, str]) -> None:
    """Raise LaunchEnvError naming the variable when this rank's environment breaks a rule of torch_tpu's
    `set_tpu_launch_env` or disagrees with what torchrun gave the rank (RANK, LOCAL_RANK, WORLD_SIZE)."""
    hosts = [h for h in (env.get("TPU_WORKER_HOSTNAMES") or "").split(",") if h]
    if not hosts:
        raise LaunchEnvError("TPU_WORKER_HOSTNAMES is unset: TorchTPU's multi-host start needs the comma-separated "
                             "worker hostnames or IP addresses")
    nnodes, node_rank, per_host = _int(env, "NNODES"), _int(env, "NODE_RANK"), _int(env, "TORCH_TPU_DEVICES_PER_HOST")
    if nnodes != len(hosts):
        raise LaunchEnvError(f"NNODES={nnodes} does not match the {len(hosts)} hosts of TPU_WORKER_HOSTNAMES "
                             f"({','.join(hosts)})")
    if node_rank >= nnodes:
        raise LaunchEnvError(f"NODE_RANK={node_rank} is not below NNODES={nnodes}")
    if env.get("MASTER_ADDR") != hosts[0]:
        raise LaunchEnvError(f"MASTER_ADDR={env.get('MASTER_ADDR')} is not the first host of TPU_WORKER_HOSTNAMES ({hosts[0]})")
    base = int(env.get("TORCH_TPU_BASE_PORT") or BASE_PORT)
    want = ",".join(f"{h}:{base + i}" for h in hosts for i in range(per_host))
    if env.get("TORCH_TPU_SLICEBUILDER_ADDRESSES") != want:
        raise LaunchEnvError(f"TORCH_TPU_SLICEBUILDER_ADDRESSES={env.get('TORCH_TPU_SLICEBUILDER_ADDRESSES')} is not one "
                             f"host:port per device of every host ({want})")
    if not (env.get("TORCH_TPU_XPROF_SESSION_ID") or "").strip():
        raise LaunchEnvError("TORCH_TPU_XPROF_SESSION_ID is unset: every host must be given the same value")
    world, rank, local = _int(env, "WORLD_SIZE"), _int(env, "RANK"), _int(env, "LOCAL_RANK")
    if world != nnodes * per_host:
        raise LaunchEnvError(f"WORLD_SIZE={world} is not NNODES x TORCH_TPU_DEVICES_PER_HOST = {nnodes * per_host}: "
                             "torchrun was not started with --nproc_per_node=<chips per host>")
    if local >= per_host or rank != node_rank * per_host + local:
        raise LaunchEnvError(f"RANK={rank} LOCAL_RANK={local} is not rank NODE_RANK x {per_host} + LOCAL_RANK of "
                             f"node {node_rank}")
