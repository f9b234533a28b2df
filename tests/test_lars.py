"""LARS against a reference written out from the paper's Algorithm 1 (You, Gitman, Ginsburg 2017), in plain
Python arithmetic on lists: trust ratios, zero norms, excluded (bias/norm) parameters, momentum, checks."""

from __future__ import annotations

import copy
import math
import sys
from typing import Any

import pytest
import torch

from lightning_shardplus.large_batch.lars import LARS


def _reference_step(
    weights: list[float],
    grad: list[float],
    buffer: list[float],
    lr: float,
    momentum: float,
    weight_decay: float,
    eta: float,
    eps: float,
    excluded: bool,
) -> tuple[list[float], list[float]]:
    """One step for one layer: local_lr = eta * ||w|| / (||g|| + wd * ||w|| + eps) (1 if a norm is zero),
    v = m * v + lr * local_lr * (g + wd * w), w = w - v. Excluded layers: local_lr = 1 and wd = 0."""
    if excluded:
        local_lr, decay = 1.0, 0.0
    else:
        w_norm = math.sqrt(sum(x * x for x in weights))
        g_norm = math.sqrt(sum(x * x for x in grad))
        decay = weight_decay
        local_lr = eta * w_norm / (g_norm + decay * w_norm + eps) if w_norm > 0 and g_norm > 0 else 1.0
    new_buffer = [
        momentum * v + lr * local_lr * (g + decay * w) for v, g, w in zip(buffer, grad, weights, strict=True)
    ]
    return [w - v for w, v in zip(weights, new_buffer, strict=True)], new_buffer


def _layers() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "weight": torch.randn(3, 4, generator=generator, dtype=torch.float64),
        "zero_weight": torch.zeros(2, 3, dtype=torch.float64),  # ||w|| = 0: trust ratio 1
        "no_grad_signal": torch.randn(
            2, 2, generator=generator, dtype=torch.float64
        ),  # ||g|| = 0: trust ratio 1
        "bias": torch.randn(3, generator=generator, dtype=torch.float64),
        "norm_weight": 1 + 0.1 * torch.randn(4, generator=generator, dtype=torch.float64),
    }


def _grads(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    grads = {
        name: torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
        for name, tensor in _layers().items()
    }
    grads["no_grad_signal"] = torch.zeros(2, 2, dtype=torch.float64)
    return grads


def _run(
    lrs: list[float],
    momentum: float,
    weight_decay: float,
    eta: float,
    eps: float,
    exclude_bias_and_norm: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, list[float]]]:
    """The optimizer and the reference side by side, one step per entry of ``lrs`` (the global rate)."""
    params = {name: torch.nn.Parameter(tensor.clone()) for name, tensor in _layers().items()}
    optimizer = LARS(
        list(params.values()),
        lr=lrs[0],
        momentum=momentum,
        weight_decay=weight_decay,
        trust_coefficient=eta,
        eps=eps,
        exclude_bias_and_norm=exclude_bias_and_norm,
    )
    reference = {name: tensor.flatten().tolist() for name, tensor in _layers().items()}
    buffers = {name: [0.0] * len(values) for name, values in reference.items()}
    for step, lr in enumerate(lrs):
        grads = _grads(step)
        for name, param in params.items():
            param.grad = grads[name].clone()
        optimizer.param_groups[0]["lr"] = lr
        optimizer.step()
        for name, values in reference.items():
            excluded = exclude_bias_and_norm and name in ("bias", "norm_weight")
            reference[name], buffers[name] = _reference_step(
                values,
                grads[name].flatten().tolist(),
                buffers[name],
                lr,
                momentum,
                weight_decay,
                eta,
                eps,
                excluded,
            )
    return {name: param.detach() for name, param in params.items()}, reference


def _assert_matches(got: dict[str, torch.Tensor], want: dict[str, list[float]]) -> None:
    for name, values in want.items():
        assert got[name].flatten().tolist() == pytest.approx(values, rel=1e-12, abs=1e-15), name


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_one_step_equals_the_paper_formula(weight_decay: float) -> None:
    got, want = _run([0.5], momentum=0.9, weight_decay=weight_decay, eta=0.02, eps=1e-9)
    _assert_matches(got, want)
    # The cases are real: an adapted layer moved far less than lr * g, zero-norm layers by lr * (g + wd w).
    start, grad = _layers(), _grads(0)
    moved = (start["weight"] - got["weight"]).norm() / (0.5 * grad["weight"].norm())
    assert moved < 0.1
    assert torch.allclose(start["zero_weight"] - got["zero_weight"], 0.5 * grad["zero_weight"])
    assert torch.allclose(
        start["no_grad_signal"] - got["no_grad_signal"], 0.5 * weight_decay * start["no_grad_signal"]
    )


def test_several_steps_with_momentum_and_a_changing_rate() -> None:
    got, want = _run([0.5, 0.25, 1.0, 0.75], momentum=0.9, weight_decay=5e-4, eta=0.001, eps=1e-8)
    _assert_matches(got, want)


def test_without_momentum() -> None:
    got, want = _run([0.3, 0.3], momentum=0.0, weight_decay=1e-3, eta=0.01, eps=0.0)
    _assert_matches(got, want)


