"""launch/: the TPU VM and GKE/XPK scripts (through --dry-run and stub gcloud/xpk) and the Colab notebook."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
TPU_VM = LAUNCH / "tpu_vm.sh"
GKE = LAUNCH / "gke_xpk.sh"
NOTEBOOK = LAUNCH / "colab_tpu.ipynb"
MAKE_COLAB = LAUNCH / "make_colab.py"

# Arguments that a careless join or an extra layer of shell would change.
TRICKY = ["dgemma", "generate", "--checkpoint", "gs://bucket/dir with space", "--prompt",
          "hi there, it's \"me\"", "$HOME", "a;b && c", "*", "", "back\\slash", "héllo", "--temp=0.5"]

BASE = ["--name", "dg-test", "--zone", "us-east5-b"]


def sh(script: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=30,
                          env=full_env, cwd=ROOT)


def commands(stdout: str) -> list[list[str]]:
    """The argv of every '+ ' line of a dry run."""
    return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("+ ")]


def dry(script: Path, *args: str) -> list[list[str]]:
    r = sh(script, "--dry-run", *args)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr
    for line in r.stdout.splitlines():
        assert line.startswith(("+ ", "# ")), f"unparseable dry-run line: {line!r}"
    return commands(r.stdout)


def gcloud(cmds, *sub: str) -> list[list[str]]:
    """The gcloud commands whose subcommand words start with `sub`."""
    n = 1 + len(sub)
    return [c for c in cmds if c[0] == "gcloud" and tuple(c[1:n]) == sub]


def flag(cmd: list[str], name: str) -> str | None:
    """The value of --name=VALUE or --name VALUE in argv."""
    for i, w in enumerate(cmd):
        if w.startswith(name + "="):
            return w[len(name) + 1:]
        if w == name and i + 1 < len(cmd):
            return cmd[i + 1]
    return None


def after_last_and(shell_string: str) -> list[str]:
    """The words of the last `&&`-separated part of a remote shell string."""
    words = shlex.split(shell_string)
    idx = max(i for i, w in enumerate(words) if w == "&&")
    return words[idx + 1:]


def ssh_commands(cmds) -> list[str]:
    return [flag(c, "--command") for c in gcloud(cmds, "compute", "tpus", "tpu-vm", "ssh")]


# =============================================================================== tpu_vm.sh
class TestTpuVmDryRun:
    def test_help(self):
        r = sh(TPU_VM, "--help")
        assert r.returncode == 0
        for word in ("Usage:", "--name", "--zone", "--accelerator", "--queued", "--reuse", "--dry-run", "--worker=all"):
            assert word in r.stdout

    def test_no_arguments_prints_usage_and_exits_2(self):
        r = sh(TPU_VM)
        assert r.returncode == 2 and "Usage:" in r.stderr and r.stdout == ""

    def test_create_path(self):
        cmds = dry(TPU_VM, *BASE, "--", "dgemma", "generate", "--prompt", "hi")
        create = gcloud(cmds, "compute", "tpus", "tpu-vm", "create")
        assert len(create) == 1
        c = create[0]
        assert c[5] == "dg-test"
        assert flag(c, "--zone") == "us-east5-b"
        assert flag(c, "--accelerator-type") == "v5litepod-8"
        assert flag(c, "--version") == "v2-alpha-tpuv5-lite"
        assert "--spot" not in c and flag(c, "--project") is None
        assert not gcloud(cmds, "compute", "tpus", "queued-resources")
        assert not gcloud(cmds, "compute", "tpus", "tpu-vm", "describe")
        assert not gcloud(cmds, "compute", "tpus", "tpu-vm", "delete")
        # copy: tar locally, scp to every worker, unpack on every worker
        tar = [c for c in cmds if c[0] == "tar"]
        assert len(tar) == 1 and tar[0][-3:] == ["-C", str(ROOT), "."]
        assert "--exclude=.git" in tar[0]
        scp = gcloud(cmds, "compute", "tpus", "tpu-vm", "scp")
        assert len(scp) == 1 and "--worker=all" in scp[0] and scp[0][5] == tar[0][2]
        assert scp[0][6].startswith("dg-test:")
        # every remote step runs on all workers, in the zone
        ssh = gcloud(cmds, "compute", "tpus", "tpu-vm", "ssh")
        assert len(ssh) == 3
        for c in ssh:
            assert c[5] == "dg-test" and "--worker=all" in c and flag(c, "--zone") == "us-east5-b"
        unpack, install, run = ssh_commands(cmds)
        assert "tar -xzf" in unpack
        assert ".[tpu]" in shlex.split(install) and "pip" in shlex.split(install)
        assert "--python 3.11" in install
        assert after_last_and(run) == ["dgemma", "generate", "--prompt", "hi"]
        # order: create, copy, install, run
        order = [cmds.index(c) for c in (create[0], tar[0], scp[0], *ssh)]
        assert order == sorted(order)

    def test_user_command_forwarded_verbatim(self):
        cmds = dry(TPU_VM, *BASE, "--", *TRICKY)
        assert after_last_and(ssh_commands(cmds)[-1]) == TRICKY

    def test_single_word_command_is_a_remote_shell_string(self):
        cmd = "dgemma generate --prompt hi | tee out.txt && echo \"$HOSTNAME\""
        cmds = dry(TPU_VM, *BASE, "--", cmd)
        assert ssh_commands(cmds)[-1].endswith(" && " + cmd)

    def test_env_exports_keep_quoting(self):
        cmds = dry(TPU_VM, *BASE, "--env", "HF_TOKEN=a b'c", "--env=XLA_FLAGS=--xla_dump_to=/tmp/x", "--", "true")
        words = shlex.split(ssh_commands(cmds)[-1])
        assert "HF_TOKEN=a b'c" in words and "XLA_FLAGS=--xla_dump_to=/tmp/x" in words

    @pytest.mark.parametrize("accel,normalized,runtime", [
        ("v5litepod-8", "v5litepod-8", "v2-alpha-tpuv5-lite"),
        ("v5e-8", "v5litepod-8", "v2-alpha-tpuv5-lite"),
        ("v6e-8", "v6e-8", "v2-alpha-tpuv6e"),
        ("v5p-8", "v5p-8", "v2-alpha-tpuv5"),
        ("v4-8", "v4-8", "tpu-ubuntu2204-base"),
        ("v5litepod-16", "v5litepod-16", "v2-alpha-tpuv5-lite"),
    ])
    def test_accelerators_and_default_runtimes(self, accel, normalized, runtime):
        cmds = dry(TPU_VM, *BASE, "--accelerator", accel, "--", "true")
        c = gcloud(cmds, "compute", "tpus", "tpu-vm", "create")[0]
        assert flag(c, "--accelerator-type") == normalized and flag(c, "--version") == runtime

    def test_version_project_spot(self):
        cmds = dry(TPU_VM, *BASE, "--version=v2-alpha-tpuv6e-custom", "--project", "my-proj", "--spot",
                   "--accelerator=v6e-8", "--", "true")
        c = gcloud(cmds, "compute", "tpus", "tpu-vm", "create")[0]
        assert flag(c, "--version") == "v2-alpha-tpuv6e-custom" and "--spot" in c
        for c in cmds:
            if c[0] == "gcloud":
                assert flag(c, "--project") == "my-proj", c

    def test_reuse_path(self):
        cmds = dry(TPU_VM, *BASE, "--reuse", "--", "dgemma", "--help")
        assert not gcloud(cmds, "compute", "tpus", "tpu-vm", "create")
        describe = gcloud(cmds, "compute", "tpus", "tpu-vm", "describe")
        assert len(describe) == 1 and describe[0][5] == "dg-test" and cmds[0] == describe[0]
        assert len(gcloud(cmds, "compute", "tpus", "tpu-vm", "ssh")) == 3

    def test_reuse_skip_copy_skip_install(self):
        cmds = dry(TPU_VM, *BASE, "--reuse", "--skip-copy", "--skip-install", "--", "dgemma", "--help")
        assert [c[:5] for c in cmds] == [["gcloud", "compute", "tpus", "tpu-vm", "describe"],
                                         ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]]
        assert after_last_and(ssh_commands(cmds)[0]) == ["dgemma", "--help"]

    def test_queued_resource_path(self):
        cmds = dry(TPU_VM, *BASE, "--queued", "--spot", "--accelerator", "v6e-8", "--delete-after", "--", "true")
        assert not gcloud(cmds, "compute", "tpus", "tpu-vm", "create")
        create = gcloud(cmds, "compute", "tpus", "queued-resources", "create")
        assert len(create) == 1
        c = create[0]
        assert c[5] == "dg-test" and flag(c, "--node-id") == "dg-test"
        assert flag(c, "--accelerator-type") == "v6e-8" and flag(c, "--runtime-version") == "v2-alpha-tpuv6e"
        assert "--spot" in c and flag(c, "--zone") == "us-east5-b"
        wait = gcloud(cmds, "compute", "tpus", "queued-resources", "describe")
        assert len(wait) == 1 and cmds.index(wait[0]) == cmds.index(c) + 1
        assert "state" in flag(wait[0], "--format")
        assert cmds[-1][:6] == ["gcloud", "compute", "tpus", "queued-resources", "delete", "dg-test"]
        assert "--force" in cmds[-1]

    def test_delete_after(self):
        cmds = dry(TPU_VM, *BASE, "--delete-after", "--", "true")
        assert cmds[-1][:6] == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "dg-test"]

    def test_git_clone_instead_of_copy(self):
        cmds = dry(TPU_VM, *BASE, "--git-url", "https://example.com/me/dgemma_jax.git", "--git-ref", "v0.1", "--",
                   "true")
        assert not [c for c in cmds if c[0] == "tar"] and not gcloud(cmds, "compute", "tpus", "tpu-vm", "scp")
        clone = shlex.split(ssh_commands(cmds)[0])
        assert clone[clone.index("clone") + 2] == "https://example.com/me/dgemma_jax.git"
        assert "checkout" in clone and "v0.1" in clone

    def test_setup_only(self):
        cmds = dry(TPU_VM, *BASE, "--setup-only")
        assert len(gcloud(cmds, "compute", "tpus", "tpu-vm", "ssh")) == 2  # unpack + install, no run

    def test_iap_and_pip_extra(self):
        cmds = dry(TPU_VM, *BASE, "--iap", "--pip", "gcsfs==2025.1.0", "--", "true")
        for c in gcloud(cmds, "compute", "tpus", "tpu-vm", "ssh") + gcloud(cmds, "compute", "tpus", "tpu-vm", "scp"):
            assert "--tunnel-through-iap" in c
        assert "gcsfs==2025.1.0" in shlex.split(ssh_commands(cmds)[1])

    @pytest.mark.parametrize("args,message", [
        (["--zone", "us-east5-b", "--", "x"], "--name is required"),
        (["--name", "dg", "--", "x"], "--zone is required"),
        ([*BASE], "no command given"),
        ([*BASE, "--", ], "no command given"),
        (["--name", "Bad_Name", "--zone", "us-east5-b", "--", "x"], "not a valid TPU name"),
        (["--name", "dg", "--zone", "useast", "--", "x"], "does not look like a zone"),
        ([*BASE, "--accelerator", "v9-8", "--", "x"], "unknown TPU type"),
        ([*BASE, "--accelerator", "h100-8", "--", "x"], "unknown TPU type"),
        ([*BASE, "--frobnicate", "--", "x"], "unknown option '--frobnicate'"),
        ([*BASE, "stray", "--", "x"], "unexpected argument 'stray'"),
        (["--name", "--zone", "us-east5-b", "--", "x"], "--name needs a value"),
        ([*BASE, "--accelerator"], "--accelerator needs a value"),
        ([*BASE, "--spot=yes", "--", "x"], "--spot takes no value"),
        ([*BASE, "--reuse", "--queued", "--", "x"], "do not go together"),
        ([*BASE, "--reuse", "--spot", "--", "x"], "do not go together"),
        ([*BASE, "--env", "NOEQUALS", "--", "x"], "KEY=VALUE"),
        ([*BASE, "--env", "1BAD=x", "--", "x"], "not a valid environment variable name"),
        ([*BASE, "--wait-timeout", "soon", "--", "x"], "--wait-timeout"),
        ([*BASE, "--python", "python3", "--", "x"], "--python"),
        ([*BASE, "--remote-dir", "my dir", "--", "x"], "remote path"),
        ([*BASE, "--setup-only", "--", "x"], "--setup-only runs no command"),
        ([*BASE, "--git-url", "u", "--skip-copy", "--", "x"], "contradict"),
        ([*BASE, "--source-dir", "/", "--", "x"], "not a dgemma_jax checkout"),
        ([*BASE, "--project", "Bad Project", "--", "x"], "not a valid project id"),
    ])
    def test_bad_arguments_exit_2(self, args, message):
        r = sh(TPU_VM, "--dry-run", *args)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert message in r.stderr
        assert r.stderr.startswith("tpu_vm.sh: error: ") and "--help" in r.stderr
        assert not commands(r.stdout)


# ------------------------------------------------------------------ real runs against stubs
def make_stubs(tmp_path: Path) -> tuple[dict, Path]:
    """Fake gcloud, tar and xpk that log their argv (JSON lines) and answer `describe`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.jsonl"
    stub = f"""#!{sys.executable}
import json, os, sys
argv = [os.path.basename(sys.argv[0])] + sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps(argv) + "\\n")
if "describe" in argv:
    if os.environ.get("FAKE_DESCRIBE_RC", "0") != "0":
        sys.exit(int(os.environ["FAKE_DESCRIBE_RC"]))
    states = os.environ.get("FAKE_STATES", "READY").split(",")
    counter = os.environ["FAKE_LOG"] + ".n"
    n = int(open(counter).read()) if os.path.exists(counter) else 0
    open(counter, "w").write(str(n + 1))
    print(states[min(n, len(states) - 1)])
fail_on = os.environ.get("FAKE_FAIL_ON")
if fail_on and any(fail_on in a for a in argv):
    sys.exit(3)
"""
    for name in ("gcloud", "tar", "xpk"):
        p = bin_dir / name
        p.write_text(stub)
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log), "DGEMMA_POLL_SECONDS": "0",
           "TMPDIR": str(tmp_path)}
    return env, log


def calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


class TestTpuVmAgainstStubs:
    def test_dry_run_runs_nothing(self, tmp_path):
        env, log = make_stubs(tmp_path)
        r = sh(TPU_VM, "--dry-run", *BASE, "--queued", "--delete-after", "--", "true", env=env)
        assert r.returncode == 0 and not log.exists()
        r = sh(GKE, "--dry-run", "--cluster", "c", "--wait", "--", "true", env=env)
        assert r.returncode == 0 and not log.exists()

    def test_real_run_executes_the_dry_run_commands(self, tmp_path):
        env, log = make_stubs(tmp_path)
        args = [*BASE, "--accelerator", "v6e-8", "--project", "my-proj", "--delete-after", "--", *TRICKY]
        planned = commands(sh(TPU_VM, "--dry-run", *args, env=env).stdout)
        r = sh(TPU_VM, *args, env=env)
        assert r.returncode == 0, r.stderr
        assert calls(log) == planned
        assert commands(r.stderr) == planned  # echoed like `set -x`

    def test_queued_resource_waits_until_active(self, tmp_path):
        env, log = make_stubs(tmp_path)
        env["FAKE_STATES"] = "WAITING_FOR_RESOURCES,PROVISIONING,ACTIVE"
        r = sh(TPU_VM, *BASE, "--queued", "--skip-copy", "--skip-install", "--", "true", env=env)
        assert r.returncode == 0, r.stderr
        subs = [c[3:5] for c in calls(log)]
        assert subs == [["queued-resources", "create"]] + [["queued-resources", "describe"]] * 3 + [["tpu-vm", "ssh"]]

    def test_queued_resource_failure(self, tmp_path):
        env, log = make_stubs(tmp_path)
        env["FAKE_STATES"] = "FAILED"
        r = sh(TPU_VM, *BASE, "--queued", "--", "true", env=env)
        assert r.returncode == 1 and "FAILED" in r.stderr
        assert not [c for c in calls(log) if "ssh" in c]

    def test_reuse_of_a_missing_vm_fails_clearly(self, tmp_path):
        env, log = make_stubs(tmp_path)
        env["FAKE_DESCRIBE_RC"] = "1"
        r = sh(TPU_VM, *BASE, "--reuse", "--", "true", env=env)
        assert r.returncode == 1 and "not found" in r.stderr and "drop --reuse" in r.stderr
        assert [c[4] for c in calls(log)] == ["describe"]

    def test_delete_after_also_when_the_command_fails(self, tmp_path):
        env, log = make_stubs(tmp_path)
        env["FAKE_FAIL_ON"] = "boom"
        r = sh(TPU_VM, *BASE, "--skip-copy", "--skip-install", "--delete-after", "--", "echo", "boom", env=env)
        assert r.returncode == 3
        assert [c[4] for c in calls(log)] == ["create", "ssh", "delete"]

    def test_failed_create_deletes_nothing(self, tmp_path):
        env, log = make_stubs(tmp_path)
        env["FAKE_FAIL_ON"] = "--accelerator-type=v5litepod-8"
        r = sh(TPU_VM, *BASE, "--delete-after", "--", "true", env=env)
        assert r.returncode == 3
        assert [c[4] for c in calls(log)] == ["create"]

    def test_gke_real_run_executes_the_dry_run_commands(self, tmp_path):
        env, log = make_stubs(tmp_path)
        args = ["--cluster", "c1", "--workload", "w1", "--wait", "--", *TRICKY]
        planned = commands(sh(GKE, "--dry-run", *args, env=env).stdout)
        r = sh(GKE, *args, env=env)
        assert r.returncode == 0, r.stderr
        assert calls(log) == planned and len(planned) == 2


