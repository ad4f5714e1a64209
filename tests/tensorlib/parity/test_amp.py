"""Mixed precision against PyTorch: autocast's op dtypes and values, and GradScaler's steps.

Autocast: ``tl.autocast(dtype=tl.float16)`` follows torch's CUDA autocast lists. Where torch's
CPU lists agree (matmul, linear, cross_entropy, and every op on neither list) the case runs
torch under ``torch.autocast("cpu", dtype=torch.float16)``; where they differ (exp, log, pow,
sum, softmax, log_softmax, layer_norm: float32 on CUDA, the input's dtype on the CPU) it runs
torch on explicitly cast inputs, which is what CUDA autocast does.

GradScaler: the same 30-step runs in both libraries, with inf/NaN written into a gradient at
chosen steps: which steps ran, the scale and growth tracker after every update and the
parameters after every step must match torch's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tensorlib as tl
import tensorlib.functional as F

from .compare import DTYPES, TOLERANCES, assert_close, pair, to_numpy, torch

TF: Any = torch.nn.functional if torch is not None else None
F16 = np.dtype(np.float16)


def _close16(ours: Any, theirs: Any, what: str, grad: bool = False) -> None:
    """Same dtype as torch, values at float16's tolerance (whatever dtype they are held in)."""
    a, b = to_numpy(ours), to_numpy(theirs)
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype}, torch has {b.dtype}"
    rtol, atol, grtol, gatol = TOLERANCES[F16]
    np.testing.assert_allclose(
        a, b, rtol=grtol if grad else rtol, atol=gatol if grad else atol, err_msg=what
    )


def _torch_autocast() -> Any:
    return torch.autocast("cpu", dtype=torch.float16)


# ============================================================================ the lower list
LOWER = {
    "matmul": (lambda m, a, b, c: a @ b.T, lambda m, a, b, c: a @ b.T),
    "tl.matmul": (lambda m, a, b, c: tl.matmul(a, b.T), lambda m, a, b, c: torch.matmul(a, b.T)),
    "batched": (
        lambda m, a, b, c: a.reshape(2, 3, 6) @ b.T,
        lambda m, a, b, c: a.reshape(2, 3, 6) @ b.T,
    ),
    "linear": (lambda m, a, b, c: F.linear(a, b, c), lambda m, a, b, c: TF.linear(a, b, c)),
    "linear_nobias": (lambda m, a, b, c: F.linear(a, b), lambda m, a, b, c: TF.linear(a, b)),
}


@pytest.mark.parametrize("name", sorted(LOWER))
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_lower_ops_run_in_float16_like_torch(name: str, dtype: Any) -> None:
    """Matmul and linear compute in float16 (float32 inputs are cast); float32 leaves get
    float32 gradients, float16 leaves float16 ones."""
    rng = np.random.default_rng(1)
    a, ta = pair(rng.standard_normal((6, 6)) * 3, dtype)
    b, tb = pair(rng.standard_normal((5, 6)), dtype)
    c, tc = pair(rng.standard_normal(5), dtype)
    ours_fn, torch_fn = LOWER[name]
    with tl.autocast(dtype=tl.float16):
        out = ours_fn(tl, a, b, c)
    with _torch_autocast():
        ref = torch_fn(torch, ta, tb, tc)
    _close16(out, ref, f"{name} value")
    r = rng.standard_normal(tuple(ref.shape)).astype(np.float16)
    (out * tl.tensor(r)).sum().backward()
    (ref * torch.tensor(r)).sum().backward()
    for ours_leaf, torch_leaf, what in ((a, ta, "a"), (b, tb, "b"), (c, tc, "c")):
        if torch_leaf.grad is None:
            assert ours_leaf.grad is None, f"{name}: {what} got a gradient, torch's has none"
            continue
        _close16(ours_leaf.grad, torch_leaf.grad, f"{name} grad {what}", grad=True)


def test_float64_is_not_cast() -> None:
    """Autocast never touches float64 tensors, on either list."""
    rng = np.random.default_rng(2)
    a, ta = pair(rng.standard_normal((4, 3)), np.float64)
    with tl.autocast(dtype=tl.float16):
        outs = [a @ a.T, a.exp(), a.sum(), F.softmax(a)]
    with _torch_autocast():
        refs = [ta @ ta.T, ta.exp(), ta.sum(), torch.softmax(ta, -1)]
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        assert_close(o, r, f"float64 op {i}")


