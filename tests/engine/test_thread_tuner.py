"""The compute-thread tuner: one short try after the first window (a box busy from the start); a
slowdown tries one thread fewer and keeps it only when faster; below the full count the full
count is retried and taken back when the cores are free again; a try alternates its steps with
the current count's, so a slowdown of the whole box is no reason to drop a thread. Step times are
made up: seconds per token as a function of the threads. Where the box's load can be read
(/proc/stat), a quiet start has no try."""
import collections
import logging

import pytest

from freetoken.engine import thread_tuner as tt


class Box:
    """A machine whose step time depends on the thread count and on whether a hog runs."""

    def __init__(self):
        self.hog, self.threads, self.calls = False, 2, []
        self.steps = collections.Counter()            # steps run, by thread count
        self.slow_steps = 0                           # the next this many steps: every core slower
        self.readable, self.elapsed = False, 0.0      # the tuner's CoreLoad stand-in

    def set_threads(self, n):
        self.threads = n
        self.calls.append(n)

    def start(self):
        self.elapsed = 0.0

    def others(self):
        """What CoreLoad would read: a hog keeps one core busy; None: /proc/stat unreadable."""
        return (1.0 if self.hog else 0.0) if self.readable else None, self.elapsed

    def step_time(self):
        self.steps[self.threads] += 1
        self.elapsed += self.quiet_time()
        if self.slow_steps > 0:                      # another guest of the VM's host: both counts
            self.slow_steps -= 1
            return 2 * self.quiet_time()
        return self.quiet_time()

    def quiet_time(self):
        if self.hog:
            return {2: 0.40, 1: 0.04}[self.threads]       # the second thread waits for slices
        return {2: 0.02, 1: 0.035}[self.threads]


def run(tuner, box, steps, tokens=1):
    """steps decode steps, then more until no try is under way (box.threads is the settled count)."""
    for _ in range(steps):
        tuner.observe(box.step_time() * tokens, tokens)
    while tuner.trying:
        tuner.observe(box.step_time() * tokens, tokens)


@pytest.fixture
def box_and_tuner(caplog):
    """A box whose load the tuner cannot read (its start always tries one thread fewer)."""
    caplog.set_level(logging.INFO, logger="tuner-test")
    box = Box()
    return box, tt.ThreadTuner(2, box.set_threads, logging.getLogger("tuner-test"), load=box)


def test_a_quiet_box_whose_load_is_read_has_no_start_try(box_and_tuner, caplog):
    """Others used no core over the first START_SAMPLE_S (15 steps of 20 ms here): no try, one
    DEBUG line; the decision waits for the span, not only the START_STEPS steps."""
    caplog.set_level(logging.DEBUG, logger="tuner-test")
    box, tuner = box_and_tuner
    box.readable = True
    run(tuner, box, tt.WARM_STEPS + tt.START_STEPS)
    assert not tuner._tried_at_start                            # 60 ms seen: not enough yet
    run(tuner, box, 2000)
    assert box.steps[1] == 0 and tuner.n == 2 and "no start try" in caplog.text


def test_a_box_busy_from_the_start_whose_load_is_read_drops_a_thread(box_and_tuner):
    box, tuner = box_and_tuner
    box.readable, box.hog = True, True
    run(tuner, box, tt.WARM_STEPS + tt.START_STEPS + tt.START_STEPS)
    assert tuner.n == 1 and box.threads == 1


def test_core_load_reads_this_machine():
    load = tt.CoreLoad()
    load.start()
    sum(i * i for i in range(200_000))                         # some CPU time of our own
    others, span = load.others()
    assert span > 0 and (others is None or others >= 0)


def test_a_quiet_box_tries_once_at_the_start_and_keeps_every_thread(box_and_tuner, caplog):
    box, tuner = box_and_tuner
    run(tuner, box, 2000, tokens=3)
    assert box.steps[1] == tt.START_STEPS and tuner.n == 2 and "cpu threads" not in caplog.text