# =============================================================================== gke_xpk.sh
def xpk_create(cmds) -> list[str]:
    found = [c for c in cmds if c[:3] == ["xpk", "workload", "create"]]
    assert len(found) == 1, cmds
    return found[0]


class TestGkeXpk:
    def test_help(self):
        r = sh(GKE, "-h")
        assert r.returncode == 0
        for word in ("Usage:", "--cluster", "--tpu-type", "--num-slices", "--emit-yaml", "--dry-run"):
            assert word in r.stdout

    def test_workload_create(self):
        cmds = dry(GKE, "--cluster", "my-cluster", "--workload", "dg-run", "--tpu-type", "v6e-8", "--num-slices", "2",
                   "--zone", "us-east5-b", "--project", "my-proj", "--", *TRICKY)
        assert len(cmds) == 1
        c = xpk_create(cmds)
        assert flag(c, "--cluster") == "my-cluster" and flag(c, "--workload") == "dg-run"
        assert flag(c, "--tpu-type") == "v6e-8" and flag(c, "--num-slices") == "2"
        assert flag(c, "--zone") == "us-east5-b" and flag(c, "--project") == "my-proj"
        assert flag(c, "--base-docker-image") == "python:3.11" and flag(c, "--script-dir") == str(ROOT)
        assert flag(c, "--docker-image") is None
        command = flag(c, "--command")
        assert shlex.split(command)[:5] == ["pip", "install", "--quiet", "-e", ".[tpu]"]
        assert after_last_and(command) == TRICKY

    def test_prebuilt_image_has_no_install_step(self):
        c = xpk_create(dry(GKE, "--cluster", "c", "--workload", "w", "--docker-image", "gcr.io/p/dgemma:1", "--",
                           "dgemma", "generate", "--prompt", "hi there"))
        assert flag(c, "--docker-image") == "gcr.io/p/dgemma:1"
        assert flag(c, "--base-docker-image") is None and flag(c, "--script-dir") is None
        assert shlex.split(flag(c, "--command")) == ["dgemma", "generate", "--prompt", "hi there"]

    def test_options_and_wait(self):
        cmds = dry(GKE, "--cluster", "c", "--workload", "w", "--tpu-type", "v5e-16", "--spot", "--priority", "high",
                   "--max-restarts", "2", "--env", "A=1 2", "--env", "B=x", "--wait", "--", "true")
        c = xpk_create(cmds)
        assert flag(c, "--tpu-type") == "v5litepod-16" and "--spot" in c
        assert flag(c, "--priority") == "high" and flag(c, "--max-restarts") == "2"
        envs = [c[i + 1] for i, w in enumerate(c) if w == "--env"]
        assert envs == ["A=1 2", "B=x"]
        assert cmds[1][:3] == ["xpk", "workload", "list"] and flag(cmds[1], "--wait-for-job-completion") == "w"

    def test_custom_xpk_program_and_single_string_command(self):
        cmds = dry(GKE, "--xpk", "python3 /opt/xpk/xpk.py", "--cluster", "c", "--workload", "w", "--skip-install",
                   "--", "dgemma bench | tee /tmp/out")
        assert cmds[0][:4] == ["python3", "/opt/xpk/xpk.py", "workload", "create"]
        assert flag(cmds[0], "--command") == "dgemma bench | tee /tmp/out"

    def test_default_workload_name(self):
        c = xpk_create(dry(GKE, "--cluster", "c", "--", "true"))
        assert flag(c, "--workload").startswith("dgemma-")

    @pytest.mark.parametrize("args,message", [
        (["--", "true"], "--cluster is required"),
        (["--cluster", "c"], "no command given"),
        (["--cluster", "c", "--workload", "Bad_Name", "--", "x"], "--workload 'Bad_Name'"),
        (["--cluster", "c", "--workload", "a" * 41, "--", "x"], "at most 40 characters"),
        (["--cluster", "c", "--num-slices", "0", "--", "x"], "--num-slices"),
        (["--cluster", "c", "--tpu-type", "a100-8", "--", "x"], "unknown TPU type"),
        (["--cluster", "c", "--priority", "urgent", "--", "x"], "--priority"),
        (["--cluster", "c", "--docker-image", "i", "--base-docker-image", "b", "--", "x"], "exclude each other"),
        (["--cluster", "c", "--git-url", "u", "--", "x"], "only apply with --emit-yaml"),
        (["--cluster", "c", "--bogus", "--", "x"], "unknown option '--bogus'"),
        (["--emit-yaml", "-", "--", "x"], "--emit-yaml needs --docker-image"),
        (["--emit-yaml", "-", "--docker-image", "i", "--tpu-type", "v5litepod-12", "--", "x"], "--topology"),
        (["--emit-yaml", "-", "--docker-image", "i", "--tpu-type", "v6e-8", "--topology", "4x4", "--", "x"],
         "has 16 chips but v6e-8 has 8"),
        (["--emit-yaml", "-", "--docker-image", "i", "--wait", "--", "x"], "--wait needs xpk"),
    ])
    def test_bad_arguments_exit_2(self, args, message):
        r = sh(GKE, "--dry-run", *args)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert message in r.stderr and r.stderr.startswith("gke_xpk.sh: error: ")
        assert not commands(r.stdout)


