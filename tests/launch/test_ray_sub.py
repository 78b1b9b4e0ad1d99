"""launch/ray.sub without Slurm: syntax, the dry-run plan, whole runs against a fake Slurm, and
the wait for the cluster against a stub `ray`.

The fake Slurm (`fake_slurm`) is a set of scripts on PATH: `srun` logs its arguments and runs the
command as pyxis would (a `--container-image` step creates the node's named container, a
`--container-name=NAME:exec` step must find it running), `scontrol` lists the nodes and their
GRES, `getent`/`ip` answer the head's route, and `ray`/`python` record where they ran. With
`FAKE_IMAGE_ONLY=1` they exist only inside a container, as on a cluster whose hosts have no Ray.

The script runs its `main` only when executed, so a test can also source it and call
`wait_for_cluster` with `RAY` pointing at a stub that prints `ray status` output.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "ray.sub"
PHASE = re.compile(r"^\[ray\.sub (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z)\] phase: (.+)$")

# `ray status` of Ray 2.60 as it prints it (read on this machine); the stub puts one " 1 node_<i>"
# line per node at NODES and the GPU total at {gpus}.
_STATUS = """======== Autoscaler status: 2026-12-06 07:45:59.739891 ========
Node status
---------------------------------------------------------------
Active:
NODES
Pending:
 (no pending nodes)
Recent failures:
 (no failures)

Resources
---------------------------------------------------------------
Total Usage:
 0.0/64.0 CPU
 0.0/{gpus}.0 GPU
 0B/29.01GiB memory
 0B/12.43GiB object_store_memory

From request_resources:
 (none)
Pending Demands:
 (no resource demands)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CONTAINER_"))}
    return env | extra


def _bash(command: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=60, env=_env(**env)
    )


def _script(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


FAKE_SRUN = r"""
# One append per record (args, then the record end): steps started at once must not interleave.
record=$(printf '%s\x1f' "$@"); printf '%s\x1e' "$record" >>"$FAKE/srun.log"
node='' image='' name=''
while [[ "$1" == --* ]]; do
  case "$1" in
    --nodelist=*) node="${1#*=}" ;;
    --container-image=*) image="${1#*=}" ;;
    --container-name=*) name="${1#*=}" ;;
  esac
  shift
done
export FAKE_NODE="$node"
unset FAKE_CONTAINER
running="$FAKE/containers/$node/${name%%:*}" created=0
if [[ "$name" == *:exec ]]; then
  [[ -e "$running" ]] || { echo "pyxis: error: the container is not running" >&2; exit 1; }
  export FAKE_CONTAINER="$node/${name%%:*}"
elif [[ -n "$name" && -n "$image" ]]; then
  mkdir -p "$FAKE/containers/$node" && touch "$running" && created=1
  export FAKE_CONTAINER="$node/$name"
fi
"$@" &
child=$!
trap 'kill -TERM $child' TERM
wait $child; code=$?
while kill -0 $child 2>/dev/null; do wait $child; code=$?; done
((created)) && rm -f "$running"
exit $code
"""

FAKE_RAY = r"""
where="${FAKE_NODE:-batch} ${FAKE_CONTAINER:-host}"
if [[ -n "${FAKE_IMAGE_ONLY:-}" && -z "${FAKE_CONTAINER:-}" ]]; then
  echo "ray: command not found" >&2; exit 127
fi
echo "$where $*" >>"$FAKE/ray.log"
case "$1" in
  start)
    for arg; do [[ "$arg" == --num-gpus=* ]] && echo "${arg#*=}" >"$FAKE/gpus.$FAKE_NODE"; done
    trap 'echo "$where stopped" >>"$FAKE/ray.log"; exit 0' TERM
    while :; do sleep 0.05; done ;;
  status)
    echo "Active:"
    for started in "$FAKE"/gpus.*; do [[ -e "$started" ]] && echo " 1 node_${started##*.}"; done
    total=$(cat "$FAKE"/gpus.* 2>/dev/null | awk '{ total += $1 } END { print total + 0 }')
    printf 'Pending:\n (no pending nodes)\nResources\n Usage:\n 0.0/%s.0 GPU\n' "$total" ;;
esac
"""

FAKE_PYTHON = r"""
if [[ -n "${FAKE_IMAGE_ONLY:-}" && -z "${FAKE_CONTAINER:-}" ]]; then
  echo "python: command not found" >&2; exit 127
fi
echo "${FAKE_NODE:-batch} ${FAKE_CONTAINER:-host} RAY_ADDRESS=$RAY_ADDRESS $*" >>"$FAKE/recipe.log"
"""


@pytest.fixture
def fake_slurm(tmp_path: Path):
    """A three-node allocation n0..n2 with IPs 10.1.0.1..3 on ib0."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(bin_dir / "srun", FAKE_SRUN)
    _script(bin_dir / "ray", FAKE_RAY)
    _script(bin_dir / "python", FAKE_PYTHON)
    _script(
        bin_dir / "scontrol",
        """case "$1 $2" in
  "show hostnames") printf '%s\\n' $FAKE_NODES ;;
  "show node") echo "NodeName=$4 Arch=x86_64 CoresPerSocket=32 Gres=$FAKE_GRES NodeAddr=$4" \
    "NodeHostName=$4 State=ALLOCATED" ;;
