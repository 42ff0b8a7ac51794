"""Tinker's client API over meshrl's meshes, in process: `ServiceClient` ->
`create_lora_training_client` -> `TrainingClient` (`forward_backward`, `forward`,
`forward_backward_custom`, `optim_step`, `save_state`, `load_state`,
`save_weights_and_get_sampling_client`) -> `SamplingClient` (`sample`, `compute_logprobs`).
`meshrl serve` puts the same service behind the official `tinker` SDK's wire protocol."""

from meshrl.api.clients import SamplingClient, ServiceClient, TrainingClient
from meshrl.api.errors import UserError
from meshrl.api.types import (AdamParams, Datum, EncodedTextChunk, ForwardBackwardOutput, ModelInput, SampledSequence,
                              SampleResponse, SamplingParams, SupportedModel)
from meshrl.types import DimuonParams

__all__ = ["AdamParams", "Datum", "DimuonParams", "EncodedTextChunk", "ForwardBackwardOutput", "ModelInput", "SampleResponse",
           "SampledSequence", "SamplingClient", "SamplingParams", "ServiceClient", "SupportedModel", "TrainingClient",
           "UserError", "connect", "local_service"]


def local_service(cfg) -> ServiceClient:
    """The backend of `meshrl serve` (`serve.backend`): a ServiceClient on this machine's meshes."""
    return ServiceClient(cfg)


def connect(base_url: str, api_key: str = "tml-local"):
    """A client attached to a running `meshrl serve` at ``base_url``: the official `tinker` SDK's
    ServiceClient (same method names as `ServiceClient`, the SDK's types; needs the `serve` extra)."""
    try:
        import tinker
    except ImportError:
        raise ImportError("meshrl.api.connect needs the tinker SDK: pip install -e '.[serve]'") from None
    return tinker.ServiceClient(base_url=base_url, api_key=api_key)
