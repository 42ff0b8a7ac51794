"""Custom losses uploaded by the SDK's `ServiceClient.create_custom_loss` (`client/config` says
`custom_loss_server_side: true`).

The SDK traces a per-datum loss with torch.fx and uploads its graph once per session
(`/create_custom_loss`); the server checks it against the interpreter's allow-list
(`meshrl.losses.fx_graph`: a refused or malformed graph fails its creation with a `user` error) and
keeps it under a loss id, ``{session}:loss:{n}``. `forward_backward_custom` with the returned handle
then sends `forward_backward(data, 'custom', {'loss_id'})`, which the learner runs as the
registered loss `custom` with the graph as its config. A loss serves the clients of the session
that created it, and is forgotten when that session finishes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tinker import types as sdk

from meshrl.api.errors import UserError
from meshrl.api.losses import custom_loss
from meshrl.config.serve import ServeLimits
from meshrl.losses.fx_graph import GraphError, compile_graph
from meshrl.serve import limits
from meshrl.types import Datum


@dataclass(frozen=True)
class UploadedLoss:
    session_id: str
    config: dict
    """The `custom` loss's config: the graph's ``name``, ``inputs`` and ``nodes``."""


class CustomLosses:
    """The uploaded custom losses of every open session, by loss id."""

    def __init__(self, bounds: ServeLimits) -> None:
        self._losses: dict[str, UploadedLoss] = {}
        self._limits = bounds

    def create(self, req: sdk.CreateCustomLossRequest) -> str:
        """Check and keep an uploaded loss; its loss id (the same for a retried request).
        UserError naming what the graph does that is not allowed."""
        limits.at_most("create_custom_loss: graph nodes", len(req.graph.nodes), self._limits.max_custom_loss_nodes,
                       "max_custom_loss_nodes")
        config = {"name": req.name, "inputs": [[i.name, i.rank] for i in req.inputs],
                  "nodes": [node.model_dump() for node in req.graph.nodes]}
        custom_loss(config)
        loss_id = f"{req.session_id}:loss:{req.custom_loss_seq_id}"
        self._losses[loss_id] = UploadedLoss(req.session_id, config)
        return loss_id

    def config(self, session_id: str, loss_fn_config: dict | None, data: list[Datum]) -> dict:
        """The graph that a `loss_fn='custom'` request of a model of ``session_id`` names by its
        ``loss_id``; UserError for an unknown loss or another session's, or one that would build
        a tensor larger than ``serve.limits.max_custom_loss_elements`` on any of ``data``."""
        loss_id = (loss_fn_config or {}).get("loss_id")
        if not isinstance(loss_id, str) or set(loss_fn_config or {}) != {"loss_id"}:
            raise UserError("forward_backward: loss_fn 'custom' takes loss_fn_config {'loss_id': ...} from "
                            "ServiceClient.create_custom_loss (pass its handle to forward_backward_custom)")
        loss = self._losses.get(loss_id)
        if loss is None:
            raise UserError(f"forward_backward: unknown custom loss {loss_id!r} (create it with "
                            "ServiceClient.create_custom_loss in this session)")
        if loss.session_id != session_id:
            raise UserError(f"forward_backward: custom loss {loss_id!r} belongs to another session; create it in "
                            "this one")
        self._size(loss.config, data)
        return loss.config

    def _size(self, config: dict, data: list[Datum]) -> None:
        """OverLimit if the loss builds a tensor over the limit on any datum (sized from the
        datums' shapes alone); a datum missing one of its inputs is left to the loss's own check."""
        graph = compile_graph(config["name"], config["inputs"], config["nodes"])
        for i, datum in enumerate(data):
            if not all(name in datum.loss_fn_inputs for name in graph.input_names):
                continue
            logprobs = torch.empty(datum.model_input.length, device="meta")
            try:
                largest = graph.largest_tensor(logprobs, *(datum.loss_fn_inputs[n] for n in graph.input_names))
            except GraphError as e:
                raise UserError(f"forward_backward: data[{i}]: {e}") from None
            limits.at_most(f"forward_backward: data[{i}]: the largest tensor custom loss {config['name']!r} builds "
                           "(elements)", largest, self._limits.max_custom_loss_elements, "max_custom_loss_elements")

    def close_session(self, session_id: str) -> None:
        for loss_id in [k for k, loss in self._losses.items() if loss.session_id == session_id]:
            del self._losses[loss_id]