esac
""",
    )
    _script(
        bin_dir / "getent", '[[ "$1" == ahostsv4 ]] && echo "10.1.0.$((${2#n} + 1)) STREAM $2"\n'
    )
    _script(
        bin_dir / "ip",
        '[[ "$*" == "-o -4 route get "* ]] && '
        'echo "$5 dev ib0 src ${FAKE_SRC:-10.1.0.1} uid 1000 \\    cache"\n',
    )
    return tmp_path


def _run_job(fake: Path, *overrides: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *overrides],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(
            PATH=f"{fake / 'bin'}:{os.environ['PATH']}",
            FAKE=str(fake),
            FAKE_NODES="n0 n1 n2",
            FAKE_GRES="gpu:h200:4(S:0-1)",
            SLURM_JOB_ID="77",
            SLURM_JOB_NODELIST="n[0-2]",
            GPUS_PER_NODE="4",
            CPUS_PER_NODE="8",
            REPO_DIR=str(SCRIPT.parents[1]),
            PYTHON=str(fake / "bin" / "python"),
            RAY_POLL_S="0.05",
            RAY_WAIT_TIMEOUT_S="20",
            RAY_PORT="6379",
            RAY_TMP_DIR=str(fake / "ray-tmp"),
        )
        | env,
    )


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _head_start(fake: Path) -> str:
    """The head's `ray start` call. Not necessarily the first line of ray.log: the head's step
    runs in the background, so under load the first `ray status` poll can be logged before it."""
    (start,) = [call for call in _lines(fake / "ray.log") if " start --head " in call]
    return start


def _steps(fake: Path) -> list[list[str]]:
    """The argument lists of every `srun` call, in order."""
    records = (fake / "srun.log").read_text().split("\x1e")[:-1]
    return [record.split("\x1f")[:-1] for record in records]


@pytest.fixture
def stub_ray(tmp_path: Path):
    """A `ray` whose status reports one more node at each call (from the second), up to
    `limit` nodes, each with `gpus_per_node` GPUs (both file-controlled)."""
    (tmp_path / "limit").write_text("2")
    (tmp_path / "gpus_per_node").write_text("8")
    (tmp_path / "calls").write_text("0")
    status = tmp_path / "status.txt"
    status.write_text(_STATUS)
    stub = tmp_path / "ray"
    stub.write_text(
        f"""#!/bin/bash
[[ "$1" == status && "$2" == --address=* ]] || exit 2
calls=$(( $(cat {tmp_path}/calls) + 1 )); echo $calls > {tmp_path}/calls
[[ $calls -ge 2 ]] || exit 1   # unreachable at first, as while the head starts
nodes=$(( calls - 1 )); limit=$(cat {tmp_path}/limit)
(( nodes > limit )) && nodes=$limit
gpus=$(( nodes * $(cat {tmp_path}/gpus_per_node) ))
awk -v nodes=$nodes '$0 == "NODES" {{ for (i = 0; i < nodes; i++) print " 1 node_" i; next }} 1' \
  {status} | sed "s/{{gpus}}/$gpus/"
