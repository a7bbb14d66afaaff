"""launch/ --simulate: the per-host command of a pod launch run as local processes joined by jax.distributed
(gloo on CPU, fake CPU devices per process), and the launch README's examples checked against it.

The simulated hosts run `dgemma` from PATH (this interpreter's bin directory goes first) with this checkout
on PYTHONPATH; the answers are compared with the same command in one process (this one)."""

from __future__ import annotations

import io
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.serve import free_port

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
TPU_VM = LAUNCH / "tpu_vm.sh"
GKE = LAUNCH / "gke_xpk.sh"
README = LAUNCH / "README.md"
PROMPT = "s9350814272="
CHAT_INPUT = "s31415926535=\ns705182936=\n"


def _env(logs: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), DGEMMA_SIM_LOGS=str(logs),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.pop("VIRTUAL_ENV", None)  # no venv to activate: `dgemma` is this interpreter's, first on PATH
    return env


def launch(script: Path, *args: str, logs: Path, stdin: str = "", timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=_env(logs), cwd=ROOT)


@dataclass
class Host:
    env: dict
    command: str      # the per-host shell string (`bash -c` of the simulation, `--command` of the real launch)


def simulated_hosts(text: str) -> list[Host]:
    """The hosts of the '+ env K=V... bash -c STRING' lines of a simulation (its stderr, or a dry run's stdout)."""
    hosts = []
    for line in text.splitlines():
        if not line.startswith("+ env "):
            continue
        argv = shlex.split(line[2:])
        i = argv.index("bash")
        assert argv[i + 1] == "-c" and len(argv) == i + 3, line
        hosts.append(Host(dict(a.split("=", 1) for a in argv[1:i]), argv[i + 2]))
    return hosts


def command_part(host_command: str) -> tuple[list[str], list[str]]:
    """(exports, command words) of `cd DIR && [. VENV/bin/activate && ][export K=V && ...]COMMAND`: what the real
    launch and the simulation have in common (the directory and the venv are the only differences)."""
    words = shlex.split(host_command)
    assert words[0] == "cd" and words[2] == "&&", host_command
    words = words[3:]
    if words[0] == "." and words[1].endswith("/bin/activate"):
        assert words[2] == "&&"
        words = words[3:]
    exports = []
    while words and words[0] == "export":
        exports.append(words[1])
        assert words[2] == "&&"
        words = words[3:]
    return exports, words


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def check_pod(stderr: str, logs: Path, hosts: int, devices: int, command: list[str]) -> None:
    """The simulation ran `command` on `hosts` hosts with the documented variables, and left no process."""
    ran = simulated_hosts(stderr)
    assert [h.env["DGEMMA_PROCESS_ID"] for h in ran] == [str(i) for i in range(hosts)]
    assert len({h.env["DGEMMA_COORDINATOR"] for h in ran}) == 1
    assert re.fullmatch(r"127\.0\.0\.1:\d+", ran[0].env["DGEMMA_COORDINATOR"])
    for h in ran:
        assert h.env["DGEMMA_NUM_PROCESSES"] == str(hosts) and h.env["JAX_PLATFORMS"] == "cpu"
        assert h.env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count={devices}"
        assert command_part(h.command) == ([], command)
    for i in range(hosts):
        assert not alive(int((logs / f"host-{i}.pid").read_text()))


# ============================================================================== runs on a simulated pod
@pytest.mark.slow
def test_generate_on_a_simulated_pod_gives_the_one_process_tokens(tmp_path):
    """2 hosts x 4 CPU devices, a data=2,expert=4 mesh over both, the prompt piped to the script (host 0's
    stdin, handed to host 1 through jax.distributed): host 0 prints the one-process answer, host 1 nothing."""
    import dgemma_jax as dg

    cmd = ["dgemma", "generate", "--mesh", "data=2,expert=4"]
    r = launch(TPU_VM, "--simulate", "2", "--simulate-devices", "4", "--", *cmd, logs=tmp_path, stdin=PROMPT)
    assert r.returncode == 0, r.stderr[-4000:]
    one = dg.DiffusionGemma.from_pretrained(None).generate(PROMPT)  # seed 0, the CLI's default
    assert one == "0122345789"
    assert r.stdout == one + "\n"
    assert (tmp_path / "host-1.out").read_text() == ""
    check_pod(r.stderr, tmp_path, 2, 4, cmd)