# ============================================================================ the float32 list
def _ln(lib: Any, x: Any, w: Any, b: Any) -> Any:
    if lib is tl:
        return F.layer_norm(x, (6,), w, b)
    return TF.layer_norm(x, (6,), w, b)


FLOAT32 = {
    "exp": lambda lib, x, w, b: x.exp(),
    "log": lambda lib, x, w, b: x.abs().log(),
    "pow": lambda lib, x, w, b: x**2,
    "pow_tensor": lambda lib, x, w, b: x.abs() ** w,
    "sum": lambda lib, x, w, b: x.sum(),
    "sum_axis": lambda lib, x, w, b: x.sum(axis=0) if lib is tl else x.sum(dim=0),
    "softmax": lambda lib, x, w, b: x.softmax(-1) if lib is tl else torch.softmax(x, -1),
    "log_softmax": lambda lib, x, w, b: x.log_softmax(-1) if lib is tl else TF.log_softmax(x, -1),
    "layer_norm": _ln,
}


@pytest.mark.parametrize("name", sorted(FLOAT32))
def test_float32_ops_match_torch_cuda_list(name: str) -> None:
    """float16 inputs of the float32-list ops are cast to float32 (torch's CUDA autocast; its
    CPU list keeps these in float16), so ours match torch on explicitly cast inputs exactly."""
    rng = np.random.default_rng(3)
    x, tx = pair(rng.standard_normal((4, 6)) * 2, np.float16)
    w, tw = pair(rng.standard_normal(6), np.float16)
    b, tb = pair(rng.standard_normal(6), np.float16)
    with tl.autocast(dtype=tl.float16):
        out = FLOAT32[name](tl, x, w, b)
    ref = FLOAT32[name](torch, tx.float(), tw.float(), tb.float())
    assert out.dtype == tl.float32, f"{name}: {out.dtype} under autocast, CUDA autocast: float32"
    assert_close(out, ref, f"{name} value")
    r = rng.standard_normal(tuple(ref.shape)).astype(np.float32)
    (out * tl.tensor(r)).sum().backward()
    (ref * torch.tensor(r)).sum().backward()
    for ours_leaf, torch_leaf, what in ((x, tx, "x"), (w, tw, "w"), (b, tb, "b")):
        if torch_leaf.grad is None:
            assert ours_leaf.grad is None, f"{name}: {what} got a gradient, torch's has none"
        else:
            assert_close(ours_leaf.grad, torch_leaf.grad, f"{name} grad {what}", grad=True)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cross_entropy_in_float32_like_torch(reduction: str, dtype: Any) -> None:
    """cross_entropy is on both of torch's float32 lists: float16 logits give a float32 loss."""
    rng = np.random.default_rng(4)
    logits, tlogits = pair(rng.standard_normal((5, 4)) * 4, dtype)
    target = np.array([0, 3, 1, 1, 2])
    with tl.autocast(dtype=tl.float16):
        loss = F.cross_entropy(logits, target, reduction=reduction)
    with _torch_autocast():
        ref = TF.cross_entropy(tlogits, torch.tensor(target), reduction=reduction)
    assert_close(loss, ref, "loss")
    r = rng.standard_normal(tuple(ref.shape)).astype(np.float32)
    (loss * tl.tensor(r)).sum().backward()
    (ref * torch.tensor(r)).sum().backward()
    assert_close(logits.grad, tlogits.grad, "grad", grad=True)


def test_mse_loss_sum_in_float32() -> None:
    """mse_loss(reduction="sum") ends in the float32 ``sum``, as torch's (float32-list)
    mse_loss returns float32."""
    rng = np.random.default_rng(5)
    a, ta = pair(rng.standard_normal((3, 4)), np.float16)
    t = rng.standard_normal((3, 4)).astype(np.float16)
    with tl.autocast(dtype=tl.float16):
        loss = F.mse_loss(a, tl.tensor(t), reduction="sum")
    with _torch_autocast():
        ref = TF.mse_loss(ta, torch.tensor(t), reduction="sum")
    _close16(loss, ref, "mse_loss sum")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_mse_loss_in_float32(reduction: str) -> None:
    rng = np.random.default_rng(5)
    a, ta = pair(rng.standard_normal((3, 4)), np.float16)
    t = rng.standard_normal((3, 4)).astype(np.float16)
    with tl.autocast(dtype=tl.float16):
        loss = F.mse_loss(a, tl.tensor(t), reduction=reduction)
    with _torch_autocast():
        ref = TF.mse_loss(ta, torch.tensor(t), reduction=reduction)
    _close16(loss, ref, f"mse_loss {reduction}")


