import numpy as np
import trio

import trioring

TASKS = 12
TASK, RESULT = 1, 2  # tags
STOP = -1  # a task id that tells a worker to return


def primes_below(limit: int) -> int:
    """The work: count the primes below `limit` (a sieve; larger tasks take longer)."""
    sieve = np.ones(limit, dtype=bool)
    sieve[:2] = False
    for p in range(2, int(limit**0.5) + 1):
        if sieve[p]:
            sieve[p * p :: p] = False
    return int(sieve.sum())


def limit_of(task: int) -> int:
    return 10_000 * (task + 1)


async def coordinate(comm: trioring.Communicator) -> dict[int, int]:
    """Rank 0: a task to each worker, then the next task to whichever worker returns a
    result; once none is left, a stop message instead."""
    todo = list(range(TASKS))

    def next_task() -> np.ndarray:
        task = todo.pop(0) if todo else STOP
        return np.array([task, limit_of(task)])

    for worker in range(1, comm.world_size):
        await comm.send(next_task(), dest=worker, tag=TASK)
    results: dict[int, int] = {}
    while len(results) < TASKS:
        # From whichever worker finishes first: recv_any also returns its rank.
        worker, (task, count) = await comm.recv_any(tag=RESULT)
        results[int(task)] = int(count)
        await comm.send(next_task(), dest=worker, tag=TASK)
    return results


async def work(comm: trioring.Communicator) -> None:
    while True:
        # A receive names one tag (there is no "any tag"): the stop message is a task
        # message with a task id that no task has.
        task, limit = await comm.recv(source=0, tag=TASK)
        if task == STOP:
            return
        await comm.send(np.array([task, primes_below(int(limit))]), dest=0, tag=RESULT)


async def main() -> None:
    async with trioring.open_communicator() as comm:
        assert comm.world_size >= 2, "rank 0 hands out the tasks: start 2 ranks or more"
        # A worker that stops may leave at once: it tells rank 0 so, and rank 0's recv_any
        # goes on waiting for the other workers.
        if comm.rank == 0:
            results = await coordinate(comm)
            for task in sorted(results):  # in task order: the order of arrival varies
                print(f"primes below {limit_of(task):6}: {results[task]}")
            print(f"{len(results)} tasks done by {comm.world_size - 1} workers")
        else:
            await work(comm)


trio.run(main)
