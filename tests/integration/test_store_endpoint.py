"""The laptop reads a run's store at the endpoint the box writes it at: a job file's ``[store]``
table with ``endpoint_url`` (MinIO, R2, any S3-compatible store) is recorded with the run, so
`rgt status` while the box does not answer and `rgt pull --from store` reach that store, not
boto3's own endpoint (AWS, or whatever ``AWS_ENDPOINT_URL`` says on the laptop).

Real processes: the `rgt` CLI, a test sshd as the box (stopped to make the box not answer) and a
SeaweedFS S3 server; boto3's configured endpoint, on the laptop and on the box, is a closed port.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.conftest import Cli, _kill_run_processes
from tests.laptop import laptop_env, run_rgt, ssh_target
from tests.seaweed import SeaweedServer, closed_port
from tests.sshd import start_sshd

WRITE_ONE = (
    "import os\n"
    "p = os.path.join(os.environ['RGT_CKPT_DIR'], 'step_1.pt')\n"
    "with open(p + '.tmp', 'wb') as f:\n"
    "    f.write(b'x' * 4096)\n"
    "os.rename(p + '.tmp', p)\n"
)


def test_status_and_pull_read_the_store_at_the_job_files_endpoint(
    tmp_path: Path, s3_server: SeaweedServer
) -> None:
    """Before, the laptop recorded only the store's URL and opened it at boto3's default
    endpoint: with the box gone `rgt status` failed to reach the store, and so did the pull."""
    nowhere = f"http://127.0.0.1:{closed_port()}"
    aws = {k: v for k, v in s3_server.env({}, AWS_ENDPOINT_URL=nowhere).items() if "AWS" in k}
    ctl, box_home = str(tmp_path / "ctl"), str(tmp_path / "box")
    proj = tmp_path / "proj"
    os.mkdir(ctl)
    proj.mkdir()
    (proj / "job.py").write_text(WRITE_ONE)
    bucket = s3_server.bucket()
    (proj / "job.toml").write_text(
        f'command = ["{sys.executable}", "job.py"]\n'
        f'[store]\nurl = "s3://{bucket}/rgt"\nendpoint_url = "{s3_server.endpoint}"\n'
        'stall = "7m"\n'
    )
    server = start_sshd(str(tmp_path / "sshd"), set_env=aws)  # the box's own AWS configuration
    env = laptop_env(ctl, box_home, **aws)
    cli = Cli(box_home, dict(os.environ, RGT_HOME=box_home))
    name = f"endpoint-{os.getpid()}"
    argv = ["deploy", ssh_target(server), "--name", name, "--python", sys.executable]
    try:
        p = run_rgt([*argv, "--project", str(proj), str(proj / "job.toml")], env, ctl)
        assert p.returncode == 0, p.stderr
        cli.wait_over(name, "SUCCEEDED")
        server.stop()
        p = run_rgt(["status", name, "--json"], env, ctl, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        doc = json.loads(p.stdout)
        assert doc["source"] == "store" and doc["box_unreachable"], doc
        assert doc["state"] == "SUCCEEDED", doc
        dest = tmp_path / "pulled"
        p = run_rgt(["pull", name, "--to", str(dest), "--from", "store"], env, ctl, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        assert (dest / "checkpoints" / "step_1.pt").read_bytes() == b"x" * 4096
        # The job file's stall is the pull's bound too (the record keeps it, in seconds).
        runs = json.loads(Path(ctl, "runs.json").read_text())["runs"][name]
        assert runs["store"] == f"s3://{bucket}/rgt", runs
        assert runs["store_endpoint_url"] == s3_server.endpoint, runs
        assert runs["store_stall"] == 420.0, runs
    finally:
        server.stop()
        _kill_run_processes(box_home)