"""
    )
    stub.chmod(0o755)
    _script(tmp_path / "srun", FAKE_SRUN)
    return tmp_path


def _wait(stub: Path, command: str, timeout_s: str) -> subprocess.CompletedProcess[str]:
    """`command` after sourcing the script, with the globals `main` would set (head n0)."""
    return _bash(
        f"source {SCRIPT}; HEAD=n0 GPU_GRES=1 GPUS_PER_NODE=8 CPUS_PER_NODE=1 "
        f"RAY_TMP_DIR=/tmp/ray-77; {command}",
        PATH=f"{stub}:{os.environ['PATH']}",
        FAKE=str(stub),
        RAY=str(stub / "ray"),
        RAY_POLL_S="0.05",
        RAY_WAIT_TIMEOUT_S=timeout_s,
    )


def test_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_dry_run_prints_the_cluster_plan_and_forwards_overrides():
    result = subprocess.run(
        ["bash", str(SCRIPT), "+experiment=swe_bench_30b", "run.name=a b", "grpo.num_steps=3"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(DRY_RUN="1", DRY_RUN_NODES="n0 n1 n2", GPUS_PER_NODE="8", CPUS_PER_NODE="32"),
    )
    assert result.returncode == 0, result.stderr
    phases = [m.group(2) for line in result.stderr.splitlines() if (m := PHASE.match(line))]
    assert phases == [
        "start Ray head on n0",
        "start 2 Ray worker(s)",
        "wait for 3 node(s), 24 GPUs",
        "run recipe",
        "teardown (exit code 0)",
    ]
    commands = [shlex.split(line.removeprefix("DRY_RUN: ")) for line in result.stdout.splitlines()]
    step = ["srun", "--overlap", "--nodes=1", "--ntasks=1"]
    resources = ["--gres=gpu:8", "--cpus-per-task=32"]
    head, *workers, recipe = commands
    assert head[:7] == [*step, "--nodelist=n0", *resources]
    assert head[7:10] == ["ray", "start", "--head"] and "--port=6379" in head
    assert "--labels=slurm-node=n0,slurm-node-index=0" in head
    assert "--temp-dir=/tmp/ray-dry-run" in head
    assert [w[4] for w in workers] == ["--nodelist=n1", "--nodelist=n2"]
    assert [w[7:] for w in workers] == [
        [
            "ray",
            "start",
            "--address=n0:6379",
            "--num-gpus=8",
            "--num-cpus=32",
            f"--labels=slurm-node=n{index},slurm-node-index={index}",
            "--temp-dir=/tmp/ray-dry-run",
            "--block",
        ]
        for index in (1, 2)
    ]
    assert recipe[:7] == [
        "srun",
        "--job-name=gym-grpo-recipe",
        *step[1:],
        "--nodelist=n0",
        "--cpus-per-task=32",
    ]
    # The step writes the recipe's pid where ray.sub passes a stop signal from, then execs it.
    assert recipe[7:11] == [
        "bash",
        "-c",
        '{ echo $$ >"$0"; } 2>/dev/null; exec "$@"',
        "/tmp/ray-dry-run/recipe.pid",
    ]
    assert recipe[11:] == [
        "python",
        "recipes/grpo.py",
        "cluster.ray_address=auto",
        "cluster.num_nodes=3",
        "cluster.gpus_per_node=8",
        "+experiment=swe_bench_30b",
        "run.name=a b",
        "grpo.num_steps=3",
    ]


def test_dry_run_creates_each_nodes_container_and_attaches_to_the_heads():
    result = subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(
            DRY_RUN="1",
            DRY_RUN_NODES="n0 n1",
            CONTAINER_IMAGE="nvcr.io/org/gym-grpo:1",
            CONTAINER_MOUNTS="/lustre:/lustre",
            REPO_DIR=str(SCRIPT.parents[1]),
        ),
    )
    assert result.returncode == 0, result.stderr
    head, worker, recipe = [
        shlex.split(line.removeprefix("DRY_RUN: ")) for line in result.stdout.splitlines()
    ]
    workdir = f"--container-workdir={SCRIPT.parents[1]}"
    for ray_step in (head, worker):
        assert ray_step[7:11] == [
            "--container-image=nvcr.io/org/gym-grpo:1",
            "--container-name=gym-grpo-ray-dry-run",
            "--container-mounts=/lustre:/lustre",
            workdir,
        ]
    assert recipe[5:9] == [
        "--nodelist=n0",
        "--cpus-per-task=16",
        "--container-name=gym-grpo-ray-dry-run:exec",
        workdir,
    ]
    polls = re.findall(r"DRY_RUN: would poll (.*) until", result.stderr)
    # The polls attach to the same container as the recipe's step (which alone is named).
    assert [shlex.split(poll)[:8] for poll in polls] == [[recipe[0], *recipe[2:9]]] * 2


def test_the_wait_polls_until_every_node_and_gpu_is_registered(stub_ray):
    result = _wait(stub_ray, "wait_for_cluster head:6379 2 16", timeout_s="30")
    assert result.returncode == 0, result.stderr
    assert "waiting for Ray at head:6379: 0/2 nodes, 0/16 GPUs registered" in result.stderr
    assert "waiting for Ray at head:6379: 1/2 nodes, 8/16 GPUs registered" in result.stderr
    assert "Ray at head:6379 has 2/2 nodes, 16/16 GPUs" in result.stderr
    assert (stub_ray / "calls").read_text().strip() == "3"
    polls = _steps(stub_ray)
    assert len(polls) == 3
    assert all(poll[3] == "--nodelist=n0" and "--gres=gpu:8" not in poll for poll in polls)


def test_the_wait_fails_at_its_deadline(stub_ray):
    (stub_ray / "limit").write_text("1")
    result = _wait(stub_ray, "wait_for_cluster head:6379 2 16", timeout_s="3")
    assert result.returncode == 1
    assert "has 1/2 nodes, 8/16 GPUs after RAY_WAIT_TIMEOUT_S=3 s" in result.stderr


def test_without_gpus_the_wait_still_waits_for_every_node(stub_ray):
    """0 of 0 GPUs is "all" of them before any worker joined; the nodes are what is counted."""
    (stub_ray / "gpus_per_node").write_text("0")
    (stub_ray / "limit").write_text("1")
    result = _wait(stub_ray, "wait_for_cluster head:6379 2 0", timeout_s="3")
    assert result.returncode == 1
    assert "has 1/2 nodes, 0/0 GPUs after RAY_WAIT_TIMEOUT_S=3 s" in result.stderr


def test_outside_slurm_it_refuses_with_a_hint():
    result = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60, env=_env()
    )
    assert result.returncode == 1
    assert "not inside a Slurm job; submit with sbatch (or set DRY_RUN=1)" in result.stderr


def test_the_wait_fails_fast_when_a_ray_step_exits(stub_ray):
    (stub_ray / "limit").write_text("1")
    result = _wait(
        stub_ray,
        "true & STEP_PIDS+=($!); STEP_NODES+=(n1); wait; wait_for_cluster head:6379 2 16",
        timeout_s="60",
    )
    assert result.returncode == 1
    assert "the Ray step on n1 exited" in result.stderr


@pytest.mark.parametrize(
    ("image", "gres"),
    [("", "gpu:h200:4(S:0-1)"), ("nvcr.io/org/gym-grpo:1", "(null)")],
    ids=["bare-metal+gres", "container+no-gres"],
)
def test_a_job_runs_every_ray_and_python_call_where_ray_runs(fake_slurm, image, gres):
    """Both modes end to end. In container mode `ray` and `python` exist only inside the image
    (FAKE_IMAGE_ONLY), so a poll or a recipe outside the head's container would fail the job."""
    result = _run_job(
        fake_slurm,
        "+experiment=swe_bench_30b",
        CONTAINER_IMAGE=image,
        FAKE_GRES=gres,
        FAKE_IMAGE_ONLY="1" if image else "",
    )
    assert result.returncode == 0, result.stderr
    # Where a call ran, as the fakes record it: "<node> <node>/<container>" or "<node> host".
    where = {
        node: f"{node} {node}/gym-grpo-ray-77" if image else f"{node} host"
        for node in ("n0", "n1", "n2")
    }
    ray_calls = _lines(fake_slurm / "ray.log")
    starts = [call for call in ray_calls if " start " in call]
    assert starts[0].startswith(f"{where['n0']} start --head --node-ip-address=10.1.0.1 ")
    assert sorted(starts[1:]) == [
        f"{where[node]} start --address=10.1.0.1:6379 --num-gpus=4 --num-cpus=8 "
        f"--labels=slurm-node={node},slurm-node-index={node[1]} "
        f"--temp-dir={fake_slurm / 'ray-tmp'} --block"
        for node in ("n1", "n2")
    ]
    polls = [call for call in ray_calls if " status " in call]
    assert len(polls) >= 2
    assert set(polls) == {f"{where['n0']} status --address=10.1.0.1:6379"}
    assert _lines(fake_slurm / "recipe.log") == [
        f"{where['n0']} RAY_ADDRESS=10.1.0.1:6379 recipes/grpo.py cluster.ray_address=auto "
        "cluster.num_nodes=3 cluster.gpus_per_node=4 +experiment=swe_bench_30b"
    ]
    assert sorted(call for call in ray_calls if call.endswith("stopped")) == [
        f"{where[node]} stopped" for node in ("n0", "n1", "n2")
    ]
    steps = _steps(fake_slurm)
    ray_steps = [step for step in steps if "start" in step]
    assert len(ray_steps) == 3
    assert all(("--gres=gpu:4" in step) == (not image) for step in ray_steps)
    assert not any(
        arg.startswith("--gres") for step in steps if "start" not in step for arg in step
    )
    assert any(arg.startswith("--container") for step in steps for arg in step) == bool(image)


