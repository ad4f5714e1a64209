"""Rank bodies for ``ddp.idist`` and ``ddp.sync_*``: one body per helper, every world size.

Each runs on every rank of a pool (tests/ddp/conftest.py) or alone in the test process (world
size 1, nothing initialized), checks what a rank can check by itself with messages that name
the case, and returns what the test compares across ranks. The cases follow those Ignite's
own tests check for these helpers (tests/ignite/distributed/utils): numbers, 0-d and n-d
tensors, every reduction, strings of different lengths, every source rank, ``safe_mode`` with
None or a value of another type on the other ranks, the errors for bad inputs.
"""

from __future__ import annotations

import io
from contextlib import redirect_stderr
from pathlib import Path
from typing import Any

import numpy as np

import ddp
import ddp.idist as idist
import tensorlib as tl
from tensorlib import nn


def _eq(got: Any, want: Any, what: str) -> None:
    if isinstance(want, tl.Tensor | np.ndarray):
        g = got.numpy() if isinstance(got, tl.Tensor) else np.asarray(got)
        w = want.numpy() if isinstance(want, tl.Tensor) else want
        if g.shape != w.shape or g.dtype != w.dtype or not np.array_equal(g, w):
            raise AssertionError(f"{what}: got {g!r} ({g.dtype}), want {w!r} ({w.dtype})")
    elif type(got) is not type(want) or got != want:
        raise AssertionError(f"{what}: got {got!r} ({type(got).__name__}), want {want!r}")


def _raises(exc: type[BaseException], text: str, fn: Any, *args: Any, **kw: Any) -> None:
    try:
        fn(*args, **kw)
    except exc as e:
        if text not in str(e):
            raise AssertionError(f"{fn.__name__}: message {str(e)!r} lacks {text!r}") from e
        return
    raise AssertionError(f"{fn.__name__}{args}: did not raise {exc.__name__}")


# ---------------------------------------------------------------------- configuration
def config() -> dict[str, Any]:
    """What the configuration queries answer on this rank."""
    out = io.StringIO()
    with redirect_stderr(out):
        idist.show_config()
    return {
        "rank": idist.get_rank(),
        "world": idist.get_world_size(),
        "local_rank": idist.get_local_rank(),
        "nproc": idist.get_nproc_per_node(),
        "nnodes": idist.get_nnodes(),
        "node_rank": idist.get_node_rank(),
        "backend": idist.backend(),
        "model": idist.model_name(),
        "device": str(idist.device()),
        "hostname": idist.hostname(),
        "shown": out.getvalue(),
    }


# ---------------------------------------------------------------------- collectives
def all_reduce_cases() -> dict[str, Any]:
    """Numbers and tensors, every op; returns the reduced values of this rank."""
    ws, rank = idist.get_world_size(), idist.get_rank()
    vals = [2.0 * i + 1.0 for i in range(ws)]
    _eq(idist.all_reduce(10), 10 * ws, "int SUM")
    _eq(idist.all_reduce(rank * 2.0 + 1.0), sum(vals), "float SUM")
    _eq(idist.all_reduce(rank + 1, "PRODUCT"), int(np.prod(range(1, ws + 1))), "int PRODUCT")
    t = tl.tensor(10)
    res = idist.all_reduce(t)
    if res is not t:
        raise AssertionError("all_reduce of a tensor returns another object, not the tensor")
    _eq(res, np.array(10 * ws, dtype=np.int64), "0-d int tensor SUM")
    for op, want in (("MIN", min(vals)), ("MAX", max(vals)), ("PRODUCT", float(np.prod(vals)))):
        got = idist.all_reduce(tl.tensor(rank * 2.0 + 1.0), op)
        _eq(float(got.item()), want, f"0-d float tensor {op}")
    t = tl.ones(4, 4) * (rank * 2.0 + 1.0)
    _eq(idist.all_reduce(t, "max"), np.full((4, 4), max(vals), np.float32), "4x4 MAX")
    # A view that is not contiguous is reduced too (into a new tensor).
    base = tl.tensor(np.arange(6.0).reshape(2, 3) * (rank + 1))
    _eq(
        idist.all_reduce(base.T),
        (np.arange(6.0).reshape(2, 3) * sum(range(1, ws + 1))).T,
        "transposed view",
    )
    _raises(TypeError, "unhandled input type", idist.all_reduce, "abc")
    _raises(ValueError, "unsupported reduction operation", idist.all_reduce, 10, op="ABC")
    return {"sum": idist.all_reduce(rank + 0.5), "max": idist.all_reduce(rank, "MAX")}


