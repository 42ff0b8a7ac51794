"""Tinker's client API over meshrl's meshes, in process: `ServiceClient` ->
`create_lora_training_client` -> `TrainingClient` (`forward_backward`, `forward`,
`forward_backward_custom`, `optim_step`, `save_state`, `load_state`,
`save_weights_and_get_sampling_client`) -> `SamplingClient` (`sample`, `compute_logprobs`).
`meshrl serve` puts the same service behind the official `tinker` SDK's wire protocol."""

from meshrl.api.clients import SamplingClient, ServiceClient, TrainingClient
from meshrl.api.errors import UserError
from meshrl.api.types import (AdamParams, Datum, EncodedTextChunk, ForwardBackwardOutput, ModelInput, SampledSequence,
                              SampleResponse, SamplingParams, SupportedModel)

__all__ = ["AdamParams", "Datum", "EncodedTextChunk", "ForwardBackwardOutput", "ModelInput", "SampleResponse",
           "SampledSequence", "SamplingClient", "SamplingParams", "ServiceClient", "SupportedModel", "TrainingClient",
           "UserError", "local_service"]


def local_service(cfg) -> ServiceClient:
    """The backend of `meshrl serve` (`serve.backend`): a ServiceClient on this machine's meshes."""
    return ServiceClient(cfg)