@pytest.mark.slow
def test_chat_with_piped_input_on_a_simulated_pod_answers_as_one_process(tmp_path, monkeypatch, capsys):
    """The script's stdin reaches host 0 (host 1 reads nothing and follows host 0's collectives); the answers
    equal `dgemma chat` in this one process."""
    from dgemma_jax import cli

    cmd = ["dgemma", "chat", "--quiet", "--mesh", "expert=8"]
    r = launch(TPU_VM, "--simulate", "2", "--", *cmd, logs=tmp_path, stdin=CHAT_INPUT)
    assert r.returncode == 0, r.stderr[-4000:]
    monkeypatch.setattr(sys, "stdin", io.StringIO(CHAT_INPUT))
    assert cli.main(cmd[1:3]) == 0  # one process, no mesh
    one = capsys.readouterr().out
    assert len(one.splitlines()) == 2
    assert r.stdout == one
    assert (tmp_path / "host-1.out").read_text() == ""
    check_pod(r.stderr, tmp_path, 2, 4, cmd)


@pytest.mark.slow
def test_serve_on_one_simulated_host_answers_the_openai_client(tmp_path):
    """`--serve` runs one host per replica (the scheduler takes requests on one process, and a mesh over
    several hosts would need every process to run each program): `--simulate 1` runs that host under
    jax.distributed, as on a pod; SIGTERM to the script stops the server. It listens on every interface,
    so it takes the API key of $DGEMMA_API_KEY: a client without it gets 401."""
    import httpx
    import openai

    port = free_port()
    proc = subprocess.Popen(["bash", str(TPU_VM), "--simulate", "1", "--simulate-devices", "2", "--serve",
                             "--port", str(port), "--", "--mesh", "expert=2", "--slots", "2"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**_env(tmp_path), "DGEMMA_API_KEY": "sim-key"}, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "the server did not become ready in 300 s"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 401
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sim-key", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["dgemma-tiny-digits"]
        r = client.completions.create(model="dgemma-tiny-digits", prompt=PROMPT, seed=0, max_tokens=32)
        assert r.choices[0].text == "0122345789" and r.choices[0].finish_reason == "stop"
        chat = client.chat.completions.create(model="dgemma-tiny-digits", seed=1,
                                              messages=[{"role": "user", "content": "s31415926535="}])
        assert chat.choices[0].message.content == "11233455569"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-4000:]   # stopped by SIGTERM, as Ctrl-C ends a real `--serve`
    host = simulated_hosts(err)
    assert len(host) == 1 and host[0].env["DGEMMA_NUM_PROCESSES"] == "1"
    assert command_part(host[0].command)[1] == ["dgemma", "serve", "--host", "0.0.0.0", "--port", str(port),
                                                "--mesh", "expert=2", "--slots", "2"]
    assert not alive(int((tmp_path / "host-0.pid").read_text()))


# ============================================================================== the script's own behaviour
def test_a_failing_host_stops_the_pod_with_its_status(tmp_path):
    """Host 1 fails at once while host 0 would run for a minute: the script stops host 0 and exits with host 1's
    status; host 1's output is in its log files, host 0's on the script's own stdout."""
    t0 = time.monotonic()
    r = launch(TPU_VM, "--simulate", "2", "--",
               'echo "out $DGEMMA_PROCESS_ID"; echo "err $DGEMMA_PROCESS_ID" >&2; '
               'if [ "$DGEMMA_PROCESS_ID" = 1 ]; then exit 7; fi; sleep 60', logs=tmp_path, timeout=60)
    assert r.returncode == 7, r.stderr
    assert time.monotonic() - t0 < 30
    assert r.stdout == "out 0\n" and "err 0" in r.stderr
    assert (tmp_path / "host-1.out").read_text() == "out 1\n"
    assert (tmp_path / "host-1.err").read_text() == "err 1\n"
    assert "host 1 exited with status 7" in r.stderr
    assert not alive(int((tmp_path / "host-0.pid").read_text()))


