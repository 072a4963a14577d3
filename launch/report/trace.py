"""`scaleout trace PATH`: open a cell's profiler trace in the Perfetto UI.

PATH is a cell directory, its `profile/` or `profile/process-<i>/` directory, or a trace file. The
file served is the one Perfetto loads: JAX's newest `plugins/profile/<timestamp>/perfetto_trace.json.gz`,
PyTorch's `profile/traces/rank<i>.pt.trace.json.gz`, of process 0 unless PATH names another process
(its `profile/process-<i>` directory, or the trace file itself).

It is served the way Perfetto's own `tools/open_trace_in_ui` does: a local HTTP server on
127.0.0.1 (port 9001 by default, the one port ui.perfetto.dev's Content-Security-Policy lets it fetch
from) that answers with `Access-Control-Allow-Origin: https://ui.perfetto.dev`, and the link
`https://ui.perfetto.dev/#!/?url=http://127.0.0.1:PORT/NAME`. The trace stays on this machine: the
UI runs in the browser and fetches it from there.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shlex
import shutil
import sys
import threading
import webbrowser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import List, Optional
from urllib.parse import quote, unquote, urlsplit

from launch.common.files import CONFIG_NAME
from launch.core.profile import PROFILE_DIR, TRACES_DIR

log = logging.getLogger(__name__)

UI_ORIGIN = "https://ui.perfetto.dev"
DEFAULT_PORT = 9001
JAX_TRACE = "perfetto_trace.json.gz"
TORCH_TRACE = re.compile(r"^rank(\d+)\.pt\.trace\.json(\.gz)?$")
LOADABLE = (".json", ".json.gz", ".pftrace", ".perfetto-trace", ".pb.gz")  # what Perfetto's UI opens from a URL
WHAT = ("a cell directory, its profile/process-<i> or profile/traces directory, or a trace file "
        f"({JAX_TRACE} or rank<i>.pt.trace.json.gz) of a run made with profile.steps=[START,END]")


class TraceError(Exception):
    """PATH holds no trace, or the port cannot be used: one sentence."""


def _process_number(d: Path) -> int:
    m = re.fullmatch(r"process-(\d+)", d.name)
    return int(m.group(1)) if m else sys.maxsize


def _in_process_dir(d: Path) -> Optional[Path]:
    """The Perfetto-loadable trace of one process directory (or of a `plugins/profile/<ts>` directory)."""
    jax = sorted(d.glob(f"plugins/profile/*/{JAX_TRACE}"), key=lambda p: p.parent.name)
    if jax:
        return jax[-1]  # the newest capture: JAX names each after its start time
    if (d / JAX_TRACE).is_file():
        return d / JAX_TRACE
    n = _process_number(d)
    if n != sys.maxsize:  # PyTorch: process i's trace is rank i's, in the cell's shared traces directory
        for name in (f"rank{n}.pt.trace.json.gz", f"rank{n}.pt.trace.json"):
            if (d.parent / TRACES_DIR / name).is_file():
                return d.parent / TRACES_DIR / name
    torch = sorted((p for p in d.iterdir() if p.is_file() and TORCH_TRACE.match(p.name)),
                   key=lambda p: (int(TORCH_TRACE.match(p.name).group(1)), not p.name.endswith(".gz")))
    return torch[0] if torch else None


def process_dirs(profile_dir: Path) -> List[Path]:
    """`profile/process-<i>` directories, process 0 first."""
    if not profile_dir.is_dir():
        return []
    return sorted((d for d in profile_dir.iterdir() if d.is_dir() and _process_number(d) != sys.maxsize), key=_process_number)


def find(path: Path) -> Path:
    """The trace file PATH stands for (see the module docstring); TraceError if there is none."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"PATH={str(path)!r} does not exist; give {WHAT}.")
    if path.is_file():
        if path.name.endswith(".xplane.pb"):
            raise TraceError(f"PATH={str(path)!r} is XProf's format, which Perfetto does not open; give the "
                             f"{JAX_TRACE} beside it, or open it with `xprof --logdir={shlex.quote(str(xprof_logdir(path)))}`.")
        if not path.name.endswith(LOADABLE):
            raise TraceError(f"PATH={str(path)!r} is not a trace Perfetto opens (a .json, .json.gz or .pftrace file); give {WHAT}.")
        return path
    if (path / PROFILE_DIR).is_dir():  # a cell directory
        candidates = process_dirs(path / PROFILE_DIR)
    elif process_dirs(path):  # a cell's profile/ directory
        candidates = process_dirs(path)
    else:  # a process directory, or a capture's own directory
        candidates = [path]
    for d in candidates[:1]:  # process 0 (or the lowest traced one); another process: give its directory
        found = _in_process_dir(d)
        if found:
            return found
    cells = sorted(d.name for d in path.iterdir() if (d / PROFILE_DIR).is_dir() and (d / CONFIG_NAME).is_file())
    if cells:
        raise TraceError(f"PATH={str(path)!r} is a run directory; give one of its profiled cells: "
                         + ", ".join(str(path / c) for c in cells) + ".")
    if (path / CONFIG_NAME).is_file() and not (path / PROFILE_DIR).is_dir():
        raise TraceError(f"PATH={str(path)!r} is a cell that was not profiled (it has no {PROFILE_DIR}/ directory); "
                         "run it with profile.steps=[START,END], e.g. 'profile.steps=[5,7]'.")
    looked = candidates[0] if candidates else path
    raise TraceError(f"no trace under PATH={str(path)!r} (looked in {looked} for plugins/profile/*/{JAX_TRACE} and "
                     f"rank*.pt.trace.json.gz, and in {TRACES_DIR}/ beside it); give {WHAT}.")