class TestJobSetYaml:
    yaml = pytest.importorskip("yaml")

    def emit(self, *args: str) -> dict:
        r = sh(GKE, "--emit-yaml", "-", "--workload", "dg-job", *args)
        assert r.returncode == 0, r.stderr
        return self.yaml.safe_load(r.stdout)

    @pytest.mark.parametrize("tpu,label,topology,hosts,chips", [
        ("v5litepod-8", "tpu-v5-lite-podslice", "2x4", 1, 8),   # one ct5lp-hightpu-8t host
        ("v5e-16", "tpu-v5-lite-podslice", "4x4", 4, 4),
        ("v6e-8", "tpu-v6e-slice", "2x4", 1, 8),           # one ct6e-standard-8t host
        ("v6e-1", "tpu-v6e-slice", "1x1", 1, 1),
        ("v5p-8", "tpu-v5p-slice", "2x2x1", 1, 4),
        ("v5p-32", "tpu-v5p-slice", "2x2x4", 4, 4),
        ("v4-8", "tpu-v4-podslice", "2x2x1", 1, 4),
    ])
    def test_topologies(self, tpu, label, topology, hosts, chips):
        doc = self.emit("--docker-image", "gcr.io/p/dgemma:1", "--tpu-type", tpu, "--", "dgemma", "--help")
        assert doc["apiVersion"].startswith("jobset.x-k8s.io/") and doc["kind"] == "JobSet"
        assert doc["metadata"]["name"] == "dg-job"
        (rj,) = doc["spec"]["replicatedJobs"]
        assert rj["replicas"] == 1
        job = rj["template"]["spec"]
        assert job["parallelism"] == job["completions"] == hosts
        pod = job["template"]["spec"]
        assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": label,
                                       "cloud.google.com/gke-tpu-topology": topology}
        (container,) = pod["containers"]
        assert container["image"] == "gcr.io/p/dgemma:1"
        assert container["resources"]["limits"]["google.com/tpu"] == chips
        assert "env" not in container

    def test_git_install_multislice_spot_env(self):
        doc = self.emit("--git-url", "https://example.com/dg.git", "--git-ref", "main", "--tpu-type", "v6e-16",
                        "--num-slices", "2", "--spot", "--env", 'HF_TOKEN=a"b\\c', "--", *TRICKY)
        (rj,) = doc["spec"]["replicatedJobs"]
        assert rj["replicas"] == 2
        pod = rj["template"]["spec"]["template"]["spec"]
        assert pod["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
        assert pod["tolerations"][0]["key"] == "cloud.google.com/gke-spot"
        (container,) = pod["containers"]
        assert container["image"] == "python:3.11" and container["command"] == ["bash", "-c"]
        lines = container["args"][0].strip().splitlines()
        assert lines[0] == "set -euo pipefail"
        assert shlex.split(lines[1]) == ["git", "clone", "--quiet", "https://example.com/dg.git", "/app"]
        assert "checkout" in lines[2] and "main" in lines[2]
        assert shlex.split(lines[4]) == ["pip", "install", "--quiet", "-e", ".[tpu]"]
        assert shlex.split(lines[-1]) == TRICKY
        env = {e["name"]: e for e in container["env"]}
        assert env["HF_TOKEN"]["value"] == 'a"b\\c'
        assert env["MEGASCALE_NUM_SLICES"]["value"] == "2"
        assert "MEGASCALE_COORDINATOR_ADDRESS" in env and "MEGASCALE_SLICE_ID" in env

    def test_emit_to_file(self, tmp_path):
        out = tmp_path / "job.yaml"
        args = ["--emit-yaml", str(out), "--workload", "w", "--docker-image", "i", "--", "true"]
        r = sh(GKE, "--dry-run", *args)
        assert r.returncode == 0 and not out.exists() and not commands(r.stdout)
        r = sh(GKE, *args)
        assert r.returncode == 0 and self.yaml.safe_load(out.read_text())["kind"] == "JobSet"
        assert "kubectl apply -f" in r.stderr


# =============================================================================== Colab notebook
def strip_magics(src: str) -> str:
    out = []
    for line in src.splitlines():
        body = line.lstrip()
        out.append(line[: len(line) - len(body)] + "pass" if body.startswith(("!", "%")) else line)
    return "\n".join(out) + "\n"


def code_sources(nb: dict) -> list[str]:
    return ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in nb["cells"] if c["cell_type"] == "code"]


