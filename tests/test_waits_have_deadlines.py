"""Every wait in the package has a deadline: a test that reads the source (tests/unbounded_waits.py)
and fails on a blocking call without one, unless the allow-list below says how it is bounded.

The allow-list is exact: an entry that no longer matches a call fails too, so it cannot outlive
the code it excuses. `KNOWN_UNBOUNDED` lists, apart, the calls that are not bounded yet, each with
where that is being fixed. docs/reliability.md's table "Every wait and its deadline" lists the
deadlines themselves.
"""

from pathlib import Path

import pytest

from tests.unbounded_waits import (
    collectives_and_groups,
    describe,
    unbounded_waits,
    unbounded_waits_in,
)

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ["gymrl", "nemo_gym_ext", "recipes"]

_RAY_SHUTDOWN = (
    "handed to the cleanup stack: Ray bounds its shutdown itself (SIGTERM, 1 s, SIGKILL and a "
    "bounded reap per process it started: ray/_private/node.py _kill_process_impl)"
)
_LOCAL_HASHING = (
    "the futures read and hash files on local disk to their end: work with no peer to wait for"
)

# (file, enclosing function, callee) -> how the call is bounded although it passes no timeout.
ALLOWED = {
    (
        "gymrl/cluster/slurm.py",
        "run_on_allocation",
        "subprocess.run",
    ): "a whole sweep point run through launch/ray.sub: bounded by the Slurm allocation's time "
    "limit (hydra.launcher.timeout_min) and by the run's own deadlines inside it",
    (
        "gymrl/recipes/serving.py",
        "serve_policy",
        "stop.wait",
    ): "the serve recipe serves until a signal sets the event: waiting is its job, not a stall",
    (
        "gymrl/generation/torch/engine.py",
        "TorchGenerationEngine._admit",
        "self._schedule.wait",
    ): "the engine loop's idle wait for work: a new request or close() notifies it",
    (
        "gymrl/generation/torch/engine.py",
        "TorchGenerationEngine._refit",
        "self._schedule.wait",
    ): "admission is paused, so the rows in flight end within their max_new_tokens; the "
    "refit's caller waits with generation.refit.timeout_s (gymrl.cluster.ray_calls.wait_for)",
    (
        "gymrl/generation/torch/engine.py",
        "TorchGenerationEngine.generate",
        "future.result",
    ): "the offline batch API (benchmarks, tests): the rows end within their max_new_tokens; "
    "the policy server's path is submit() under asyncio.wait_for",
    (
        "gymrl/generation/sglang/engine.py",
        "SGLangEngine._generate_all",
        "task.result",
    ): "the tasks were awaited by asyncio.gather just before: result() returns at once",
    (
        "gymrl/generation/sglang/engine.py",
        "SGLangEngine.begin_refit",
        "self._refit_lock.acquire",
    ): "held only by a refit, whose every step is bounded by generation.refit.timeout_s",
    (
        "gymrl/generation/sglang/weight_sync.py",
        "broadcast",
        "work.wait",
    ): "a torch.distributed work on a group made with timeout=generation.refit.timeout_s "
    "(join_weight_update_group): it fails at that deadline",
    (
        "gymrl/generation/sglang/weight_sync.py",
        "_broadcast_and_wait",
        "work.wait",
    ): "runs on the sender's pool thread while its caller waits with generation.refit.timeout_s "
    "(WeightSender._await); the group itself was made with that timeout, so the broadcast fails "
    "at it too",
    (
        "gymrl/generation/sglang/weight_sync.py",
        "_finished",
        "work.wait",
    ): "called only after work.is_completed(): returns at once, or raises what failed it",
    (
        "gymrl/generation/sglang/weight_sync.py",
        "WeightSender._connect",
        "joining.result",
    ): "after _await saw the rendezvous finish within generation.refit.timeout_s",
    (
        "gymrl/generation/sglang/weight_sync.py",
        "_failure",
        "call.result",
    ): "called only on finished futures (call.done() or wait(..., timeout=))",
    (
        "gymrl/cluster/session.py",
        "start_ray",
        "ray.init",
    ): "joining: called only once the cluster's GCS accepted a connection within "
    "cluster.ray_start_timeout_s (_wait_until_answering); starting the run's own: Ray's waits "
    "for the processes it starts",
    (
        "gymrl/cluster/session.py",
        "ClusterSession.start",
        "ray.shutdown",
    ): _RAY_SHUTDOWN,
    (
        "gymrl/roles/trainer.py",
        "MegatronTrainerRole.close",
        "self._group.shutdown",
    ): "MegatronTrainerGroup.shutdown kills the ranks' actors (ray.kill): it waits for nothing",
    (
        "gymrl/run/checkpoint.py",
        "hash_files",
        "ThreadPoolExecutor",
    ): _LOCAL_HASHING,
    (
        "gymrl/run/checkpoint.py",
        "verify_checkpoint",
        "ThreadPoolExecutor",
    ): _LOCAL_HASHING,
    (
        "gymrl/generation/sglang/engine.py",
        "SGLangEngine._resume",
        "asyncio.gather",
    ): "each _flush_cache gives up at FLUSH_DEADLINE_S and each of its POSTs has the request "
    "timeout; the caller waits in _run with 2 x request timeout + FLUSH_DEADLINE_S",
    (
        "gymrl/generation/sglang/engine.py",
        "SGLangEngine._on_all",
        "asyncio.gather",
    ): "each _post has an httpx timeout (generation.server.request_timeout_s, or the refit's); "
    "every caller runs it through _run, which waits with a deadline",
    (
        "gymrl/generation/sglang/engine.py",
        "SGLangEngine._load_adapter",
        "asyncio.gather",
    ): "each server's load POSTs with the refit timeout; update_adapter waits in _run with "
    "2 x the refit timeout (the load, then the unloads)",
    (
        "gymrl/generation/sglang/refit_checks/weights_checker.py",
        "WeightsChecker._on_all",
        "asyncio.gather",
    ): "each call POSTs with the checker's timeout_s; the engine runs every check through "
    "SGLangEngine._run with the checker's bound_s",
    (
        "nemo_gym_ext/rollout.py",
        "RolloutCollector.run_group",
        "asyncio.gather",
    ): "each episode is at most max_retries + 1 POSTs /run, each with env.rollout.run_timeout_s "
    "(the client's timeout), and bounded back-offs; the shard's caller waits with a deadline",
    (
        "nemo_gym_ext/json_body.py",
        "parse_json_body_off_loop",
        "asyncio.to_thread",
    ): "parses a body already read in full, and bounded before it was read (the policy "
    "server's by its context, request_body.py; the other servers' by RequestLimits): CPU work "
    "with nothing to wait for",
}