def test_a_killed_host_stops_the_pod_and_stdin_goes_to_host_0_only(tmp_path):
    """Killing one host's process (its pid from host-<i>.pid) ends the run non-zero, the others stopped too."""
    proc = subprocess.Popen(["bash", str(TPU_VM), "--simulate", "3", "--",
                             'read line; echo "$DGEMMA_PROCESS_ID read [$line]"; sleep 60'],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(tmp_path), cwd=ROOT)
    proc.stdin.write("hello\n")
    proc.stdin.flush()
    first = proc.stdout.readline()  # host 0 has read its line
    deadline = time.monotonic() + 20
    while not all((tmp_path / f"host-{i}.out").exists() and (tmp_path / f"host-{i}.out").read_text()
                  for i in (1, 2)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    pids = [int((tmp_path / f"host-{i}.pid").read_text()) for i in range(3)]
    os.kill(pids[2], signal.SIGKILL)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGKILL, err
    assert first + out == "0 read [hello]\n"
    assert [(tmp_path / f"host-{i}.out").read_text() for i in (1, 2)] == ["1 read []\n", "2 read []\n"]
    assert not any(alive(p) for p in pids)


def test_all_hosts_must_succeed_and_a_default_log_directory_is_made(tmp_path):
    env = _env(tmp_path)
    env.pop("DGEMMA_SIM_LOGS")
    env["TMPDIR"] = str(tmp_path)
    r = subprocess.run(["bash", str(TPU_VM), "--simulate", "2", "--", "true"], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    logs = Path(re.search(r"^# host 0 .* writes (\S+)/host-<i>\.out", r.stderr, re.M).group(1))
    assert logs.parent == tmp_path
    assert sorted(p.name for p in logs.iterdir()) == ["host-0.pid", "host-1.err", "host-1.out", "host-1.pid"]


@pytest.mark.parametrize("args,message", [
    (["--simulate", "0"], "--simulate takes a number of hosts"),
    (["--simulate", "two"], "--simulate takes a number of hosts"),
    (["--simulate", "2", "--simulate-devices", "-1"], "--simulate-devices takes a number"),
    (["--simulate", "2", "--serve"], "--serve runs the server on one host"),
    (["--simulate", "1", "--setup-only"], "--setup-only has nothing to do"),
])
def test_bad_simulate_arguments_exit_2(tmp_path, args, message):
    r = launch(TPU_VM, *args, "--", "dgemma", "--help", logs=tmp_path, timeout=30)
    assert r.returncode == 2 and r.stderr.startswith("tpu_vm.sh: error:") and message in r.stderr, r.stderr


def test_gke_serve_replicas_sit_behind_one_service():
    """Scaling a server out on GKE: --replicas N independent single-host slices (no MEGASCALE variables that
    would join them into one program), a readiness probe on /health, one Service selecting them all."""
    yaml = pytest.importorskip("yaml")
    r = subprocess.run(["bash", str(GKE), "--emit-yaml", "-", "--workload", "dg-serve", "--tpu-type", "v6e-8",
                        "--docker-image", "img", "--serve", "--replicas", "3", "--", "--mesh", "expert=8"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    jobset, service = yaml.safe_load_all(r.stdout)
    job = jobset["spec"]["replicatedJobs"][0]
    assert job["replicas"] == 3
    assert job["template"]["spec"]["parallelism"] == 1          # one host per replica, all 8 chips
    container = job["template"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["google.com/tpu"] == 8
    assert container["args"][0].strip().splitlines()[-1] == "dgemma serve --host 0.0.0.0 --port 8000 --mesh expert=8"
    assert "MEGASCALE" not in r.stdout
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert service["kind"] == "Service"
    assert service["spec"]["selector"] == {"jobset.sigs.k8s.io/jobset-name": "dg-serve"}
    for bad in (["--cluster", "c", "--serve", "--replicas", "2"],
                ["--emit-yaml", "-", "--docker-image", "i", "--replicas", "2"]):
        e = subprocess.run(["bash", str(GKE), *bad, "--", "dgemma", "--help"], capture_output=True, text=True, timeout=30)
        assert e.returncode == 2 and "--replicas" in e.stderr.splitlines()[0], e.stderr


# ============================================================================== the README's examples
def readme_examples() -> list[list[str]]:
    """Every launch/tpu_vm.sh and launch/gke_xpk.sh command in launch/README.md's bash blocks, as argv."""
    text = README.read_text()
    examples = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0] in ("launch/tpu_vm.sh", "launch/gke_xpk.sh"):
                examples.append(words)
    return examples


def real_host_command(example: list[str]) -> tuple[list[str], list[str]]:
    """(exports, command words) of what the real launch runs on each host, from the example's dry run (a JobSet
    example writes its manifest to stdout instead of a file)."""
    script, args = ROOT / example[0], list(example[1:])
    if "--simulate" in args:  # the README's simulation example: its dry run prints the per-host commands
        r = subprocess.run(["bash", str(script), "--dry-run", *args], capture_output=True, text=True, timeout=30,
                           cwd=ROOT)
        assert r.returncode == 0, (example, r.stderr)
        return command_part(simulated_hosts(r.stdout)[0].command)
    if "--emit-yaml" in args:
        args[args.index("--emit-yaml") + 1] = "-"
    if "--dry-run" not in args:
        args.insert(0, "--dry-run")
    r = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert r.returncode == 0, (example, r.stderr)
    if "--emit-yaml" in args:
        yaml = pytest.importorskip("yaml")
        jobset = next(yaml.safe_load_all(r.stdout))
        container = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
        exports = [f"{e['name']}={e['value']}" for e in container.get("env", []) if "value" in e
                   and not e["name"].startswith("MEGASCALE")]
        return exports, shlex.split(container["args"][0].strip().splitlines()[-1])
    cmds = [shlex.split(line[2:]) for line in r.stdout.splitlines() if line.startswith("+ ")]
    if script == TPU_VM:
        ssh = [c for c in cmds if c[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]][-1]
        return command_part(ssh[ssh.index("--command") + 1])
    create = [c for c in cmds if "workload" in c and "create" in c][0]
    command = create[create.index("--command") + 1]
    command = command.removeprefix("pip install --quiet -e '.[tpu]' && ")
    exports = [create[i + 1] for i, w in enumerate(create) if w == "--env"]
    return exports, shlex.split(command)


def test_every_readme_example_runs_on_each_host_what_the_simulation_runs(tmp_path, monkeypatch):
    """Each example of launch/README.md, dry-run as written, runs on every host the command (and --env
    variables) that the same example with `--simulate` runs on each simulated host (one host for --serve)."""
    monkeypatch.setenv("DGEMMA_API_KEY", "readme-key")   # --serve's key: the same in both (else random each)
    examples = readme_examples()
    assert len(examples) >= 10 and {e[0] for e in examples} == {"launch/tpu_vm.sh", "launch/gke_xpk.sh"}
    simulated_examples = 0
    for example in examples:
        real = real_host_command(example)
        n = "1" if "--serve" in example else "2"
        args = [w for w in example[1:] if w != "--dry-run"]
        r = launch(ROOT / example[0], "--dry-run", "--simulate", n, *args, logs=tmp_path, timeout=30)
        assert r.returncode == 0, (example, r.stderr)
        hosts = simulated_hosts(r.stdout)
        assert len(hosts) == int(n), example
        for h in hosts:
            assert command_part(h.command) == real, example
        simulated_examples += "--simulate" in example
    assert simulated_examples >= 1  # the README shows the simulation itself too


def test_the_simulation_runs_what_its_dry_run_prints(tmp_path):
    """A real simulated run starts the per-host commands its --dry-run prints (up to the coordinator port)."""
    args = ["--simulate", "2", "--simulate-devices", "3", "--env", "GREETING=it's me", "--", "sh", "-c",
            'echo "$GREETING from $DGEMMA_PROCESS_ID of $DGEMMA_NUM_PROCESSES"']
    dry = launch(TPU_VM, "--dry-run", *args, logs=tmp_path, timeout=30)
    real = launch(TPU_VM, *args, logs=tmp_path, timeout=60)
    assert dry.returncode == 0 and real.returncode == 0, real.stderr
    port = re.compile(r"127\.0\.0\.1:\d+")
    assert [port.sub("P", ln) for ln in dry.stdout.splitlines() if ln.startswith("+ ")] == \
           [port.sub("P", ln) for ln in real.stderr.splitlines() if ln.startswith("+ ")]
    assert real.stdout == "it's me from 0 of 2\n"
    assert (tmp_path / "host-1.out").read_text() == "it's me from 1 of 2\n"