def all_gather_cases() -> dict[str, Any]:
    """Ignite's shapes: concatenated tensors, lists for numbers and strings."""
    ws, rank = idist.get_world_size(), idist.get_rank()
    _eq(idist.all_gather(10), [10] * ws, "int")
    _eq(idist.all_gather(rank + 0.5), [r + 0.5 for r in range(ws)], "float")
    _eq(idist.all_gather(tl.tensor(rank)), np.arange(ws, dtype=np.int64), "0-d tensor")
    x = "abc" if rank == 0 else "test-test"
    _eq(idist.all_gather(x), ["abc"] + ["test-test"] * (ws - 1), "short strings")
    long = "tests/ddp/idist_bodies.py" * 2000
    x = "abc" if rank == 0 else long
    _eq(idist.all_gather(x), ["abc"] + [long] * (ws - 1), "strings of different lengths")
    t = tl.tensor(np.arange(100, dtype=np.int32).reshape(4, 25) * (rank + 1))
    want = np.concatenate(
        [np.arange(100, dtype=np.int32).reshape(4, 25) * (i + 1) for i in range(ws)]
    )
    _eq(idist.all_gather(t), want, "4x25 int32")
    obj = {"a": [rank + 1, rank + 2], "c": {"abcd": rank}}
    got = idist.all_gather(obj)
    _eq(got, [{"a": [i + 1, i + 2], "c": {"abcd": i}} for i in range(ws)], "dict")
    _raises(ValueError, "group must be", idist.all_gather, t, group="abc")
    return {"strings": idist.all_gather(f"r{rank}")}


def broadcast_cases() -> dict[str, Any]:
    """Every source rank; with and without safe_mode; numbers, strings, paths, tensors."""
    ws, rank = idist.get_world_size(), idist.get_rank()
    t = tl.tensor(np.array([1.2345, 2.3456], dtype=np.float32))
    grid = tl.tensor(np.arange(100).reshape(4, 25) * 2)
    long = "tests/ddp/idist_bodies.py::broadcast_cases" * 200
    path = Path("tests/ddp/idist_bodies.py")
    cases: list[tuple[Any, Any, bool]] = [
        (10, 0, False),
        (10, None, True),
        (12.5, 0.0, False),
        (t, tl.zeros_like(t), False),
        (t, None, True),
        (t, "abc", True),
        ("test-abcdefg", "", False),
        ("test-abcdefg", None, True),
        ("test-abcdefg", 1.2, True),
        (path, Path(""), False),
        (path, None, True),
        (path, "", True),
        (long, "", False),
        (long, 123.0, True),
        (grid, tl.zeros_like(grid), False),
        (grid, None, True),
        (grid, "None", True),
        (tl.tensor(12), tl.tensor(0), False),
        (tl.tensor(12), 123.4, True),
    ]
    for i, (data_src, data_others, safe) in enumerate(cases):
        for src in range(ws):
            data = data_src if rank == src else data_others
            got = idist.broadcast(data, src=src, safe_mode=safe)
            _eq(got, data_src, f"case {i} from rank {src} (safe_mode={safe})")
    _raises(TypeError, "unhandled input type", idist.broadcast, [0, 1, 2], src=0)
    if rank == 0:
        _raises(ValueError, "can not be None", idist.broadcast, None, src=0)
    else:
        _raises(ValueError, "needs safe_mode=True", idist.broadcast, None, src=0)
    _raises(ValueError, "src must be a rank", idist.broadcast, 1, src=ws)
    return {"from_last": idist.broadcast(f"r{rank}" if rank == ws - 1 else None, ws - 1, True)}


def barrier_case() -> float:
    """Rank 0 changes its value before the barrier; the all-reduce after it sees it."""
    t = tl.tensor([float(idist.get_rank())])
    if idist.get_rank() == 0:
        t = t + 10.0
    idist.barrier()
    return float(idist.all_reduce(t).item())


def group_cases() -> dict[str, Any]:
    """Subgroups by object and by rank list; ranks outside get their input back."""
    ws, rank = idist.get_world_size(), idist.get_rank()
    ranks = list(range(ws - 1, 0, -1))  # every rank but 0, given out of order
    out: dict[str, Any] = {}
    if ws == 1:
        # At world size 1 the only group is [0] (the same checks as at world size N).
        _eq(idist.new_group([0]), [0], "new_group outside any group")
    else:
        g = idist.new_group(ranks)
        if g.is_member() != (rank in ranks):
            raise AssertionError(f"new_group({ranks}): membership of rank {rank} is wrong")
        t = tl.tensor([rank])
        out["by_group"] = idist.all_gather(t, group=g).numpy().tolist()
        out["by_list"] = idist.all_gather(tl.tensor([rank]), group=ranks).numpy().tolist()
        out["sum_by_list"] = idist.all_reduce(rank, group=ranks)
        out["objects"] = idist.all_gather({"r": rank}, group=ranks)
    _raises(ValueError, "ranks must be a list of int", idist.new_group, ["a", "b"])
    _raises(ValueError, "ranks must be a list of int", idist.new_group, 1)
    return out


