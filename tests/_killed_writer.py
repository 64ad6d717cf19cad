"""Helper for tests/test_runlog.py: log steps forever until killed (the killed-run test).

    python tests/_killed_writer.py RUN.h5

Creates a RunLog with flush_every=5 and logs step s with loss = loss_of(s), test_acc every 10 steps,
one rank row and two timeline events per step, sleeping a little between steps. After every flush it
prints the number of steps on disk, so the test knows what must survive a SIGKILL.
"""
import sys
import time

from hpcnn.log import RunLog


def loss_of(step: int) -> float:
    return 1.0 / (1.0 + step)


def acc_of(step: int) -> float:
    return step / (step + 10.0)


def main(path: str) -> None:
    log = RunLog(path, {"model": "killed"}, command_line=" ".join(sys.argv), flush_every=5)
    step = 0
    while True:
        log.log_ranks(step, [{"rank": 0, "compute_s": 0.5 * step, "bytes_sent": step}])
        log.log_events([(0, "F", step, step, step + 0.5), (0, "B", step, step + 0.5, step + 1.0)])
        if step % 10 == 0:
            log.log_metrics(step, loss=loss_of(step), test_acc=acc_of(step))
        else:
            log.log_metrics(step, loss=loss_of(step))
        if (step + 1) % log.flush_every == 0:
            print(log.flushed_steps, flush=True)
        step += 1
        time.sleep(0.01)   # 5 steps = 50 ms between flushes; the test kills right after a print


if __name__ == "__main__":
    main(sys.argv[1])