class TestColabNotebook:
    @pytest.fixture(scope="class")
    def nb(self):
        return json.loads(NOTEBOOK.read_text())

    def test_nbformat_structure(self, nb):
        assert nb["nbformat"] == 4 and nb["nbformat_minor"] >= 4
        assert nb["metadata"]["kernelspec"]["name"] == "python3"
        assert nb["metadata"].get("accelerator") == "TPU"
        ids = [c.get("id") for c in nb["cells"]]
        assert len(set(ids)) == len(ids)
        for cell in nb["cells"]:
            assert cell["cell_type"] in ("code", "markdown")
            assert isinstance(cell["metadata"], dict)
            assert isinstance(cell["source"], (str, list))
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None

    def test_code_cells_compile(self, nb):
        for i, src in enumerate(code_sources(nb)):
            compile(strip_magics(src), f"<code cell {i}>", "exec")

    def test_has_the_required_steps(self, nb):
        code = code_sources(nb)

        def cell_with(*needles):
            found = [src for src in code if all(n in src for n in needles)]
            assert found, f"no code cell contains {needles}"
            return found[0]

        cell_with("pip", "install", "install_source(UPLOAD_DIR, PACKAGE_URL)")
        cell_with("jax.devices()")
        cell_with("DiffusionGemma.from_pretrained(", "resolve_quantize(")
        cell_with("model.generate(", "model.chat(")
        cell_with("model.engine.steps(", "argmax", "canvas_index")

    def test_runs_all_with_no_placeholder_to_edit(self, nb):
        text = json.dumps(nb)
        assert "YOUR_ORG" not in text and "REPO_URL" not in text
        settings = code_sources(nb)[0]
        for name in ("CHECKPOINT", "PROMPT", "QUANTIZE", "MAX_NEW_TOKENS", "SEED", "PACKAGE_URL"):
            assert f"{name} = " in settings and "# @param" in settings
        ns = {}
        exec(settings, ns)
        assert ns["CHECKPOINT"] == "" and ns["QUANTIZE"] == "auto"  # Run all: the bundled model

    @staticmethod
    def _install_cell(nb):
        return next(src for src in code_sources(nb) if "def install_source" in src)

    def test_install_cell_installs_an_uploaded_wheel_and_says_so(self, nb, tmp_path, capsys):
        """The install cell, run where dgemma_jax is not importable, pip-installs the wheel that
        `pip wheel --no-deps -w dist .` (launch/README.md) builds, found in the upload folder."""
        built = tmp_path / "dist"
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(built), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        wheel, = built.glob("dgemma_jax-*.whl")
        import zipfile
        names = zipfile.ZipFile(wheel).namelist()
        assert "dgemma_jax/pipeline.py" in names
        assert any(n.startswith("dgemma_jax/assets/dgemma-tiny-digits/params/") for n in names), \
            "the wheel lacks the bundled model the notebook runs by default"
        upload = tmp_path / "content"
        upload.mkdir()
        (upload / wheel.name).write_bytes(wheel.read_bytes())
        calls = []

        class Result:
            returncode = 0

        def fake_run(cmd, check=False):
            calls.append(cmd)
            return Result()

        src = self._install_cell(nb).replace('UPLOAD_DIR = "/content"', f"UPLOAD_DIR = {str(upload)!r}")
        import importlib.util
        real_find_spec = importlib.util.find_spec
        ns = {"PACKAGE_URL": ""}
        try:
            importlib.util.find_spec = lambda name, *a: None if name == "dgemma_jax" else real_find_spec(name, *a)
            subprocess_run, subprocess.run = subprocess.run, fake_run
            exec(src, ns)
        finally:
            importlib.util.find_spec = real_find_spec
            subprocess.run = subprocess_run
        assert calls == [[sys.executable, "-m", "pip", "install", "--quiet", f"{upload / wheel.name}[tpu]"]]
        assert f"installing dgemma_jax from the uploaded file {wheel.name}" in capsys.readouterr().out
        # nothing uploaded: the URL set, checked (issue 46: the default was `dgemma_jax[tpu]`, on no index)
        empty = str(tmp_path / "empty")
        repo = "git+https://github.com/example/dgemma_jax"
        assert ns["install_source"](empty, repo) == (f"dgemma_jax[tpu] @ {repo}", f"the repository {repo}")
        url = "https://example.org/dist/dgemma_jax-0.1.0-py3-none-any.whl"
        assert ns["install_source"](empty, url) == (f"dgemma_jax[tpu] @ {url}", f"the archive {url}")
        with pytest.raises(SystemExit, match="set PACKAGE_URL"):
            ns["install_source"](empty, "")
        with pytest.raises(SystemExit, match="on no package index"):
            ns["install_source"](empty, "dgemma_jax[tpu]")

    def test_install_cell_failure_says_how_to_upload_a_wheel(self, nb, tmp_path):
        src = self._install_cell(nb).replace('UPLOAD_DIR = "/content"', f"UPLOAD_DIR = {str(tmp_path)!r}")

        def failing_run(cmd, check=False):
            raise subprocess.CalledProcessError(1, cmd)

        import importlib.util
        real_find_spec = importlib.util.find_spec
        try:
            importlib.util.find_spec = lambda name, *a: None if name == "dgemma_jax" else real_find_spec(name, *a)
            subprocess_run, subprocess.run = subprocess.run, failing_run
            with pytest.raises(SystemExit, match="pip wheel --no-deps -w dist"):
                exec(src, {"PACKAGE_URL": "git+https://github.com/example/dgemma_jax"})
        finally:
            importlib.util.find_spec = real_find_spec
            subprocess.run = subprocess_run

    def test_quantize_setting_is_the_librarys_choice(self, nb):
        """QUANTIZE offers exactly the library's choices, and the load cell decides with the library's
        `resolve_quantize` over the devices the weights go to (one chip, or the mesh's): what "auto"
        picks for each chip is tested on the function (tests/test_quant_int4.py)."""
        from dgemma_jax.model.quant import QUANTIZE_CHOICES

        settings = code_sources(nb)[0]
        line = next(x for x in settings.splitlines() if x.startswith("QUANTIZE = "))
        assert ast.literal_eval(line.split("# @param", 1)[1].strip()) == list(QUANTIZE_CHOICES)
        load = next(src for src in code_sources(nb) if "DiffusionGemma.from_pretrained(" in src)
        assert "resolve_quantize(config, QUANTIZE, devices)" in load
        assert "jax.devices()[:1]" in load and "shardings.mesh.devices" in load
        assert "def choose_quantize" not in json.dumps(nb)  # the notebook keeps no rule of its own

    def test_make_colab_check(self):
        r = subprocess.run([sys.executable, str(MAKE_COLAB), "--check"], capture_output=True, text=True,
                           timeout=30, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        assert "ok (nbformat 4" in r.stdout and "# ---- code cell 1/" in r.stdout
        assert "engine.steps(" in r.stdout  # the code cells are printed

    def test_make_colab_check_reports_problems(self, tmp_path, nb):
        bad = json.loads(json.dumps(nb))
        code = [c for c in bad["cells"] if c["cell_type"] == "code"]
        code[1]["source"] = ["def broken(:\n"]
        del code[2]["outputs"]
        bad["nbformat"] = 3
        path = tmp_path / "bad.ipynb"
        path.write_text(json.dumps(bad))
        r = subprocess.run([sys.executable, str(MAKE_COLAB), "--check", "--quiet", "--notebook", str(path)],
                           capture_output=True, text=True, timeout=30, cwd=ROOT)
        assert r.returncode == 1
        assert "does not compile" in r.stderr and "outputs" in r.stderr and "nbformat is 3" in r.stderr

    def test_notebook_is_generated_by_make_colab(self):
        sys.path.insert(0, str(LAUNCH))
        try:
            import make_colab
        finally:
            sys.path.remove(str(LAUNCH))
        assert NOTEBOOK.read_text() == make_colab.dumps(make_colab.build()), \
            "run `python launch/make_colab.py` to regenerate launch/colab_tpu.ipynb"
        # magics are neutralised without breaking an indented block
        compile(make_colab.strip_magics("if True:\n    !pip install x\n%time y = 1\n"), "<t>", "exec")

    @pytest.mark.slow
    @pytest.mark.parametrize("prompt,seed,layers", [(None, 0, None), ("s31415926535=", 3, "scan")])
    def test_notebook_answers_as_the_library_does(self, tmp_path, prompt, seed, layers):
        """Execute every code cell (bundled model, CPU) the way a kernel would; its answer is the
        library's for the same prompt and seed, and the step-by-step cell agrees with it. LAYERS: auto
        (unrolled off TPU) and scan (the TPU's default) give the library's (unrolled) answer."""
        import dgemma_jax
        env = dict(os.environ, JAX_PLATFORMS="cpu", MPLBACKEND="Agg", PYTHONPATH=str(ROOT))
        env.pop("XLA_FLAGS", None)
        sets = ["--set", f"SEED={seed}"] + (["--set", f"PROMPT={prompt!r}"] if prompt else [])
        sets += ["--set", f"LAYERS={layers!r}"] if layers else []
        r = subprocess.run([sys.executable, str(MAKE_COLAB), "--run", *sets],
                           capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "dgemma_jax is already installed" in r.stdout
        answers = [line[len("answer: "):] for line in r.stdout.splitlines() if line.startswith("answer: ")]
        assert len(answers) == 1, r.stdout[-3000:]
        expected = dgemma_jax.DiffusionGemma.from_pretrained(None).generate(prompt or "s9350814272=", seed=seed)
        assert ast.literal_eval(answers[0]) == expected
        if prompt is None:
            assert expected == "0122345789"  # the README's example
        else:
            assert expected == "".join(sorted(prompt[1:-1]))  # the bundled model sorts these digits
        assert "the step-by-step driver gives the same answer as model.generate: True" in r.stdout
        assert "canvas 0:" in r.stdout
        assert f"layers ({layers or 'unrolled'})" in r.stdout
        # the first call's compile bar counted the programs it compiled (this run's cache is cold for them)
        counts = [int(n) for n in re.findall(r"compiling: (\d+) programs", r.stderr)]
        assert counts and max(counts) >= 1, r.stderr[-2000:]


# =============================================================================== serve mode
class TestServeMode:
    def test_tpu_vm_serves_on_worker_0_with_the_port_forwarded(self):
        cmds = dry(TPU_VM, *BASE, "--accelerator", "v6e-8", "--serve", "--port", "8123", "--",
                   "--checkpoint", "gs://b/ckpt", "--mesh", "expert=8", "--slots", "8")
        ssh = gcloud(cmds, "compute", "tpus", "tpu-vm", "ssh")[-1]
        assert "--worker=0" in ssh and ssh[-3:] == ["--", "-L", "8123:localhost:8123"]
        assert after_last_and(flag(ssh, "--command")) == [
            "dgemma", "serve", "--host", "0.0.0.0", "--port", "8123", "--checkpoint", "gs://b/ckpt", "--mesh",
            "expert=8", "--slots", "8"]

    def test_serve_sets_an_api_key_since_it_listens_beyond_loopback(self, monkeypatch):
        def run(*extra):
            r = sh(TPU_VM, "--dry-run", *BASE, "--serve", *extra)
            assert r.returncode == 0 and r.stderr == "", r.stderr
            return r.stdout, flag(gcloud(commands(r.stdout), "compute", "tpus", "tpu-vm", "ssh")[-1], "--command")

        monkeypatch.delenv("DGEMMA_API_KEY", raising=False)
        out, command = run()
        keys = re.findall(r"requires an API key: (dg-[0-9a-f]{32})", out)
        assert len(keys) == 1, out
        assert f"export DGEMMA_API_KEY={keys[0]}" in command
        assert run()[1] != command                        # a new random key each launch
        monkeypatch.setenv("DGEMMA_API_KEY", "chosen")    # the operator's own key: passed on, not printed
        out, command = run()
        assert "export DGEMMA_API_KEY=chosen" in command and "chosen" not in out.replace(command, "")
        out, command = run("--", "--api-key", "k")       # a key among the server's options: nothing added
        assert "DGEMMA_API_KEY" not in command and "--api-key k" in command

    def test_tpu_vm_serve_without_options_serves_the_bundled_model(self):
        ssh = gcloud(dry(TPU_VM, *BASE, "--serve"), "compute", "tpus", "tpu-vm", "ssh")[-1]
        assert after_last_and(flag(ssh, "--command")) == ["dgemma", "serve", "--host", "0.0.0.0", "--port", "8000"]

    @pytest.mark.parametrize("script,args", [
        ("tpu", ["--accelerator", "v5litepod-16", "--serve"]),
        ("tpu", ["--serve", "--port", "99999"]),
        ("gke", ["--cluster", "c", "--tpu-type", "v6e-32", "--serve"]),
        ("gke", ["--cluster", "c", "--tpu-type", "v6e-8", "--num-slices", "2", "--serve"]),
    ])
    def test_serve_refuses_multi_host_slices_and_bad_ports(self, script, args):
        r = sh(TPU_VM, *BASE, *args) if script == "tpu" else sh(GKE, *args)
        first = r.stderr.splitlines()[0]
        assert r.returncode == 2 and "error:" in first
        assert "one host" in first or "--port" in first or "one slice" in first

    def test_gke_yaml_exposes_the_server(self):
        yaml = pytest.importorskip("yaml")
        r = sh(GKE, "--emit-yaml", "-", "--workload", "dg-serve", "--tpu-type", "v6e-8", "--docker-image", "img",
               "--serve", "--", "--slots", "8")
        assert r.returncode == 0, r.stderr
        job, svc = list(yaml.safe_load_all(r.stdout))
        pod = job["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert {"containerPort": 8000} in container["ports"]
        assert "dgemma serve --host 0.0.0.0 --port 8000 --slots 8" in container["args"][0]
        assert svc["kind"] == "Service" and svc["spec"]["ports"][0]["port"] == 8000
        assert svc["spec"]["selector"] == {"jobset.sigs.k8s.io/jobset-name": "dg-serve"}

    def test_gke_xpk_submit_prints_how_to_reach_it(self):
        r = sh(GKE, "--dry-run", "--cluster", "c", "--workload", "dg-serve", "--tpu-type", "v6e-8", "--serve")
        assert r.returncode == 0
        c = xpk_create(commands(r.stdout))
        assert flag(c, "--command").endswith("dgemma serve --host 0.0.0.0 --port 8000")
        assert "kubectl port-forward" in r.stdout + r.stderr


def test_launch_readme_agrees_with_the_notebook_and_the_code_on_quantize_auto():
    """issue 46: launch/README.md said 85% (the code and the notebook: 90%), "no int4 path" and that a
    v5e-1 / v6e-1 holds neither size, which the notebook contradicts (int8 on a v6e-1, int4 on a v5e-1)."""
    from dgemma_jax.model.quant import WEIGHT_SHARE

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "launch", "README.md")) as f:
        readme = f.read()
    with open(os.path.join(root, "launch", "make_colab.py")) as f:
        notebook = f.read()
    share = f"{round(WEIGHT_SHARE * 100)}%"
    assert f"fit {share} of the chip" in notebook and f"fit {share} of the chips'" in readme
    for stale in ("85%", "no int4 path", "holds neither"):
        assert stale not in readme, stale
    for claim in ("v6e-1 (32 GB) chip holds it in int8", "v5e-1 (16 GB) in int4"):
        assert claim in readme, claim


def test_the_heatmap_draws_a_fully_settled_canvas_dark(monkeypatch):
    """issue 46: the settled-positions heatmap scaled its colours to the data, so a canvas settled from its
    first step (all True) was drawn in the palest colour, as if nothing had settled."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(LAUNCH))
    try:
        import make_colab
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(plt, "show", lambda: None)
    settled = np.arange(8)
    history = {0: [settled.copy() for _ in range(3)]}
    exec(make_colab.PLOT, {"np": np, "history": history})
    image = plt.gcf().axes[1].images[0]
    rgba = image.to_rgba(image.get_array())
    top = plt.get_cmap("Greens")(1.0)
    assert np.allclose(rgba[..., :3], top[:3]), "a fully settled canvas must take the colour of 'settled'"
    plt.close("all")


def test_the_notebook_asks_for_a_hub_token_for_a_hub_checkpoint(tmp_path, monkeypatch, capsys):
    """issue 46: the gated Hub repo needs a login the notebook never mentioned. The login cell does nothing
    for the bundled model or a path, stops with how to log in for a Hub id without a token, and passes a
    token it finds on."""
    sys.path.insert(0, str(LAUNCH))
    try:
        import make_colab
    finally:
        sys.path.pop(0)
    names = [src for kind, src in make_colab.CELLS]
    cell = make_colab.HUB_LOGIN
    assert names.index(cell) < names.index(make_colab.LOAD)  # before the model is loaded
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no token file either
    for checkpoint in ("", str(tmp_path), "gs://bucket/dg"):
        exec(cell, {"CHECKPOINT": checkpoint})
        assert "no Hub login needed" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="HF_TOKEN"):
        exec(cell, {"CHECKPOINT": "google/diffusiongemma-26B-A4B-it"})
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    exec(cell, {"CHECKPOINT": "google/diffusiongemma-26B-A4B-it@main"})
    assert "token is set" in capsys.readouterr().out
