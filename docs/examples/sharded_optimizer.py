import hashlib

import numpy as np
import trio

import trioring

FEATURES = 12  # parameters of the model: a multiple of the world size
SAMPLES_PER_RANK = 64
STEPS = 8
LEARNING_RATE = 0.2
MOMENTUM = 0.5
TRUE_WEIGHTS = np.random.default_rng(0).standard_normal(FEATURES)


def samples(seed: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` rows of a linear regression problem, the same on every rank."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((count, FEATURES))
    y = x @ TRUE_WEIGHTS + 0.1 * rng.standard_normal(count)
    return x, y


def gradient(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """The gradient and value of the loss mean((x @ w - y) ** 2) / 2."""
    residual = x @ w - y
    return x.T @ residual / len(y), float(np.mean(residual**2) / 2)


async def train(comm: trioring.Communicator) -> tuple[np.ndarray, list[float]]:
    n, r = comm.world_size, comm.rank
    x, y = samples(seed=1, count=n * SAMPLES_PER_RANK)
    rows = slice(r * SAMPLES_PER_RANK, (r + 1) * SAMPLES_PER_RANK)
    x, y = x[rows], y[rows]  # this rank's share of the data
    shard = FEATURES // n
    mine = slice(r * shard, (r + 1) * shard)  # the parameters this rank updates
    w = np.zeros(FEATURES)  # every rank holds all the parameters ...
    velocity = np.zeros(shard)  # ... but the optimizer state of its shard only
    losses = []
    for _ in range(STEPS):
        grad, loss = gradient(w, x, y)
        # Average the gradients over the ranks; this rank gets block r of the result only.
        grad_shard = await comm.reduce_scatter(grad, op="mean")
        velocity = MOMENTUM * velocity + grad_shard
        w_shard = w[mine] - LEARNING_RATE * velocity
        # Every rank gets every rank's updated shard, in rank order: shape (n, shard).
        w = (await comm.allgather(w_shard)).reshape(-1)
        mean_loss = np.array([loss])
        await comm.allreduce(mean_loss, op="mean")
        losses.append(float(mean_loss[0]))
    return w, losses


def reference(world_size: int) -> np.ndarray:
    """The same training in one process, with plain numpy on all the data at once."""
    x, y = samples(seed=1, count=world_size * SAMPLES_PER_RANK)
    w, velocity = np.zeros(FEATURES), np.zeros(FEATURES)
    for _ in range(STEPS):
        grad, _ = gradient(w, x, y)
        velocity = MOMENTUM * velocity + grad
        w = w - LEARNING_RATE * velocity
    return w


async def main() -> None:
    async with trioring.open_communicator() as comm:
        w, losses = await train(comm)
        # Bitwise identical on every rank: compare a hash of the bytes.
        digest = np.frombuffer(hashlib.sha256(w.tobytes()).digest(), dtype=np.uint8)
        digests = await comm.allgather(digest)
        assert (digests == digest).all(), "parameters differ between ranks"
        # Equal to the one-process result, up to the order of additions.
        np.testing.assert_allclose(w, reference(comm.world_size), rtol=1e-12, atol=1e-12)
        if comm.rank == 0:
            for step, loss in enumerate(losses):
                print(f"step {step}: loss {loss:.6f}")
            print(f"parameters bitwise identical on {comm.world_size} ranks")
            print("and within 1e-12 of the one-process reference")


if __name__ == "__main__":
    trio.run(main)
