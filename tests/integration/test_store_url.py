"""The store URL as the job file gives it: a ``[store]`` table's ``endpoint_url`` is where the
S3 store is reached, over boto3's own configuration (``AWS_ENDPOINT_URL``), in the preflight
that ``run`` does and in the agent that seals from spec.json."""

from __future__ import annotations

import json
import os
import sys

from onbox.sealing import manifest as mf
from tests.conftest import Cli
from tests.seaweed import SeaweedServer, closed_port

WRITE_ONE = (
    "import os\n"
    "p = os.path.join(os.environ['RGT_CKPT_DIR'], 'step_1.pt')\n"
    "with open(p + '.tmp', 'wb') as f:\n"
    "    f.write(b'x' * 4096)\n"
    "os.rename(p + '.tmp', p)\n"
)


def test_a_job_files_endpoint_url_reaches_the_s3_store(cli: Cli, s3_server: SeaweedServer) -> None:
    # boto3's configuration points nowhere: only the job file's endpoint_url can reach the server.
    cli.env.update(s3_server.env(cli.env, AWS_ENDPOINT_URL=f"http://127.0.0.1:{closed_port()}"))
    bucket = s3_server.bucket()
    job = os.path.join(cli.home, "ep.toml")
    with open(job, "w") as f:
        f.write(
            f"command = {json.dumps([sys.executable, '-c', WRITE_ONE])}\n"
            f'[store]\nurl = "s3://{bucket}/rgt"\nendpoint_url = "{s3_server.endpoint}"\n'
        )
    p = cli("run", job, "--name", "ep", timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "run ep ended SUCCEEDED" in p.stdout
    with open(os.path.join(cli.home, "runs", "ep", "spec.json")) as f:
        spec = json.load(f)
    assert spec["store"] == f"s3://{bucket}/rgt"  # the same string on disk as a plain store
    body = s3_server.client().get_object(Bucket=bucket, Key="rgt/" + mf.latest_key("ep"))["Body"]
    assert json.loads(body.read())["step"] == 1
