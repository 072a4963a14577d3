"""The JAX trainer's profiler: `jax.profiler` traces and their breakdown (see `launch.core.profile`).

`start_trace(dir, create_perfetto_trace=True)` writes, under
`CELL/profile/process-<i>/plugins/profile/<timestamp>/`, the XSpace (`<host>.xplane.pb`: XProf /
TensorBoard's profile plugin) and `perfetto_trace.json.gz` (Perfetto, chrome://tracing), which
this module reads back for the breakdown.

An op is an event carrying `args.hlo_op` of the compiled train step's module on the examined
device (`args.device_ordinal`, or the `/device:<kind>:<n>` process it sits in). Which category an
op belongs to is read from the compiled HLO (`compiled.as_text()`, saved next to the trace as
`train_step.hlo.txt`): collectives by opcode (all-gather, reduce-scatter, all-reduce, all-to-all,
collective-permute, their -start/-done halves); matmul/attention for `dot`, `convolution`, and
custom calls to GEMM/attention kernels (cuBLAS/cuDNN, Pallas/Mosaic); a fusion takes the
category of what it fuses, so a fusion holding a dot counts as matmul for its whole duration
(XLA fuses the dot's epilogue into it). `while`/`call`/`conditional` are containers: the ops
inside them are classified, the container itself counts as other compute.

On CPU, XLA:CPU emits one event per executed thunk only with `--xla_cpu_enable_xprof_traceme=true`,
which the trainer sets when `profile.steps` is set (`jaxrun.__main__`); that flag is the only
difference profiling makes to the program.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

import jax

from launch.core import profile

COLLECTIVE_OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
                  "collective-broadcast", "ragged-all-to-all", "send", "recv")
MATMUL_OPS = ("dot", "convolution", "ragged-dot")
MATMUL_TARGETS = re.compile(r"gemm|matmul|cublas|cudnn|attention|flash|splash|mosaic|tpu_custom_call|triton", re.I)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"(?<![\w.\-])([a-z][a-z0-9\-]*)\(")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def hlo_categories(text: str) -> Dict[str, str]:
    """HLO instruction name -> breakdown category, for every instruction of a module's text."""
    comps: Dict[str, List[tuple]] = {}
    current: Optional[str] = None
    for line in text.splitlines():
        if not line.startswith((" ", "\t")):
            m = _COMPUTATION.match(line)
            current = m.group(1) if m and not line.startswith("HloModule") else None
            if current:
                comps[current] = []
            continue
        m = _INSTRUCTION.match(line)
        if current is None or not m:
            continue
        name, rest = m.groups()
        op = _OPCODE.search(rest)
        opcode = op.group(1) if op else ""
        calls = _CALLS.search(rest) if opcode == "fusion" else None
        target = _TARGET.search(rest)
        comps[current].append((name, opcode, calls.group(1) if calls else None, target.group(1) if target else ""))

    memo: Dict[str, str] = {}

    def of_computation(comp: str, seen: frozenset = frozenset()) -> str:
        if comp in memo:
            return memo[comp]
        cats = {of_instruction(*ins, seen=seen | {comp}) for ins in comps.get(comp, ()) if comp not in seen}
        memo[comp] = next((c for c in profile.PRIORITY if c in cats), "other_compute")
        return memo[comp]

    def of_instruction(name: str, opcode: str, calls: Optional[str], target: str, seen: frozenset = frozenset()) -> str:
        base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode[:-len("-done")] if opcode.endswith("-done") else opcode
        if base in COLLECTIVE_OPS:
            return "collectives"
        if base in MATMUL_OPS or (opcode == "custom-call" and MATMUL_TARGETS.search(target)):
            return "matmul_attention"
        if calls and calls not in seen:
            return of_computation(calls, seen)
        return "other_compute"

    return {ins[0]: of_instruction(*ins) for comp in comps.values() for ins in comp}


def module_name(text: str) -> str:
    first = text.split("\n", 1)[0]
    m = re.match(r"HloModule\s+([\w.\-]+)", first)
    return m.group(1) if m else ""


class JaxCapture:
    """`jax.profiler` over the profile window of one process."""

    def __init__(self, directory: Path, compiled: Any, device: Any):
        self.directory = Path(directory)
        self.text = compiled.as_text()
        self.module = module_name(self.text)
        self.categories = hlo_categories(self.text)
        local = getattr(device, "local_hardware_id", None)  # the n of /device:GPU:n on this host; 0 is a valid one
        self.names = {str(x) for x in (local, device.id) if x is not None}  # how the trace may name this device
        self.ordinal = str(local if local is not None else device.id)
        self.device_kind = device.platform
        self.active = False
        self.files: List[Path] = []

    def start(self, first: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "train_step.hlo.txt").write_text(self.text)
        jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
        self.active = True

    def next_step(self, n: int) -> None:
        """Nothing: XProf finds steps by the StepTraceAnnotation around each one (`step`)."""

    def step(self, n: int):
        return jax.profiler.StepTraceAnnotation(profile.STEP_SPAN, step_num=n)

    def data(self):
        return jax.profiler.TraceAnnotation(profile.DATA_SPAN) if self.active else contextlib.nullcontext()

    def stop(self) -> List[Path]:
        if self.active:
            self.active = False
            jax.profiler.stop_trace()
        runs = sorted((self.directory / "plugins" / "profile").glob("*"))
        self.files = sorted(runs[-1].iterdir()) if runs else []
        return self.files

    def perfetto(self) -> Optional[Path]:
        return next((f for f in self.files if f.name == "perfetto_trace.json.gz"), None)

    def breakdown(self) -> List[Dict[str, Any]]:
        trace = self.perfetto()
        if trace is None:
            raise FileNotFoundError(f"jax.profiler wrote no perfetto_trace.json.gz under {self.directory}")
        events, processes = profile.load_trace(trace)
        device_pids = {}  # pid -> device number of the `/device:GPU:n` / `/device:TPU:n` processes
        for pid, name in processes.items():
            m = re.match(r"/device:(?:GPU|TPU):(\d+)", name)
            if m:
                device_pids[pid] = m.group(1)
        self.ordinal = self._pick(set(device_pids.values()) if device_pids else
                                  {str(e["args"]["device_ordinal"]) for e in events
                                   if "device_ordinal" in (e.get("args") or {}) and e["args"].get("hlo_module") == self.module})
        return profile.breakdown(events, lambda e: self.classify(e, device_pids))

    def _pick(self, seen: set) -> str:
        """This process's first device as the trace names it: its local or global number, else (a
        numbering of the runtime's own, as XLA:CPU's with several processes) the lowest one seen."""
        hit = seen & self.names
        if hit:
            return min(hit, key=int)
        return min(seen, key=lambda x: int(x) if x.isdigit() else 0) if seen else self.ordinal

    def classify(self, e: Dict[str, Any], device_pids: Dict[int, str]) -> Optional[str]:
        if e.get("name") == profile.DATA_SPAN:
            return "host_data"
        args = e.get("args") or {}
        op = args.get("hlo_op")
        if op is None or args.get("hlo_module", self.module) != self.module:
            return None
        if device_pids:  # GPU/TPU: ops on the device's own timeline only (not host-side launches)
            if device_pids.get(e.get("pid")) != self.ordinal:
                return None
        elif str(args.get("device_ordinal", self.ordinal)) != self.ordinal:
            return None
        return self.categories.get(op, "other_compute")