# ============================================================================ neither list
OTHER = {
    "add_mixed": lambda lib, h, x: h + x,
    "mul_scalar": lambda lib, h, x: h * 3.0,
    "relu": lambda lib, h, x: h.relu(),
    "tanh": lambda lib, h, x: h.tanh(),
    "sqrt": lambda lib, h, x: (h * h).sqrt(),
    "mean": lambda lib, h, x: h.mean(),
    "max": lambda lib, h, x: h.max(),
    "var": lambda lib, h, x: h.var() if lib is tl else h.var(unbiased=False),
}


@pytest.mark.parametrize("name", sorted(OTHER))
def test_other_ops_keep_their_inputs_type(name: str) -> None:
    """Ops on neither list run in the type their inputs promote to."""
    rng = np.random.default_rng(6)
    h, th = pair(rng.standard_normal((3, 4)), np.float16)
    x, tx = pair(rng.standard_normal((3, 4)), np.float32)
    with tl.autocast(dtype=tl.float16):
        out = OTHER[name](tl, h, x)
    with _torch_autocast():
        ref = OTHER[name](torch, th, tx)
    _close16(out, ref, name)


# ============================================================================ a small MLP
def _mlp_params(rng: np.random.Generator) -> list[tuple[tl.Tensor, Any]]:
    shapes = [(16, 8), (16,), (4, 16), (4,)]
    return [pair(rng.standard_normal(s) * 0.5, np.float32) for s in shapes]


def _mlp(lib: Any, x: Any, p: list[Any]) -> Any:
    lin: Any = F.linear if lib is tl else TF.linear
    h = lin(x, p[0], p[1])
    h = h.relu() if lib is tl else torch.relu(h)
    return lin(h, p[2], p[3])


def test_mlp_forward_backward_under_autocast() -> None:
    """float32 parameters, float16 activations, a float32 loss and float32 gradients."""
    rng = np.random.default_rng(7)
    params = _mlp_params(rng)
    ours, theirs = [p[0] for p in params], [p[1] for p in params]
    x = rng.standard_normal((10, 8)).astype(np.float32)
    target = rng.integers(0, 4, 10)
    with tl.autocast(dtype=tl.float16):
        logits = _mlp(tl, tl.tensor(x), ours)
        loss = F.cross_entropy(logits, target)
    with _torch_autocast():
        tlogits = _mlp(torch, torch.tensor(x), theirs)
        tloss = TF.cross_entropy(tlogits, torch.tensor(target))
    _close16(logits, tlogits, "logits")
    assert loss.dtype == tl.float32
    _close16(loss, tloss, "loss")
    loss.backward()
    tloss.backward()
    for i, (o, t) in enumerate(zip(ours, theirs, strict=True)):
        _close16(o.grad, t.grad, f"grad[{i}]", grad=True)


# ============================================================================ GradScaler
def _regression(dtype: Any, seed: int) -> tuple[list[tl.Tensor], list[Any], np.ndarray, Any]:
    rng = np.random.default_rng(seed)
    params = [pair(rng.standard_normal(s) * 0.5, dtype) for s in [(6, 5), (6,), (1, 6), (1,)]]
    x = rng.standard_normal((30, 8, 5)).astype(dtype)
    return [p[0] for p in params], [p[1] for p in params], x, rng


def _loss(lib: Any, x: Any, p: list[Any]) -> Any:
    lin: Any = F.linear if lib is tl else TF.linear
    h = lin(x, p[0], p[1])
    h = h.tanh()
    y = lin(h, p[2], p[3])
    return ((y - 1.0) * (y - 1.0)).mean()