def test_the_head_ip_is_the_source_of_its_route_to_the_other_nodes(fake_slurm):
    _run_job(fake_slurm, FAKE_SRC="10.1.0.9")
    probe = _steps(fake_slurm)[0]
    assert probe[3] == "--nodelist=n0" and probe[-1].endswith("route_source_ip n1")
    assert _head_start(fake_slurm).startswith("n0 host start --head --node-ip-address=10.1.0.9")


def test_ray_head_ip_overrides_the_probe(fake_slurm):
    result = _run_job(fake_slurm, RAY_HEAD_IP="192.168.7.1")
    assert result.returncode == 0, result.stderr
    assert "route_source_ip" not in (fake_slurm / "srun.log").read_text()
    assert "--node-ip-address=192.168.7.1 " in _head_start(fake_slurm)


def test_a_loopback_head_ip_is_refused_on_several_nodes(fake_slurm):
    result = _run_job(fake_slurm, FAKE_SRC="127.0.1.1")
    assert result.returncode == 1
    assert "the head's IP 127.0.1.1 is a loopback address" in result.stderr
    assert not (fake_slurm / "ray.log").exists()


@pytest.mark.slurm
def test_the_fake_slurm_answers_what_ray_sub_reads_as_the_real_one_does(local_slurm, fake_slurm):
    """The fake above stands in for Slurm where the real one cannot go here (pyxis containers,
    GPU GRES, 16 nodes); this asks it and the real local Slurm (launch/local_slurm/: nodes n0,
    n1, no GRES) what ray.sub reads, through ray.sub's own functions, and fails where they
    disagree: `scontrol show hostnames` (one name a line), `scontrol show node --oneliner` (one
    line of Key=value fields, the fake's a subset of the real one's, with the Gres and NodeAddr
    the script reads), and an `srun` step's output and exit status (the probes, the steps)."""
    real = _env(SLURM_CONF=str(local_slurm.conf))
    fake = _env(
        PATH=f"{fake_slurm / 'bin'}:{os.environ['PATH']}",
        FAKE=str(fake_slurm),
        FAKE_NODES="n0 n1",
        FAKE_GRES="(null)",
    )

    def ask(env: dict[str, str], command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", f"source {SCRIPT}; {command}"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )

    def fields(line: str) -> list[str]:
        return [field.split("=", 1)[0] for field in line.split() if "=" in field]

    hostnames = "scontrol show hostnames 'n[0-1]'"
    assert ask(real, hostnames).stdout == ask(fake, hostnames).stdout == "n0\nn1\n"

    node = "scontrol show node --oneliner n1"
    real_node, fake_node = ask(real, node).stdout, ask(fake, node).stdout
    assert len(real_node.splitlines()) == len(fake_node.splitlines()) == 1, (real_node, fake_node)
    assert set(fields(fake_node)) <= set(fields(real_node)), (fake_node, real_node)
    assert {"NodeName", "Gres", "NodeAddr"} <= set(fields(fake_node))
    assert ask(real, "gpu_gres n1").stdout == ask(fake, "gpu_gres n1").stdout == "0\n"
    # The real nodes share this host's address; the fake's are named as their NodeAddr.
    assert re.fullmatch(r"\d+\.\d+\.\d+\.\d+\n", ask(real, "node_addr n1").stdout)
    assert ask(fake, "node_addr n1").stdout == "n1\n"

    step = "srun --overlap --nodes=1 --ntasks=1 --nodelist=n1 bash -c 'echo out; exit 3'"
    real_step, fake_step = ask(real, step), ask(fake, step)
    assert real_step.stdout == fake_step.stdout == "out\n", (real_step.stderr, fake_step.stderr)
    assert real_step.returncode == fake_step.returncode == 3
