"""DiLoCo's outer loop as pure functions on tensors: pseudo-gradients, their deterministic
average, the Nesterov outer step, and a hash that proves replicas hold identical weights."""

from __future__ import annotations

import hashlib

import torch

Tensors = dict[str, torch.Tensor]


def pseudo_gradient(round_start: Tensors, now: Tensors) -> Tensors:
    """delta = theta_at_round_start - theta_now (float32), per parameter."""
    missing = set(round_start) ^ set(now)
    if missing:
        raise KeyError(f"parameters differ between round start and now: {sorted(missing)[:3]}")
    return {k: round_start[k].float() - now[k].detach().float() for k in round_start}


def average(deltas: dict[int, Tensors]) -> Tensors:
    """The mean of the replicas' deltas, summed in float32 in replica-id order so that every replica
    that averages the same set gets bit-identical results."""
    if not deltas:
        raise ValueError("no deltas to average")
    ids = sorted(deltas)
    names = list(deltas[ids[0]])
    for i in ids[1:]:
        if set(deltas[i]) != set(names):
            raise KeyError(f"replica {i}'s delta names differ from replica {ids[0]}'s")
    out = {}
    for name in names:
        acc = deltas[ids[0]][name].float().clone()
        for i in ids[1:]:
            acc.add_(deltas[i][name].float())
        out[name] = acc.div_(len(ids))
    return out


class OuterOptimizer:
    """SGD with (Nesterov) momentum on the averaged pseudo-gradient, applied to the round-start
    weights, exactly torch.optim.SGD's update: buf = mu * buf + g (buf = g on the first step);
    step = g + mu * buf with Nesterov, buf without; theta = theta - lr * step."""

    def __init__(self, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True):
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.buffers: Tensors = {}

    @torch.no_grad()
    def step(self, params: Tensors, grad: Tensors) -> Tensors:
        """New float32 weights from ``params`` (the round-start weights) and ``grad`` (the averaged
        delta); updates the momentum buffers."""
        out = {}
        for name, p in params.items():
            g = grad[name].float()
            if self.momentum:
                buf = self.buffers.get(name)
                buf = g.clone() if buf is None else buf.mul_(self.momentum).add_(g)
                self.buffers[name] = buf
                g = g.add(buf, alpha=self.momentum) if self.nesterov else buf
            out[name] = p.float() - self.lr * g
        return out

    def state_dict(self) -> Tensors:
        """The momentum buffers by parameter name (empty before the first step)."""
        return dict(self.buffers)

    def load_state_dict(self, state: Tensors) -> None:
        self.buffers = {k: v.float().clone() for k, v in state.items()}


def weights_hash(tensors: Tensors) -> str:
    """sha256 over the names, dtypes, shapes and bytes of ``tensors`` (sorted by name)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]