def _counting(opt: Any, log: list[int], step: list[int]) -> None:
    inner = opt.step

    def counted(*args: Any, **kwargs: Any) -> Any:
        log.append(step[0])
        return inner(*args, **kwargs)

    opt.step = counted


def _optimizers(kind: str, ours: list[tl.Tensor], theirs: list[Any]) -> tuple[Any, Any]:
    if kind == "sgd":
        return (
            tl.optim.SGD(ours, lr=0.05, momentum=0.9),
            torch.optim.SGD(theirs, lr=0.05, momentum=0.9),
        )
    return tl.optim.Adam(ours, lr=0.01), torch.optim.Adam(theirs, lr=0.01)


def _inject(grad: Any, value: float, lib: Any) -> None:
    if lib is tl:
        grad.data[0, 1] = value
    else:
        with torch.no_grad():
            grad[0, 1] = value


SCALER_CASES: dict[str, dict[str, Any]] = {
    # kwargs of both scalers, {step: value written into a gradient}
    "default": {"kwargs": {}, "bad": {3: np.inf, 4: np.inf, 11: np.inf}},
    "growth3": {"kwargs": {"growth_interval": 3}, "bad": {3: np.inf, 4: -np.inf, 11: np.nan}},
    "odd_factors": {
        "kwargs": {
            "init_scale": 1000.0,
            "growth_factor": 1.7,
            "backoff_factor": 0.3,
            "growth_interval": 2,
        },
        "bad": {5: np.nan, 6: np.inf, 20: np.inf},
    },
}