def xprof_logdir(trace: Path) -> Path:
    """The directory XProf/TensorBoard take as --logdir for a JAX capture: the one holding plugins/profile/."""
    for parent in Path(trace).parents:
        if parent.name == "profile" and parent.parent.name == "plugins":
            return parent.parent.parent
    return Path(trace).parent


def ui_link(port: int, name: str) -> str:
    return f"{UI_ORIGIN}/#!/?url=http://127.0.0.1:{port}/{quote(name)}"


class _Handler(BaseHTTPRequestHandler):
    server: "TraceServer"

    def _headers(self, status: int, length: int = 0, kind: str = "application/octet-stream") -> None:
        self.send_response(status)
        self.send_header("Access-Control-Allow-Origin", UI_ORIGIN)
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def _is_trace(self) -> bool:
        """The request names the trace, through a loopback Host (a page that rebinds its own domain
        name to 127.0.0.1 sends its own name as Host and gets nothing)."""
        port = self.server.server_address[1]
        host_ok = self.headers.get("Host", "") in (f"127.0.0.1:{port}", f"localhost:{port}")
        return host_ok and unquote(urlsplit(self.path).path) == "/" + self.server.trace.name

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if not self._is_trace():
            body = f"only /{self.server.trace.name} is served here\n".encode()
            self._headers(404, len(body), "text/plain; charset=utf-8")
            self.wfile.write(body)
            return
        with open(self.server.trace, "rb") as f:
            self._headers(200, os.fstat(f.fileno()).st_size)
            shutil.copyfileobj(f, self.wfile)
        log.info(f"sent {self.server.trace.name} to {self.headers.get('Origin') or self.client_address[0]}")

    def do_HEAD(self) -> None:  # noqa: N802
        self._headers(200 if self._is_trace() else 404, self.server.trace.stat().st_size if self._is_trace() else 0)

    def do_OPTIONS(self) -> None:  # noqa: N802 (a CORS preflight, should a browser send one)
        self.send_response(204)
        self.send_header("Access-Control-Allow-Origin", UI_ORIGIN)
        self.send_header("Access-Control-Allow-Methods", "GET, HEAD, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "*")
        self.end_headers()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        log.debug(format % args)


class TraceServer(ThreadingHTTPServer):
    """Serves one trace file on 127.0.0.1:PORT to the Perfetto UI."""

    daemon_threads = True

    def __init__(self, trace: Path, port: int = DEFAULT_PORT):
        self.trace = Path(trace).resolve()
        try:
            super().__init__(("127.0.0.1", port), _Handler)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise TraceError(f"--port {port} is in use on 127.0.0.1 (another `scaleout trace`, or Perfetto's "
                                 "trace_processor --httpd?); stop that, or give a free port with --port.") from None
            raise TraceError(f"--port {port} cannot be listened on at 127.0.0.1 ({e.strerror or e}); give a free "
                             f"port from 1024 to 65535 ({DEFAULT_PORT}, the default, is the one ui.perfetto.dev fetches from).") from None

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/{quote(self.trace.name)}"

    @property
    def link(self) -> str:
        return ui_link(self.port, self.trace.name)

    def handle_error(self, request, client_address) -> None:
        # a browser that closes the connection mid-transfer is not an error worth a traceback
        log.debug(f"connection from {client_address[0]} ended: {sys.exc_info()[1]!r}")

    def start(self) -> threading.Thread:
        """Serve in a background thread (tests; `serve_forever` in the foreground otherwise)."""
        t = threading.Thread(target=self.serve_forever, name="scaleout-trace", daemon=True)
        t.start()
        return t


def can_open_browser() -> bool:
    """A graphical browser is likely: $BROWSER is set, or not a Linux host without a display (SSH, a cluster node)."""
    if os.environ.get("BROWSER"):
        return True
    if sys.platform.startswith("linux"):
        return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
    return True


def open_browser(link: str) -> bool:
    if not can_open_browser():
        return False
    try:
        return bool(webbrowser.open_new_tab(link))
    except webbrowser.Error:
        return False
