"""plan's figures against hand-computed values, and the 300m parameter count."""

import json

from launch import config
from launch.launcher import plan


def tiny_by_hand():
    d, L, f, V, T = 64, 2, 128, 256, 32
    matmul = L * (4 * d * d + 3 * d * f) + d * V
    total = matmul + V * d + L * 2 * d + d
    return matmul, total, 6 * matmul + 12 * L * T * d


def test_tiny_figures(scaleout):
    code, out, err = scaleout("plan", "--json")
    assert code == 0, err
    p = json.loads(out)
    matmul, total, fpt = tiny_by_hand()
    assert (p["params_matmul"], p["params"], p["flops_per_token"]) == (98304, 115008, 638976) == (matmul, total, fpt)
    for key in ("params", "params_per_device", "flops_per_token", "bytes_per_device", "mesh", "commands"):
        assert key in p
    assert p["bytes_per_device"]["weights"] == 4 * total
    assert p["bytes_per_device"]["optimizer"] == 8 * total


def test_tiny_sharded_per_device_jax():
    p = plan.describe(config.load(["devices=4"]))
    d, L, f, V = 64, 2, 128, 256
    # fsdp=4 splits every weight's embed dim by 4; norms stay whole
    expected = (L * (4 * d * d + 3 * d * f) + 2 * V * d) // 4 + L * 2 * d + d
    assert p["params_per_device"] == expected
    assert p["mesh"]["axes"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert p["mesh"]["batch"]["per_device"] == 2
    wq = next(r for r in p["mesh"]["weights"] if r["name"] == "layers.attention.wq")
    assert wq["split"] == [None, "fsdp", "tensor"] and wq["local_shape"] == [2, 16, 64]


def test_tiny_tensor_parallel_split():
    p = plan.describe(config.load(["devices=4", "parallel.fsdp=2", "parallel.tensor=2"]))
    w1 = next(r for r in p["mesh"]["weights"] if r["name"] == "layers.feed_forward.w1")
    assert w1["local_shape"] == [2, 32, 64]


def test_torch_fsdp_shards_dim0():
    p = plan.describe(config.load(["framework=torch", "devices=4"]))
    total = 115008
    assert p["params_per_device"] == total // 4  # every dim 0 here divides by 4
    assert "torch.distributed.run" in p["commands"][0] and "--nproc_per_node=4" in p["commands"][0]


def test_300m_param_count(scaleout):
    code, out, _ = scaleout("plan", "model=300m", "--json")
    p = json.loads(out)
    assert 280e6 <= p["params"] <= 360e6


def test_text_plan_lists_commands(scaleout):
    code, out, _ = scaleout("plan", "devices=2")
    assert code == 0
    assert "--xla_force_host_platform_device_count=2" in out and "-m jaxrun --config" in out
    assert "params: 115,008 total" in out


def test_datasheet_peaks_match_the_most_specific_name():
    """H100 PCIe and the NVL parts are not the SXM figure; Blackwell is known (issue 12.7)."""
    from launch.core.flops import datasheet_peak
    assert datasheet_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert datasheet_peak("NVIDIA H100 PCIe") == 756e12
    assert datasheet_peak("NVIDIA H100 NVL") == 835e12
    assert datasheet_peak("NVIDIA H200 NVL") == 835e12 and datasheet_peak("NVIDIA H200") == 989e12
    assert datasheet_peak("NVIDIA B200") == 2250e12 and datasheet_peak("NVIDIA GB200") == 2500e12
    assert datasheet_peak("TPU v5 lite") == 197e12 and datasheet_peak("cpu") is None