def test_a_process_started_on_a_busy_box_drops_a_thread(box_and_tuner):
    box, tuner = box_and_tuner
    box.hog = True                                     # busy from the first step: no slowdown to see
    run(tuner, box, tt.WARM_STEPS + tt.PROBE_STEPS + tt.START_STEPS)
    assert tuner.n == 1 and box.threads == 1


def test_the_first_steps_are_not_timed(box_and_tuner, caplog):
    """The first decode steps pay one-time costs (here 500x a settled step): timed, they made the
    start's try report factors up to 600x and drop a thread on a quiet box."""
    box, tuner = box_and_tuner
    for _ in range(tt.WARM_STEPS):
        tuner.observe(500 * box.step_time(), 1)
    run(tuner, box, 200)
    assert tuner.n == 2 and box.threads == 2 and "cpu threads" not in caplog.text


def test_a_hog_drops_a_thread_and_its_end_takes_it_back(box_and_tuner, caplog):
    box, tuner = box_and_tuner
    run(tuner, box, 20)
    box.hog = True
    run(tuner, box, 3 * tt.PROBE_STEPS)
    assert tuner.n == 1 and box.threads == 1
    assert "cpu threads 2 -> 1: decode 400.00 -> 40.00 ms a token, 10.0x faster" in caplog.text
    assert "another process" in caplog.text
    run(tuner, box, 2 * tt.RETRY_EVERY)              # retries of 2 lose while the hog runs
    assert tuner.n == 1 and box.threads == 1 and box.calls.count(2) >= 1
    box.hog = False
    run(tuner, box, tt.RETRY_EVERY + 3 * tt.PROBE_STEPS)
    assert tuner.n == 2 and box.threads == 2 and "cpu threads 1 -> 2" in caplog.text
    box.hog = True
    run(tuner, box, 3 * tt.PROBE_STEPS)
    tuner.restore()                                    # the engine closes: the caller's count back
    assert tuner.n == 2 and box.threads == 2


def test_a_slowdown_fewer_threads_do_not_fix_is_undone(box_and_tuner, caplog):
    box, tuner = box_and_tuner
    run(tuner, box, 20)
    box.quiet_time = lambda: {2: 0.2, 1: 0.35}[box.threads]    # e.g. a longer context: slower anyway
    run(tuner, box, 3 * tt.PROBE_STEPS)
    tried = tt.START_STEPS + tt.PROBE_STEPS                     # the start's try, then this one
    assert tuner.n == 2 and box.threads == 2 and box.steps[1] == tried
    run(tuner, box, 500)                                        # settled at the new speed: no more tries
    assert box.steps[1] == tried and "cpu threads" not in caplog.text


def test_a_short_slowdown_of_the_whole_box_keeps_every_thread(box_and_tuner, caplog):
    """Every core 2x slower for a window's steps, then quiet as the try starts: judged against the
    slow steps, one thread (35 ms against 40) looked faster and was kept for RETRY_EVERY steps;
    alternate steps compare it with two threads on the same box (35 against 20)."""
    box, tuner = box_and_tuner
    run(tuner, box, 20)
    box.slow_steps = tt.PROBE_STEPS
    run(tuner, box, tt.PROBE_STEPS)
    assert box.steps[1] == tt.START_STEPS + tt.PROBE_STEPS       # the slowdown started a try
    run(tuner, box, 300)
    assert tuner.n == 2 and box.threads == 2 and "cpu threads" not in caplog.text


def test_one_thread_has_nothing_to_drop():
    calls = []
    tuner = tt.ThreadTuner(1, calls.append, logging.getLogger("tuner-test"), load=Box())
    for i in range(100):
        tuner.observe(0.01 * (1 + i), 1)                         # ever slower
    assert calls == [] and tuner.n == 1


def test_steps_are_compared_only_with_steps_of_the_same_size(box_and_tuner):
    """Four sequences a step cost less per token than one: a batch shrinking is no slowdown."""
    box, tuner = box_and_tuner
    for _ in range(30):
        tuner.observe(4 * 0.008, 4)                    # 4 tokens a step: 8 ms a token
    calls = list(box.calls)
    for _ in range(300):
        tuner.observe(box.step_time(), 1)              # 1 token a step: 20 ms a token, not slower
    assert box.calls == calls and tuner.n == 2
