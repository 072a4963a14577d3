"""Follow one TPU worker's detached trainer: stream its log and exit with the trainer's exit status.

    python tpu_follow.py SPEC_JSON

SPEC_JSON: {"worker": i, "argv": [gcloud ... tpu-vm ssh NODE --worker=i --zone=... --command=...],
"retries": n, "backoff_s": s}; the `--command=` word holds `@OFFSET@`, replaced by the next byte
to read. The remote command (`tpu_commands.Commands.follow`) prints the log on stdout and ends
with a `scaleout-exit: <status>` line on stderr. An ssh connection that ends without that line
was lost, not the trainer (which runs detached on the worker): the follower reconnects from the
last byte received, up to `retries` times in a row with growing pauses.

Run as a file (not `-m launch...`), so it starts with the standard library only; the TPU target
runs one per worker as a process group member of `launch.targets.procs` (fail-fast, stop).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

EXIT_MARK = "scaleout-exit:"  # tpu_commands.EXIT_MARK
OFFSET = "@OFFSET@"
KILLED = 137


def main(argv) -> int:
    spec = json.loads(argv[1])
    worker, retries, backoff = spec["worker"], int(spec.get("retries", 5)), float(spec.get("backoff_s", 1.0))
    received = 0
    failures = 0
    out = sys.stdout.buffer
    while True:
        args = [a.replace(OFFSET, str(received + 1)) for a in spec["argv"]]
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        status = []
        before = received

        def read_err() -> None:
            for raw in iter(p.stderr.readline, b""):
                line = raw.decode(errors="replace").rstrip("\n")
                if line.startswith(EXIT_MARK):
                    status.append(line[len(EXIT_MARK):].strip())
                else:
                    sys.stderr.write(line + "\n")
                    sys.stderr.flush()

        t = threading.Thread(target=read_err, daemon=True)
        t.start()
        for chunk in iter(lambda: p.stdout.read1(65536), b""):
            out.write(chunk)
            out.flush()
            received += len(chunk)
        code = p.wait()
        t.join()
        if status:
            word = status[-1]
            if word.lstrip("-").isdigit():
                return int(word)
            if word == "nostart":
                print(f"[scaleout] error: the trainer did not start on worker {worker} (no pid file)", flush=True)
                return 1
            print(f"[scaleout] error: the trainer on worker {worker} ended without an exit status "
                  "(killed outright, or its VM restarted)", flush=True)
            return KILLED
        failures = 0 if received > before else failures + 1
        if failures > retries:
            print(f"[scaleout] error: lost the connection to worker {worker} {failures} times in a row "
                  f"(gcloud ssh exit code {code}); the trainer may still be running there", flush=True)
            return 255
        pause = min(backoff * 2 ** max(failures - 1, 0), 60.0)
        sys.stderr.write(f"[scaleout] the connection to worker {worker} ended (gcloud ssh exit code {code}); "
                         f"reconnecting from byte {received + 1} in {pause:g} s\n")
        sys.stderr.flush()
        time.sleep(pause)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.exit(main(sys.argv))
