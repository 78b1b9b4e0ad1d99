"""Every wait in the package has a deadline: a test that reads the source (tests/unbounded_waits.py)
and fails on a blocking call without one, unless the allow-list below says how it is bounded.

The allow-list is exact: an entry that no longer matches a call fails too, so it cannot outlive
the code it excuses. docs/reliability.md's table "Every wait and its deadline" lists the
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
        "TorchGenerationEngine.update_weights",
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
        "_broadcast_bucket",
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
}


def test_every_blocking_call_in_the_package_has_a_deadline_or_a_stated_bound():
    found = unbounded_waits(ROOT, PACKAGE)
    unexplained = [wait for wait in found if wait.key not in ALLOWED]
    assert not unexplained, (
        "blocking calls without a deadline (pass a timeout from config, or add the call to "
        "ALLOWED with how it is bounded):\n" + "\n".join(describe(unexplained))
    )
    stale = set(ALLOWED) - {wait.key for wait in found}
    assert not stale, f"ALLOWED entries that match no call any more, remove them: {stale}"


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