# Not bounded: known defects, each with where it is being fixed. Like ALLOWED, an entry that no
# longer matches a call fails, so the fix removes it.
KNOWN_UNBOUNDED: dict[tuple[str, str, str], str] = {}


def test_every_blocking_call_in_the_package_has_a_deadline_or_a_stated_bound():
    found = unbounded_waits(ROOT, PACKAGE)
    listed = ALLOWED | KNOWN_UNBOUNDED
    unexplained = [wait for wait in found if wait.key not in listed]
    assert not unexplained, (
        "blocking calls without a deadline (pass a timeout from config, or add the call to "
        "ALLOWED with how it is bounded):\n" + "\n".join(describe(unexplained))
    )
    stale = set(listed) - {wait.key for wait in found}
    assert not stale, f"allow-list entries that match no call any more, remove them: {stale}"


def test_torch_distributed_collectives_are_bounded_by_their_groups_timeout():
    collectives, untimed_groups = collectives_and_groups(ROOT, PACKAGE)
    assert collectives, "the Megatron trainer's collectives were not found: is the check blind?"
    assert not untimed_groups, f"process groups created without timeout=: {untimed_groups}"


UNBOUNDED = [
    ("ray.get(ref)", "ray.get without timeout="),
    ("self._ray.wait(refs)", "ray.wait without timeout="),
    ("queue.get()", ".get() waits"),
    ("event.wait()", ".wait() waits"),
    ("thread.join()", ".join() waits"),
    ("future.result()", ".result() waits"),
    ("lock.acquire()", ".acquire() waits"),
    ("process.communicate()", ".communicate() waits"),
    ("httpx.AsyncClient(limits=limits)", "httpx.AsyncClient without"),
    ("httpx.get(url)", "httpx.get without"),
    ("client.post(url, timeout=None)", "passes timeout=None"),
    ("subprocess.run(['ls'])", "subprocess.run without"),
    ("asyncio.wait(tasks)", "asyncio.wait without"),
    ("await queue.get()", ".get() waits"),
    ("await loop.run_in_executor(None, work)", "run_in_executor awaited without"),
    ("await asyncio.to_thread(work)", "to_thread awaited without"),
    ("await asyncio.gather(first, second)", "gather awaited without"),
    ("ray.init(address='auto')", "ray.init: no argument is a deadline"),
    ("ray.shutdown()", "ray.shutdown: no argument is a deadline"),
    ("client.on_exit(ray.shutdown)", "ray.shutdown passed on"),
    ("pool.shutdown()", ".shutdown() waits"),
    ("pool.shutdown(wait=True, cancel_futures=True)", ".shutdown() waits"),
]


