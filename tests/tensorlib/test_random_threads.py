"""The default generator per thread: ``tl.set_thread_generator``, and rank threads of the
threads backend seeding and drawing at once without racing or sharing streams."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import collectives
import tensorlib as tl


def _draws(seed: int, n: int = 2000) -> np.ndarray:
    """What ``manual_seed(seed)`` then ``randn(n)`` gives, drawn from a private generator."""
    return tl.randn(n, generator=tl.Generator(seed)).numpy()


def test_a_thread_generator_is_that_threads_default_only() -> None:
    tl.manual_seed(7)
    expected_main = tl.randn(5).numpy()
    tl.manual_seed(7)
    got: dict[str, np.ndarray] = {}

    def body() -> None:
        tl.set_thread_generator(tl.Generator())
        try:
            tl.manual_seed(123)  # seeds this thread's generator, not the process's
            got["thread"] = tl.randn(2000).numpy()
        finally:
            tl.set_thread_generator(None)

    t = threading.Thread(target=body)
    t.start()
    t.join(10)
    assert np.array_equal(got["thread"], _draws(123))
    # The process's generator neither moved nor was reseeded by the thread.
    assert np.array_equal(tl.randn(5).numpy(), expected_main)


def test_set_thread_generator_refuses_other_objects() -> None:
    with pytest.raises(TypeError, match=r"tensorlib\.Generator"):
        tl.set_thread_generator(np.random.default_rng(0))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"tensorlib\.Generator"):
        tl.set_thread_generator(tl.default_generator)


def _seed_and_draw(rank: int, unseeded: bool) -> list[float]:
    if not unseeded:
        tl.manual_seed(1000 + rank)
    out = []
    for _ in range(20):  # interleave with the other ranks' draws
        out.append(tl.randn(100).numpy())
        collectives.barrier()
    return np.concatenate(out).tolist()


@pytest.mark.timeout(60)
def test_rank_threads_seed_and_draw_their_own_streams() -> None:
    tl.manual_seed(5)
    parent_next = tl.randn(2000).numpy()
    tl.manual_seed(5)
    got = collectives.spawn(_seed_and_draw, (False,), nprocs=4, backend="threads", timeout=20)
    assert got is not None
    for rank, draws in enumerate(got):
        assert np.array_equal(np.asarray(draws), _draws(1000 + rank)), f"rank {rank} raced"
    # A rank that never seeds starts from a copy of the caller's generator, as a fork would.
    same = collectives.spawn(_seed_and_draw, (True,), nprocs=2, backend="threads", timeout=20)
    assert same is not None
    for draws in same:
        assert np.array_equal(np.asarray(draws), parent_next)
    # And the caller's own generator is where it was.
    assert np.array_equal(tl.randn(2000).numpy(), parent_next)
