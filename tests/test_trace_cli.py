"""`scaleout trace PATH`: a cell's profiler trace served to the Perfetto UI (issue 18)."""

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest
from conftest import ROOT, run_cell, run_cli

from launch.report import trace

UI = "https://ui.perfetto.dev"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(path, tmp_path, *extra):
    """`scaleout trace PATH --no-browser` as a subprocess; returns it and its printed Perfetto link."""
    p = subprocess.Popen([sys.executable, "-m", "launch", "trace", str(path), "--no-browser", *extra], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "BROWSER": ""})
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("Ctrl-C stops serving"):
            break
    else:
        raise AssertionError("scaleout trace ended before serving: " + "".join(lines) + p.stderr.read())
    link = next(l.split(": ", 1)[1].strip() for l in lines if l.startswith("open in Perfetto: "))
    return p, link, "".join(lines)


def _stop(p):
    p.send_signal(signal.SIGINT)  # Ctrl-C
    out, err = p.communicate(timeout=30)
    return p.returncode, out, err


def _fake_cell(tmp_path, name="torch-d1", trace_name="rank0.pt.trace.json.gz"):
    """A PyTorch cell directory whose rank 0 has a small gzipped Chrome trace (in profile/traces/) and a
    breakdown (in profile/process-0/)."""
    d = tmp_path / "run" / name / "profile" / "traces"
    d.mkdir(parents=True)
    (d.parent / "process-0").mkdir()
    (d.parent / "process-0" / "breakdown.json").write_text("{}")
    (tmp_path / "run" / name / "config.yaml").write_text("framework: torch\n")
    with gzip.open(d / trace_name, "wt") as f:
        json.dump({"traceEvents": [{"ph": "X", "name": "scaleout/step#2", "ts": 0, "dur": 10, "pid": 1, "tid": 1}]}, f)
    return tmp_path / "run" / name, d / trace_name


@pytest.mark.slow
def test_serves_a_real_trace_to_perfetto(tmp_path):
    """A profiled run's trace is found from the cell directory, served with the CORS header the Perfetto
    UI needs, byte for byte, and Ctrl-C ends the server cleanly."""
    _, recs = run_cell(tmp_path, "profile.steps=[2,3]", "train.steps=4")
    prof = [r for r in recs if r["kind"] == "profile"][-1]
    assert prof["error"] is None, prof["error"]
    cell = tmp_path / "runs" / "tiny" / "jax-d1"
    want = next(cell / f for f in prof["files"] if f.endswith(trace.JAX_TRACE))
    # the cell, its process directory and the file itself all stand for the same trace
    assert trace.find(cell) == trace.find(cell / "profile" / "process-0") == trace.find(want) == want

    port = _free_port()
    p, link, out = _start(cell, tmp_path, "--port", str(port))
    try:
        url = f"http://127.0.0.1:{port}/{trace.JAX_TRACE}"
        assert link == f"{UI}/#!/?url={url}"
        assert f"xprof --logdir={cell / 'profile' / 'process-0'}" in out
        req = urllib.request.Request(url, headers={"Origin": UI})
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
            assert r.status == 200
            assert r.headers["Access-Control-Allow-Origin"] == UI
        assert body == want.read_bytes()
        assert json.loads(gzip.decompress(body))["traceEvents"]  # what Perfetto gets is the trace itself
        sibling = next(f for f in want.parent.iterdir() if f != want)  # the capture's xplane.pb, next to it
        for other in (f"/{sibling.name}", "/../../../../config.yaml"):
            with pytest.raises(urllib.error.HTTPError) as e:  # nothing else is served
                urllib.request.urlopen(f"http://127.0.0.1:{port}{other}", timeout=30)
            assert e.value.code == 404, other
        rebound = urllib.request.Request(url, headers={"Host": f"attacker.example:{port}"})
        with pytest.raises(urllib.error.HTTPError) as e:  # DNS rebinding: the page's own name as Host
            urllib.request.urlopen(rebound, timeout=30)
        assert e.value.code == 404
    finally:
        code, rest, err = _stop(p)
    assert code == 0 and "stopped serving" in rest, err
    assert "Traceback" not in err, err


