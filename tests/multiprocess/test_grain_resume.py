"""Grain input pipelines resumed exactly after SIGTERM, on as many and on other numbers of processes.

tests/multiprocess/workers/grain_resume.py trains an NNX model on a Grain
pipeline under PreemptionCheckpointHandler(data=): in this process (one
process, its 8 devices) and as real processes under dtensor.launch.
Interrupted by SIGTERM at step 3 and resumed, the global batches and the final
parameters equal an uninterrupted run's bit for bit (1 process on local disk, 2
processes in a bucket of the GCS emulator). Resumed from the same checkpoint on
another number of processes (1->2, 2->1, 2->4), every example of the run is
read exactly once.
"""

from __future__ import annotations

import importlib.util
import time

import pytest

from tests.multiprocess.util import WORKERS, expect_ok, report, results, run_worker

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOTAL, STOP = 6, 3


def train(ckpt, processes, stop=None, code=0):
    args = [str(ckpt), str(TOTAL)] + ([str(stop)] if stop else [])
    r = run_worker(
        "grain_resume",
        processes,
        *args,
        devices_per_process=1,
        timeout_s=150,
        stop_on_failure=False,
    )
    if code == 0:
        return expect_ok(r, processes)[0]
    assert r.returncodes == (code,) * processes, report(r)
    return results(r)[0]


class Stopped(Exception):
    """The handler's exit at a preemption save, in this process: carries what the run saw."""


def _stop(out):
    raise Stopped(out)


def train_here(ckpt, stop=None):
    spec = importlib.util.spec_from_file_location("grain_resume", WORKERS / "grain_resume.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    try:
        return worker.train(str(ckpt), TOTAL, stop, _stop)
    except Stopped as e:
        assert stop is not None
        return e.args[0]


def interrupted_then_resumed(ckpt, processes, resume_on):
    first = train(ckpt, processes, stop=STOP, code=143)
    assert first["start"] == 0
    stopped = first["seen"][-1][0]
    assert stopped >= STOP  # the notice is acted on at a step boundary all processes reach
    second = train(ckpt, resume_on)
    assert second["start"] == stopped and second["processes"] == resume_on
    return first, second


def check_exact(uninterrupted, first, second):
    assert first["seen"] + second["seen"] == uninterrupted["seen"]
    assert second["params"] == uninterrupted["params"]


def check_each_example_once(first, second):
    ids = [i for _, batch in first["seen"] + second["seen"] for i in batch]
    assert sorted(ids) == list(range(8 * TOTAL))
    assert [s for s, _ in first["seen"] + second["seen"]] == list(range(1, TOTAL + 1))


@pytest.mark.timeout(300)
def test_one_process_resumes_exactly_and_on_two(tmp_path):
    uninterrupted = train_here(tmp_path / "u")
    assert [s for s, _ in uninterrupted["seen"]] == list(range(1, TOTAL + 1))
    first = train_here(tmp_path / "c", stop=STOP)
    assert first["start"] == 0 and first["seen"][-1][0] == STOP  # one process: at that step
    second = train_here(tmp_path / "c")
    assert second["start"] == STOP
    check_exact(uninterrupted, first, second)
    # The same checkpoint (resumed runs save nothing) resumed by 2 real processes.
    on_two = train(tmp_path / "c", 2)
    assert on_two["start"] == STOP and on_two["processes"] == 2
    check_each_example_once(first, on_two)


@pytest.mark.xdist_group("multiprocess")
@pytest.mark.timeout(600)
def test_two_processes_in_a_bucket_resume_exactly_and_on_one_and_four(gcs):
    uninterrupted = train(gcs + "/u", 2)
    first, second = interrupted_then_resumed(gcs + "/c", 2, resume_on=2)
    check_exact(uninterrupted, first, second)
    stopped = first["seen"][-1][0]
    on_one = train_here(gcs + "/c")  # 2 -> 1: this process, its 8 devices
    on_four = train(gcs + "/c", 4)  # 2 -> 4: real processes
    for again in (on_one, on_four):
        assert again["start"] == stopped
        check_each_example_once(first, again)
    assert on_one["processes"] == 1 and on_four["processes"] == 4


@pytest.mark.extended
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.timeout(900)
@pytest.mark.parametrize("round_", range(3))
def test_preemption_saves_to_a_bucket_resume_past_step_0_every_time(gcs, round_):
    """The failure-handler scenario in a bucket, again and again: SIGTERM to process 0, both
    processes save the same step to gs:// and exit 143 within the run's bound, and the restart
    resumes from that step (30 rounds in a row passed when this was written, 10 of them beside
    two CPU burners)."""
    start = time.monotonic()
    first, second = interrupted_then_resumed(gcs + f"/r{round_}", 2, resume_on=2)
    assert second["start"] >= STOP and time.monotonic() - start < 240
    check_each_example_once(first, second)