def _scaler_run(
    case: str,
    dtype: Any,
    kind: str,
    steps: int = 30,
    swap_at: int | None = None,
    explicit_unscale: bool = False,
) -> None:
    """Train both libraries side by side; compare after every step and every update."""
    spec = SCALER_CASES[case]
    ours, theirs, x, _ = _regression(dtype, seed=11)
    opt, topt = _optimizers(kind, ours, theirs)
    ran: list[int] = []
    tran: list[int] = []
    now = [0]
    _counting(opt, ran, now)
    _counting(topt, tran, now)
    scaler = tl.amp.GradScaler(**spec["kwargs"])
    tscaler = torch.amp.GradScaler("cpu", **spec["kwargs"])
    for step in range(steps):
        now[0] = step
        if step == swap_at:
            saved = scaler.state_dict()
            assert saved == tscaler.state_dict(), f"step {step}: state_dict differs"
            scaler = tl.amp.GradScaler()
            scaler.load_state_dict(saved)
        opt.zero_grad()
        topt.zero_grad()
        scaler.scale(_loss(tl, tl.tensor(x[step]), ours)).backward()
        tscaler.scale(_loss(torch, torch.tensor(x[step]), theirs)).backward()
        if step in spec["bad"]:
            _inject(ours[2].grad, spec["bad"][step], tl)
            _inject(theirs[2].grad, spec["bad"][step], torch)
        if explicit_unscale:
            scaler.unscale_(opt)
            tscaler.unscale_(topt)
            for i, (o, t) in enumerate(zip(ours, theirs, strict=True)):
                if step not in spec["bad"]:
                    assert_close(o.grad, t.grad, f"step {step} unscaled grad[{i}]", grad=True)
        out = scaler.step(opt)
        tout = tscaler.step(topt)
        assert (out is None) == (tout is None), f"step {step}: step() returned {out}, {tout}"
        scaler.update()
        tscaler.update()
        assert scaler.get_scale() == tscaler.get_scale(), f"step {step}: scale"
        assert scaler.state_dict() == tscaler.state_dict(), f"step {step}: state_dict"
        for i, (o, t) in enumerate(zip(ours, theirs, strict=True)):
            assert_close(o, t, f"step {step} param[{i}]")
    assert ran == tran, f"steps taken: {ran}, torch: {tran}"
    assert sorted(set(range(steps)) - set(ran)) == sorted(spec["bad"]), "skipped steps"


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("case", sorted(SCALER_CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_scaler_skips_exactly_like_torch(case: str, dtype: Any, kind: str) -> None:
    """Injected inf/NaN gradients skip exactly those steps; scale, growth tracker and
    parameters follow torch's after every step."""
    _scaler_run(case, dtype, kind)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_scaler_explicit_unscale_matches_torch(dtype: Any) -> None:
    """unscale_ before step leaves the same unscaled gradients as torch's."""
    _scaler_run("growth3", dtype, "sgd", steps=12, explicit_unscale=True)


@pytest.mark.parametrize("swap_at", [4, 15])
@pytest.mark.parametrize("case", ["growth3", "odd_factors"])
def test_grad_scaler_state_dict_round_trip_mid_run(case: str, swap_at: int) -> None:
    """A scaler rebuilt from state_dict() mid-run (right after a skipped step or mid growth
    interval) continues exactly as torch's uninterrupted one."""
    _scaler_run(case, np.float64, "sgd", swap_at=swap_at)


@pytest.mark.parametrize(
    "make",
    [
        lambda lib: lib.amp.GradScaler("cpu", growth_factor=1.0),
        lambda lib: lib.amp.GradScaler("cpu", backoff_factor=1.0),
    ],
)
def test_grad_scaler_bad_factors_raise_like_torch(make: Callable[[Any], Any]) -> None:
    """torch raises (an AssertionError) for factors on the wrong side of 1; we raise too."""
    with pytest.raises(AssertionError):
        make(torch)
    with pytest.raises(ValueError, match="factor must be"):
        make(tl)


def test_grad_scaler_errors_like_torch() -> None:
    """unscale_ twice, step twice, unscale_ after step: the same RuntimeErrors as torch."""
    ours, theirs, x, _ = _regression(np.float32, seed=12)
    opt, topt = _optimizers("sgd", ours, theirs)
    for lib, o, params, sc in (
        (tl, opt, ours, tl.amp.GradScaler()),
        (torch, topt, theirs, torch.amp.GradScaler("cpu")),
    ):
        sc.scale(_loss(lib, (tl.tensor if lib is tl else torch.tensor)(x[0]), params)).backward()
        sc.unscale_(o)
        with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
            sc.unscale_(o)
        sc.step(o)
        with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
            sc.step(o)
        with pytest.raises(RuntimeError, match="unscale_\\(\\) is being called after step"):
            sc.unscale_(o)
        sc.update()
        assert sc.get_scale() == 2.0**16


# NumPy warns where float16 overflows on purpose (the engine's float32 -> float16 gradient
# cast; inf * 0 in relu's backward); torch is silent.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_autocast_with_scaler_overflows_and_recovers_like_torch() -> None:
    """float32 parameters, float16 activations and a scale too large for float16: the scaled
    gradients overflow in float16 for the first steps (skipped, scale backed off) in both
    libraries alike, then training proceeds with matching parameters."""
    rng = np.random.default_rng(13)
    params = _mlp_params(rng)
    ours, theirs = [p[0] for p in params], [p[1] for p in params]
    opt = tl.optim.SGD(ours, lr=0.1)
    topt = torch.optim.SGD(theirs, lr=0.1)
    scaler = tl.amp.GradScaler(init_scale=2.0**30, growth_interval=2)
    tscaler = torch.amp.GradScaler("cpu", init_scale=2.0**30, growth_interval=2)
    scales, skipped = [], 0
    for step in range(12):
        x = rng.standard_normal((10, 8)).astype(np.float32)
        target = rng.integers(0, 4, 10)
        opt.zero_grad()
        topt.zero_grad()
        with tl.autocast(dtype=tl.float16):
            loss = F.cross_entropy(_mlp(tl, tl.tensor(x), ours), target)
        with _torch_autocast():
            tloss = TF.cross_entropy(_mlp(torch, torch.tensor(x), theirs), torch.tensor(target))
        scaler.scale(loss).backward()
        tscaler.scale(tloss).backward()
        out, tout = scaler.step(opt), tscaler.step(topt)
        assert (out is None) == (tout is None), f"step {step}"
        scaler.update()
        tscaler.update()
        assert scaler.get_scale() == tscaler.get_scale(), f"step {step}: scale"
        scales.append(scaler.get_scale())
        skipped += scales[-1] < (scales[-2] if len(scales) > 1 else 2.0**30)
        for i, (o, t) in enumerate(zip(ours, theirs, strict=True)):
            _close16(o, t, f"step {step} param[{i}]")
    assert skipped >= 3, f"the scale never overflowed float16: scales {scales}"