def one_rank_only_case(with_barrier: bool) -> list[int]:
    """The last rank alone runs the function; the gathered values show who did."""
    last = idist.get_world_size() - 1
    ran = tl.tensor([0])

    @idist.one_rank_only(rank=last, with_barrier=with_barrier)
    def bump() -> str:
        ran.data[0] += 100
        return "done"

    value = bump()
    if (value == "done") != (idist.get_rank() == last):
        raise AssertionError(f"one_rank_only returned {value!r} on rank {idist.get_rank()}")
    with idist.one_rank_first(rank=last):
        pass
    return idist.all_gather(ran).numpy().tolist()


# ---------------------------------------------------------------------- sync helpers
class _Mixed(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        tl.manual_seed(seed)
        self.a = nn.Linear(3, 5)
        self.b = nn.Linear(5, 2)
        self.c = nn.Parameter(tl.tensor(np.zeros(4, dtype=np.float64)))
        self.frozen = nn.Parameter(tl.ones(2))
        self.frozen.requires_grad = False


def sync_gradients_case(op: str, cap_mb: float) -> dict[str, Any]:
    """Every rank sets rank-dependent gradients (one parameter without any); returns the
    synced gradients and the number of all-reduces."""
    import collectives

    rank = idist.get_rank()
    model = _Mixed(0)
    params = list(model.parameters())
    for i, p in enumerate(params):
        if p is model.b.bias or not p.requires_grad:
            continue  # no gradient here: it takes part as zeros
        p.grad = tl.tensor(np.full(p.shape, (rank + 1) * (i + 1), dtype=p.data.dtype))
    before = collectives.get_default_group().seq if collectives.is_initialized() else 0
    n = ddp.sync_gradients(model, op=op, bucket_cap_mb=cap_mb)
    after = collectives.get_default_group().seq if collectives.is_initialized() else 0
    grads = {
        name: (None if p.grad is None else p.grad.numpy().tolist())
        for name, p in model.named_parameters()
    }
    factor = {name: i + 1 for i, (name, _) in enumerate(model.named_parameters())}
    return {"count": n, "issued": after - before, "grads": grads, "factor": factor}


def sync_parameters_case(src: int) -> dict[str, Any]:
    """Every rank starts from its own seed; afterwards all hold ``src``'s values."""
    model = _Mixed(100 + idist.get_rank())
    n = ddp.sync_parameters(model, src=src)
    want = _Mixed(100 + src)
    for (name, p), q in zip(model.named_parameters(), want.parameters(), strict=True):
        _eq(p.numpy(), q.numpy(), f"parameter {name} after sync_parameters(src={src})")
    return {"count": n}


# ---------------------------------------------------------------------- the seed's forms
def seed_order_cases() -> dict[str, Any]:
    """The seed's names and argument orders beside Ignite's: ``rank()``/``world_size()``,
    ``all_reduce(tensor, group, op)``, ``broadcast(tensor, src, group)``, ``barrier(group)``.
    Returns what the ranks outside a subgroup and inside it got."""
    ws, rank = idist.world_size(), idist.rank()
    _eq((ws, rank), (idist.get_world_size(), idist.get_rank()), "rank()/world_size()")
    everyone = list(range(ws))
    total, product = ws * (ws + 1) // 2, int(np.prod(range(1, ws + 1)))
    _eq(idist.all_reduce(rank + 1, None, "MAX"), ws, "seed order (tensor, None, op)")
    _eq(idist.all_reduce(rank + 1, everyone, "PRODUCT"), product, "seed (tensor, ranks, op)")
    _eq(idist.all_reduce(rank + 1, everyone), total, "seed (tensor, ranks)")
    _eq(idist.all_reduce(rank + 1, "MIN", everyone), 1, "Ignite's (tensor, op, ranks)")
    _eq(idist.all_reduce(rank + 1, group=everyone, op="MAX"), ws, "keywords")
    t = tl.tensor([float(rank)])
    _eq(idist.all_reduce(t, None, "MAX"), np.array([ws - 1.0], np.float32), "tensor, seed")
    got = idist.broadcast(tl.tensor([float(rank)]), ws - 1, everyone)
    _eq(got, np.array([ws - 1.0], np.float32), "seed broadcast(tensor, src, ranks)")
    got = idist.broadcast(f"r{rank}" if rank == ws - 1 else None, ws - 1, True)
    _eq(got, f"r{ws - 1}", "Ignite's broadcast(tensor, src, safe_mode)")
    idist.barrier(everyone)
    _raises(ValueError, "unsupported reduction operation", idist.all_reduce, 1, everyone, [0])
    out: dict[str, Any] = {}
    if ws > 1:
        tail = list(range(1, ws))  # every rank but 0
        g = idist.new_group(tail)
        out["max_by_group"] = idist.all_reduce(rank, g, "MAX")
        out["sum_by_list"] = idist.all_reduce(rank, tail)
        here = idist.broadcast(tl.tensor([float(rank)]), 1, g)
        out["from_1"] = here.numpy().tolist()
        mine = idist.broadcast("hello" if rank == 1 else None, 1, group=tail, safe_mode=True)
        out["safe_from_1"] = mine
        idist.barrier(g)
        idist.sync(tail)
        _raises(ValueError, "src=0 is not in the group's ranks", idist.broadcast, 1, 0, g)
    return out


def _await_file(path: Path, what: str) -> None:
    if not path.exists():
        raise AssertionError(f"{what}: rank {idist.rank()} went on before {path.name} existed")


def sync_waits_case(tmp: str, call: str) -> bool:
    """The last rank writes a file late, then every rank calls the synchronization ``call``;
    after it every rank finds the file (the call waited for the writer)."""
    import time

    ws, rank = idist.world_size(), idist.rank()
    path = Path(tmp) / f"{call}-{ws}-{idist.backend()}.txt"
    if rank == ws - 1:
        time.sleep(0.2)  # late on purpose: a call that does not wait would miss the file
        path.write_text("done")
    if call == "sync":
        idist.sync()
    elif call == "sync_group":
        idist.sync(list(range(ws)))
    elif call == "barrier_group":
        idist.barrier(list(range(ws)))
    _await_file(path, call)
    return True


def ignite_sync_is_local_case() -> int:
    """Ignite's ``sync(temporary)`` re-reads nothing and waits for nobody: rank 0 alone may
    call it, and the next collective still pairs up."""
    if idist.rank() == 0:
        idist.sync(True)
        idist.sync(temporary=False)
    _raises(ValueError, "not both", idist.sync, [0], temporary=True)
    return int(idist.all_reduce(1))


def one_rank_only_waits_case(tmp: str) -> bool:
    """``@one_rank_only()`` waits by default (the seed's default): after the call, the file
    the last rank wrote late is there on every rank."""
    import time

    ws = idist.world_size()
    path = Path(tmp) / f"ckpt-{ws}-{idist.backend()}.txt"

    @idist.one_rank_only(rank=ws - 1)
    def save() -> None:
        time.sleep(0.2)  # late on purpose: a call that does not wait would miss the file
        path.write_text("saved")

    save()
    _await_file(path, "one_rank_only()")
    return True


def loader_share_case(n: int, batch: int, shuffle: bool, drop_last: bool) -> dict[str, Any]:
    """``auto_dataloader(existing DataLoader)``: this rank's batches (sample ids), per step."""
    ws = idist.world_size()
    x = np.arange(n, dtype=np.int64)
    loader = ddp.DataLoader((x, x * 10), batch_size=batch, shuffle=shuffle, drop_last=drop_last)
    loader.set_epoch(2)
    mine = idist.auto_dataloader(loader)
    if ws == 1:
        if mine is not loader:
            raise AssertionError("at world size 1 the loader itself is its one rank's share")
    else:
        if not isinstance(mine.sampler, ddp.DistributedSampler):
            raise AssertionError(f"no DistributedSampler: {mine.sampler!r}")
        _eq(mine.sampler.num_replicas, ws, "sampler's num_replicas")
        _eq(mine.sampler.rank, idist.rank(), "sampler's rank")
        _eq(mine.sampler.shuffle, shuffle, "shuffle kept")
        _eq(mine.sampler.epoch, 2, "epoch kept")
    _eq(mine.batch_size, batch // ws, "per-rank batch of the loader's (global) batch")
    _eq(mine.drop_last, drop_last, "drop_last kept")
    batches = []
    for xb, yb in mine:
        _eq(yb.numpy(), xb.numpy() * 10, "the arrays stay paired")
        batches.append(xb.numpy().tolist())
    again = idist.auto_dataloader(loader, batch_size=2 * ws)  # keywords override the loader's
    _eq(again.batch_size, 2, "batch_size override")
    out: dict[str, Any] = {"batches": batches}
    if ws > 1:
        odd = ddp.DataLoader((x,), batch_size=ws + 1)
        try:
            idist.auto_dataloader(odd)
        except ValueError as exc:
            out["error"] = str(exc)
        sampled = ddp.DataLoader((x,), batch_size=ws, sampler=np.arange(n)[::-1].copy())
        _raises(ValueError, "already decides which samples", idist.auto_dataloader, sampled)
    return out


def sleeper(rank: int, path: str, seconds: float) -> None:
    """A spawned rank that writes ``path`` after ``seconds`` (``spawn(..., daemon=...)``)."""
    import time

    time.sleep(seconds)
    Path(path).write_text("done")