def test_bias_and_norm_can_be_adapted_too() -> None:
    got, want = _run(
        [0.5, 0.5], momentum=0.9, weight_decay=0.01, eta=0.02, eps=1e-9, exclude_bias_and_norm=False
    )
    _assert_matches(got, want)


def test_excluded_parameters_get_plain_sgd_with_momentum() -> None:
    """At a constant rate, biases and norm weights move exactly as under torch's SGD with momentum and no
    weight decay, whatever LARS's weight decay and trust coefficient (same gradients fed to both)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2)).double()
    twin = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2)).double()
    twin.load_state_dict(model.state_dict())
    lars = LARS(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.05, trust_coefficient=0.001)
    sgd = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        for param, other in zip(model.parameters(), twin.parameters(), strict=True):
            param.grad = torch.randn_like(param)
            other.grad = param.grad.clone()
        lars.step()
        sgd.step()
    for (name, got), want in zip(model.named_parameters(), twin.parameters(), strict=True):
        if got.ndim <= 1:
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14, msg=name)
        else:
            assert not torch.allclose(got, want), name  # matrices are adapted: they differ from SGD


def test_state_dict_round_trip_continues_identically() -> None:
    params = [torch.nn.Parameter(t.clone()) for t in _layers().values()]
    twin = [torch.nn.Parameter(t.clone()) for t in _layers().values()]
    first = LARS(params, lr=0.5, weight_decay=1e-3)
    for param, grad in zip(params, _grads(0).values(), strict=True):
        param.grad = grad.clone()
    first.step()
    for source, target in zip(params, twin, strict=True):
        target.data.copy_(source.data)
    second = LARS(twin, lr=0.1)
    second.load_state_dict(copy.deepcopy(first.state_dict()))  # torch's state_dict shares the buffers
    assert second.param_groups[0]["lr"] == 0.5 and second.param_groups[0]["weight_decay"] == 1e-3
    for optimizer, group in ((first, params), (second, twin)):
        for param, grad in zip(group, _grads(1).values(), strict=True):
            param.grad = grad.clone()
        optimizer.step()
    for a, b in zip(params, twin, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_closure_and_missing_grads() -> None:
    weight = torch.nn.Parameter(torch.ones(2, 2))
    unused = torch.nn.Parameter(torch.ones(3, 3))
    optimizer = LARS([weight, unused], lr=1.0, momentum=0.0)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = (weight * 2).sum()
        loss.backward()
        return loss

    assert optimizer.step(closure).item() == 8.0
    # ||w|| = 2, ||g|| = 4: local lr = 0.001 * 2 / 4; the unused parameter is left alone.
    torch.testing.assert_close(weight.detach(), torch.full((2, 2), 1 - 2 * 0.0005))
    torch.testing.assert_close(unused.detach(), torch.ones(3, 3))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lr": -0.1}, ValueError, r"`lr`=-0.1 is not valid: expected a number with 0.0 <= lr"),
        (
            {"momentum": 1.0},
            ValueError,
            r"`momentum`=1.0 is not valid: expected a number with 0.0 <= momentum < 1.0",
        ),
        ({"momentum": -0.5}, ValueError, r"`momentum`=-0.5 is not valid"),
        ({"weight_decay": -1e-4}, ValueError, r"`weight_decay`=-0.0001 is not valid"),
        (
            {"trust_coefficient": 0.0},
            ValueError,
            r"`trust_coefficient`=0.0 is not valid: expected a finite number > 0",
        ),
        ({"trust_coefficient": -0.001}, ValueError, r"`trust_coefficient`=-0.001 is not valid"),
        ({"eps": -1e-8}, ValueError, r"`eps`=-1e-08 is not valid"),
        ({"lr": float("nan")}, ValueError, r"`lr`=nan is not valid"),
        ({"lr": "0.1"}, TypeError, r"`lr`='0.1' is not valid"),
        (
            {"exclude_bias_and_norm": 1},
            TypeError,
            r"`exclude_bias_and_norm`=1 is not valid: expected True or False",
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        LARS([torch.nn.Parameter(torch.ones(2))], **kwargs)


def test_bad_parameter_group_option_raises() -> None:
    optimizer = LARS([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match=r"`trust_coefficient`=0 is not valid"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "trust_coefficient": 0})


def test_sparse_gradients_are_refused() -> None:
    param = torch.nn.Parameter(torch.ones(3, 2))
    param.grad = torch.ones(3, 2).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        LARS([param]).step()


def test_usable_from_lightning_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_shardplus.cli import ShardPlusCLI

    monkeypatch.setattr(sys, "argv", ["shardplus"])
    cli = ShardPlusCLI(
        args=[
            "--model=lightning_shardplus.demo.ClassifierModule",
            "--data=lightning_shardplus.SyntheticDataModule",
            "--optimizer=lightning_shardplus.LARS",
            "--optimizer.lr=3.0",
            "--optimizer.weight_decay=0.0005",
            "--optimizer.trust_coefficient=0.02",
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            "--trainer.strategy=auto",
            "--trainer.logger=false",
        ],
        run=False,
    )
    optimizer = cli.model.configure_optimizers()
    assert isinstance(optimizer, LARS)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["trust_coefficient"]) == (3.0, 0.0005, 0.02)
    assert group["momentum"] == 0.9 and group["exclude_bias_and_norm"] is True