def test_serves_a_torch_trace_from_its_process_directory(tmp_path):
    cell, want = _fake_cell(tmp_path)
    (want.parent / "rank0.pt.trace.json").write_text("{}")  # an uncompressed copy: the .gz one is picked
    assert trace.find(cell) == trace.find(want.parent) == trace.find(cell / "profile" / "process-0") == want
    p, link, _ = _start(want.parent, tmp_path, "--port", "0")  # 0: any free port, the link names it
    try:
        url = link.split("url=", 1)[1]
        assert url.endswith("/rank0.pt.trace.json.gz")
        with urllib.request.urlopen(url, timeout=30) as r:
            assert r.read() == want.read_bytes() and r.headers["Access-Control-Allow-Origin"] == UI
    finally:
        code, _, err = _stop(p)
    assert code == 0 and "Traceback" not in err, err


def test_newest_jax_capture_is_picked(tmp_path):
    d = tmp_path / "process-0" / "plugins" / "profile"
    for ts in ("2026_01_02_10_00_00", "2026_01_02_09_00_00"):
        (d / ts).mkdir(parents=True)
        (d / ts / trace.JAX_TRACE).write_bytes(b"x")
        (d / ts / "host.xplane.pb").write_bytes(b"x")
    assert trace.find(tmp_path / "process-0") == d / "2026_01_02_10_00_00" / trace.JAX_TRACE
    assert trace.xprof_logdir(d / "2026_01_02_10_00_00" / trace.JAX_TRACE) == tmp_path / "process-0"


@pytest.mark.parametrize("what", ["no trace", "not profiled", "missing", "run dir", "xplane", "not a trace"])
def test_bad_path_is_one_sentence(tmp_path, what):
    cell, _ = _fake_cell(tmp_path)
    empty = tmp_path / "run" / "jax-d1"
    (empty / "profile" / "process-0").mkdir(parents=True)
    (empty / "config.yaml").write_text("framework: jax\n")
    path, expect = {
        "no trace": (empty, f"no trace under PATH='{empty}'"),
        "not profiled": (tmp_path / "run" / "jax-d2", "is a cell that was not profiled"),
        "missing": (tmp_path / "nope", "does not exist"),
        "run dir": (tmp_path / "run", f"is a run directory; give one of its profiled cells: {empty}, {cell}"),
        "xplane": (tmp_path / "h.xplane.pb", "is XProf's format"),
        "not a trace": (cell / "config.yaml", "is not a trace Perfetto opens"),
    }[what]
    (tmp_path / "run" / "jax-d2").mkdir()
    (tmp_path / "run" / "jax-d2" / "config.yaml").write_text("framework: jax\n")
    if what == "xplane":
        path.write_bytes(b"x")
    p = run_cli(["trace", str(path), "--no-browser"], cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert expect in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_busy_port_is_one_sentence(tmp_path):
    cell, _ = _fake_cell(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = run_cli(["trace", str(cell), "--no-browser", "--port", str(port)], cwd=tmp_path, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"--port {port} is in use on 127.0.0.1" in p.stderr and "Traceback" not in p.stderr, p.stderr
    # issue 24.16: the ports the message names are the ports accepted (80 was served)
    for bad in ("70000", "80", "1023", "-1"):
        p = run_cli(["trace", str(cell), "--no-browser", "--port", bad], cwd=tmp_path, timeout=30)
        assert p.returncode == 2 and f"--port {bad} is not valid: give a port from 1024 to 65535" in p.stderr, p.stderr


def test_cli_help_names_the_verb():
    p = subprocess.run([sys.executable, "-m", "launch", "trace", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "--no-browser" in p.stdout and "--port" in p.stdout
