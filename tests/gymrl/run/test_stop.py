"""StopSignals with real signals delivered to this process (pytest runs tests in the main
thread, where Python runs signal handlers)."""

import os
import signal
import threading
import time

import pytest

from gymrl.run.stop import STOP_SIGNALS, StopRequested, StopSignals, stop_request_behind


@pytest.fixture
def stops_factory():
    """Installs StopSignals and puts back pytest's own handlers afterwards."""
    saved = {signum: signal.getsignal(signum) for signum in (*STOP_SIGNALS, signal.SIGALRM)}

    def make(mode="finish", deadline_s=30.0):
        stops = StopSignals(mode, deadline_s)
        stops.install()
        return stops

    yield make
    signal.setitimer(signal.ITIMER_REAL, 0)
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def _deliver(signum):
    """Send `signum` to this process; its handler runs at the next bytecode boundary."""
    os.kill(os.getpid(), signum)
    time.sleep(0.05)


@pytest.mark.parametrize("signum", STOP_SIGNALS)
def test_outside_a_step_a_signal_stops_at_once_with_the_shell_exit_code(stops_factory, signum):
    stops_factory()
    with pytest.raises(StopRequested) as stopped:
        _deliver(signum)
    assert stopped.value.exit_code == 128 + signum
    assert stopped.value.step_finished
    assert str(stopped.value).startswith(signal.Signals(signum).name)


def test_in_finish_mode_the_step_completes_then_the_run_stops(stops_factory):
    stops = stops_factory("finish")
    completed = []
    with pytest.raises(StopRequested) as stopped:
        for step in range(5):
            with stops.step():
                if step == 1:
                    _deliver(signal.SIGTERM)
                completed.append(step)
            stops.step_finished()
    assert completed == [0, 1]
    assert stopped.value.step_finished and stopped.value.exit_code == 143


def test_a_second_signal_abandons_the_step(stops_factory):
    stops = stops_factory("finish")
    with pytest.raises(StopRequested) as stopped, stops.step():
        _deliver(signal.SIGINT)
        _deliver(signal.SIGINT)
        pytest.fail("the second signal did not interrupt the step")
    assert not stopped.value.step_finished and stopped.value.exit_code == 130


def test_a_step_that_overruns_the_deadline_is_abandoned(stops_factory):
    stops = stops_factory("finish", deadline_s=0.3)
    started = time.monotonic()
    abandoned = pytest.raises(StopRequested, match=r"deadline_s=0.3 s; step abandoned")
    with abandoned as stopped, stops.step():
        _deliver(signal.SIGTERM)
        time.sleep(10)
    assert time.monotonic() - started < 5
    assert not stopped.value.step_finished


def test_in_abandon_mode_a_signal_interrupts_the_step(stops_factory):
    stops = stops_factory("abandon")
    with pytest.raises(StopRequested) as stopped, stops.step():
        _deliver(signal.SIGTERM)
        time.sleep(10)
    assert not stopped.value.step_finished


def test_once_stopping_further_signals_do_not_interrupt_cleanup(stops_factory, capsys):
    stops_factory()
    with pytest.raises(StopRequested):
        _deliver(signal.SIGTERM)
    _deliver(signal.SIGTERM)  # during cleanup: reported only
    _deliver(signal.SIGINT)
    assert capsys.readouterr().out.count("already stopping") == 2


def test_a_signal_during_a_ray_wait_is_still_the_stop_request(stops_factory, local_ray):
    """Inside Ray's compiled `ray.wait` the handler's exception comes out as a SystemError; the
    recipe finds the StopRequested behind it and stops as for any other signal."""
    import ray

    @ray.remote
    def never_done():
        time.sleep(60)

    stops_factory()
    pending = never_done.remote()
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(BaseException) as raised:
        ray.wait([pending], timeout=30)
    stop = stop_request_behind(raised.value)
    assert stop is not None and stop.exit_code == 128 + signal.SIGINT
    ray.cancel(pending, force=True)


def test_other_errors_have_no_stop_request_behind_them():
    try:
        raise SystemError("wrapped") from ValueError("not a signal")
    except SystemError as error:
        assert stop_request_behind(error) is None