@pytest.mark.parametrize(("call", "why"), UNBOUNDED, ids=[call for call, _ in UNBOUNDED])
def test_the_checker_finds_a_planted_unbounded_call(call, why):
    source = f"import asyncio\n\nasync def planted(queue, client):\n    return {call}\n"
    found = unbounded_waits_in(source, "planted.py")
    assert [(wait.function, wait.line) for wait in found] == [("planted", 4)]
    assert why in found[0].why


BOUNDED = [
    "ray.get(ref, timeout=5.0)",
    "queue.get(timeout=1.0)",
    "queue.get_nowait()",
    "event.wait(1.0)",
    "thread.join(5.0)",
    "', '.join(names)",
    "future.result(timeout_s)",
    "lock.acquire(timeout=1.0)",
    "options.get('key')",
    "HydraConfig.get()",
    "httpx.AsyncClient(timeout=5.0)",
    "subprocess.run(['ls'], timeout=10)",
    "await asyncio.wait_for(event.wait(), 1.0)",
    "await asyncio.wait_for(queue.get(), timeout=1.0)",
    "await asyncio.wait_for(loop.run_in_executor(None, work), 5.0)",
    "await asyncio.wait_for(asyncio.gather(first, second), timeout=5.0)",
    "pool.shutdown(wait=False, cancel_futures=True)",
    "time.sleep(1.0)",  # a sleep ends; only a loop of them may not
]


@pytest.mark.parametrize("call", BOUNDED)
def test_the_checker_leaves_bounded_calls_alone(call):
    source = f"import asyncio\n\nasync def fine(queue, client):\n    return {call}\n"
    assert unbounded_waits_in(source, "fine.py") == []


def test_an_asyncio_timeout_block_bounds_the_waits_inside_it():
    source = (
        "import asyncio\n\nasync def fine(event):\n    async with asyncio.timeout(1.0):\n"
        "        await event.wait()\n    await event.wait()\n"
    )
    assert [wait.line for wait in unbounded_waits_in(source, "fine.py")] == [6]


def test_a_futures_wait_counts_only_when_imported_from_the_futures_modules():
    imported = "from concurrent.futures import wait\n\ndef f(calls):\n    wait(calls)\n"
    local = "def f(wait, ref):\n    wait(ref, 'a refit')\n"
    assert [w.line for w in unbounded_waits_in(imported, "a.py")] == [4]
    assert unbounded_waits_in(local, "b.py") == []


