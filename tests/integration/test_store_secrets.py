"""The store's credentials sent with `--secret-env` reach the agent, the store's writer, and not
only the job: `rgt deploy BOX --store s3://... --secret-env AWS_ACCESS_KEY_ID --secret-env
AWS_SECRET_ACCESS_KEY` on a box with no credentials of its own starts, seals to the store and
restores from it on a second start; the secrets win over credentials the box has; and a store
error quoting the key id is written redacted.

Real processes: the `rgt` CLI and `rgt-agent`, a test sshd as the box (whose sessions get the
store's endpoint and no credentials), and a SeaweedFS S3 server with its own identities.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict

from tests.conftest import Cli, _kill_run_processes, agent_exe
from tests.fakehub import FakeHub
from tests.laptop import laptop_env, run_rgt, ssh_target
from tests.seaweed import SeaweedServer, closed_port
from tests.sshd import start_sshd

# First attempt: writes step_1 (sealed while it runs); an attempt that resumes writes nothing.
JOB = (
    "import os, time\n"
    "resume = os.environ.get('RGT_RESUME_FROM', '')\n"
    "print('resume from: ' + repr(resume), flush=True)\n"
    "if not resume:\n"
    "    p = os.path.join(os.environ['RGT_CKPT_DIR'], 'step_1.pt')\n"
    "    with open(p + '.tmp', 'wb') as f:\n"
    "        f.write(b'y' * 8192)\n"
    "    os.rename(p + '.tmp', p)\n"
    "time.sleep(600)\n"
)


def _box_env(s3: SeaweedServer, **more: str) -> Dict[str, str]:
    """The box's own AWS configuration: where the store is, and no credentials (no config or
    credentials file, no instance metadata)."""
    env = {
        "AWS_ENDPOINT_URL": s3.endpoint,
        "AWS_REGION": s3.region,
        "AWS_CONFIG_FILE": os.path.join(s3.dir, "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": os.path.join(s3.dir, "no-aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    env.update(more)
    return env


def test_deploy_with_the_stores_secrets_seals_and_restores_on_a_box_without_credentials(
    tmp_path: Path, s3_server: SeaweedServer
) -> None:
    """Before, the secrets reached only the job: the agent's store preflight found no
    credentials and the start failed."""
    ctl, box_home = str(tmp_path / "ctl"), str(tmp_path / "box")
    proj = tmp_path / "proj"
    os.mkdir(ctl)
    proj.mkdir()
    (proj / "job.py").write_text(JOB)
    bucket = s3_server.bucket()
    server = start_sshd(str(tmp_path / "sshd"), set_env=_box_env(s3_server))
    laptop = {k: v for k, v in s3_server.env({}).items() if k.startswith("AWS")}
    env = laptop_env(ctl, box_home, **laptop)
    cli = Cli(box_home, dict(os.environ, RGT_HOME=box_home))
    name = f"secrets-{os.getpid()}"
    target = ssh_target(server)
    secrets = ["--secret-env", "AWS_ACCESS_KEY_ID", "--secret-env", "AWS_SECRET_ACCESS_KEY"]
    deploy = ["deploy", target, "--name", name, "--python", sys.executable, *secrets]
    try:
        p = run_rgt(
            [*deploy, "--store", f"s3://{bucket}/rgt", "--project", str(proj), "--"]
            + [sys.executable, "job.py"],
            env,
            ctl,
        )
        assert p.returncode == 0, p.stdout + p.stderr
        cli.wait_for(
            name,
            lambda s: any(e["kind"] == "sealed" for e in cli.events(name)),
            timeout=120,
            what="step 1 sealed",
        )
        p = run_rgt(["stop", name, "--grace", "1"], env, ctl)
        assert p.returncode == 0, p.stdout + p.stderr
        cli.wait_over(name, "STOPPED")
        # The second start must bring step 1 back from the store, not find it on the disk.
        spec = json.loads(Path(box_home, "runs", name, "spec.json").read_text())
        shutil.rmtree(spec["ckpt_dir"])
        p = run_rgt(deploy, env, ctl)
        assert p.returncode == 0, p.stdout + p.stderr
        cli.wait_for(
            name,
            lambda s: any(e["kind"] == "restored" for e in cli.events(name)),
            timeout=120,
            what="restored",
        )
        restored = [e for e in cli.events(name) if e["kind"] == "restored"]
        assert restored[-1]["step"] == 1 and "downloaded" in restored[-1]["reason"], restored
        out = cli.wait_output(name, "step_1")
        assert "resume from: ''" in out, out  # the first attempt
        got = s3_server.client().get_object(Bucket=bucket, Key=f"rgt/{name}/LATEST.json")
        assert json.loads(got["Body"].read())["step"] == 1
    finally:
        server.stop()
        _kill_run_processes(box_home)


def _set_secrets(cli: Cli, name: str, doc: Dict[str, str]) -> None:
    p = subprocess.run(
        [*agent_exe(), "secrets", name],
        env=cli.env,
        input=json.dumps(doc),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr


def test_every_rgt_agent_use_of_the_store_takes_the_runs_secrets_over_the_boxs_credentials(
    tmp_path: Path, s3_server: SeaweedServer
) -> None:
    """The box has credentials of its own, another identity's, which the store refuses; the
    run's secrets hold the right ones. Start (preflight, restore), sealing, `sync` with and
    without an agent, `checkpoints` and `restore` all use the secrets. A store error that quotes
    the secrets' key id never shows it whole. Before, every one of them used the box's own."""
    home = str(tmp_path / "box")
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "job.py").write_text(JOB)
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS")}
    box = _box_env(
        s3_server, AWS_ACCESS_KEY_ID="boxownkeyid", AWS_SECRET_ACCESS_KEY="boxownsecretkey"
    )
    cli = Cli(home, {**base, **box, "RGT_HOME": home})
    bucket, name = s3_server.bucket(), "agentsecrets"
    root = f"s3://{bucket}/rgt"
    right = {
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "WANDB_API_KEY": "the-job's-own-not-the-store's",
    }
    _set_secrets(cli, name, right)
    try:
        p = cli("start", "--name", name, "--store", root, "--", sys.executable, "job.py",
                cwd=str(proj))  # fmt: skip
        assert p.returncode == 0, p.stdout + p.stderr
        cli.wait_for(
            name,
            lambda s: any(e["kind"] == "sealed" for e in cli.events(name)),
            timeout=120,
            what="step 1 sealed",
        )
        p = cli("sync", name)  # asks the agent, then reads LATEST here
        assert p.returncode == 0 and "LATEST is step 1" in p.stdout, p.stdout + p.stderr
        cli("stop", name, "--grace", "1", check=True)
        cli.wait_over(name, "STOPPED")
        p = cli("sync", name)  # no agent: sealed from here, as the run's writer
        assert p.returncode == 0 and "LATEST is step 1" in p.stdout, p.stdout + p.stderr
        p = cli("checkpoints", "--store", root, "--name", name, "--json", check=True)
        rows = json.loads(p.stdout)
        assert [(r["step"], r["verified"]) for r in rows] == [(1, True)], rows
        dest = tmp_path / "restored"
        cli("restore", "--store", f"{root}/{name}", "--to", str(dest), check=True)
        assert (dest / "step_1.pt").read_bytes() == b"y" * 8192
        # A wrong secret key: the store's refusal names the key id, which is a secret here.
        _set_secrets(cli, name, {**right, "AWS_SECRET_ACCESS_KEY": "not-the-secret-key"})
        p = cli("sync", name)
        assert p.returncode != 0, p.stdout
        assert "the secret key does not match the access key" in p.stderr, p.stderr
        assert s3_server.access_key not in p.stdout + p.stderr
        for dirpath, _, files in os.walk(os.path.join(home, "runs", name)):
            for f in files:
                data = Path(dirpath, f).read_bytes()
                assert s3_server.access_key.encode() not in data, os.path.join(dirpath, f)
    finally:
        _kill_run_processes(home)


def test_an_hf_store_takes_the_runs_token_and_endpoint_over_the_boxs(tmp_path: Path) -> None:
    """`--store hf://user/repo --secret-env HF_TOKEN`: the box's own token (one the Hub does
    not know) and endpoint (nothing listens there) lose to the run's HF_TOKEN and HF_ENDPOINT
    secrets, for the start's preflight, the sealing, `checkpoints` and `restore` (a download of
    a private repo). Before, the agent used the box's own and the start failed."""
    hub = FakeHub().start()
    hub.add_token("hf_fake_bob_write", "bob")
    home = str(tmp_path / "box")
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "job.py").write_text(JOB)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    box = {
        "HF_HOME": str(tmp_path / "hf-home"),  # no saved token
        "HF_HUB_DISABLE_XET": "1",  # the fake Hub has no Xet
        "HF_TOKEN": "hf_fake_nobody",  # a token the Hub does not know
        "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}",
    }
    cli = Cli(home, {**base, **box, "RGT_HOME": home})
    name, root = "hfsecrets", "hf://bob/ckpts/rgt"
    _set_secrets(cli, name, {"HF_TOKEN": "hf_fake_bob_write", "HF_ENDPOINT": hub.url})
    try:
        p = cli("start", "--name", name, "--store", root, "--", sys.executable, "job.py",
                cwd=str(proj))  # fmt: skip
        assert p.returncode == 0, p.stdout + p.stderr
        cli.wait_for(
            name,
            lambda s: any(e["kind"] == "sealed" for e in cli.events(name)),
            timeout=120,
            what="step 1 sealed",
        )
        cli("stop", name, "--grace", "1", check=True)
        cli.wait_over(name, "STOPPED")
        p = cli("checkpoints", "--store", root, "--name", name, "--json", check=True)
        assert [(r["step"], r["verified"]) for r in json.loads(p.stdout)] == [(1, True)]
        dest = tmp_path / "restored"
        cli("restore", "--store", root, "--name", name, "--to", str(dest), check=True)
        assert (dest / "step_1.pt").read_bytes() == b"y" * 8192
        assert hub.file("bob/ckpts", f"rgt/{name}/LATEST.json") is not None
    finally:
        _kill_run_processes(home)
        hub.stop()