# Whole modules: (source, line of the finding, why). A sleep loop is reported at its sleep.
PLANTED_MODULES = {
    "sleep_loop": (
        "import time\n\ndef planted(ready):\n    while not ready():\n        time.sleep(0.1)\n",
        5,
        "sleeps in a while loop (line 4) that compares no deadline",
    ),
    "async_sleep_loop": (
        "import asyncio\n\nasync def planted(ready):\n    while True:\n"
        "        if await ready():\n            return\n        await asyncio.sleep(0.1)\n",
        7,
        "sleeps in a while loop (line 4)",
    ),
    "aliased_sleep_loop": (
        "from time import sleep as nap\n\ndef planted(ready, tries):\n    while tries < 3:\n"
        "        nap(1)\n",
        5,
        "sleeps in a while loop (line 4)",
    ),
    "executor_exit": (
        "from concurrent.futures import ThreadPoolExecutor\n\ndef planted(work):\n"
        "    with ThreadPoolExecutor() as pool:\n        pool.submit(work)\n",
        4,
        "the executor's exit waits for every future",
    ),
    "aliased_ray": (
        "import ray as r\n\ndef planted(ref):\n    return r.get(ref)\n",
        4,
        "ray.get without timeout=",
    ),
    "imported_get": (
        "from ray import get\n\ndef planted(ref):\n    return get(ref)\n",
        4,
        "ray.get without timeout=",
    ),
    "aliased_ray_init": (
        "import ray as r\n\ndef planted():\n    r.init()\n",
        4,
        "ray.init: no argument is a deadline",
    ),
    "aliased_subprocess": (
        "import subprocess as sp\n\ndef planted():\n    sp.run(['ls'])\n",
        4,
        "subprocess.run without timeout=",
    ),
    "imported_gather": (
        "from asyncio import gather\n\nasync def planted(a, b):\n    return await gather(a, b)\n",
        4,
        "gather awaited without asyncio.wait_for",
    ),
}


@pytest.mark.parametrize("name", PLANTED_MODULES)
def test_the_checker_finds_a_planted_unbounded_wait_in_a_module(name):
    source, line, why = PLANTED_MODULES[name]
    found = unbounded_waits_in(source, "planted.py")
    assert [(wait.function, wait.line) for wait in found] == [("planted", line)]
    assert why in found[0].why


BOUNDED_MODULES = {
    "deadline_in_the_body": "import time\n\ndef fine(ready, deadline):\n"
    "    while not ready():\n        if time.monotonic() > deadline:\n"
    "            raise TimeoutError\n        time.sleep(0.1)\n",
    "deadline_in_the_test": "import time\n\ndef fine(ready, timeout_s):\n"
    "    deadline = time.monotonic() + timeout_s\n"
    "    while not ready() and time.monotonic() < deadline:\n        time.sleep(0.1)\n",
    "loop_clock": "import asyncio\n\nasync def fine(ready, loop, end):\n"
    "    while not ready() and loop.time() < end:\n        await asyncio.sleep(0.1)\n",
    "inside_a_timeout_block": "import asyncio\n\nasync def fine(ready):\n"
    "    async with asyncio.timeout(5):\n        while not ready():\n"
    "            await asyncio.sleep(0.1)\n",
    "a_sleep_in_a_function_defined_in_a_loop": "import time\n\ndef fine(items):\n"
    "    while items:\n        def later():\n            time.sleep(1)\n        items.pop()\n",
    "an_executor_shut_down_without_waiting": "from concurrent.futures import ThreadPoolExecutor\n"
    "\ndef fine(work):\n    pool = ThreadPoolExecutor()\n    pool.submit(work)\n"
    "    pool.shutdown(wait=False)\n",
    "an_aliased_get_with_a_timeout": "import ray as r\n\ndef fine(ref):\n"
    "    return r.get(ref, timeout=5.0)\n",
}


@pytest.mark.parametrize("name", BOUNDED_MODULES)
def test_the_checker_leaves_bounded_modules_alone(name):
    assert unbounded_waits_in(BOUNDED_MODULES[name], "fine.py") == []
