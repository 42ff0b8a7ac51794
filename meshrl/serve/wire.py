"""Conversions between the Tinker wire format and meshrl's types.

Requests: the protobuf `ForwardBackwardRequest` (optionally zstd-compressed) becomes a list of
`meshrl.types.Datum` — tokens from int32 bytes, loss inputs from dense or sparse-CSR tensors of the
declared dtype and shape — and the SDK's JSON `ModelInput` / `SamplingParams` become meshrl's.
Results: `ForwardBackwardOutput` and `SampleResponse` are encoded with the SDK's own generated
protobuf module, the only form the SDK accepts for them.

Anything malformed in a request raises `UserError` with a one-line message naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pydantic
import torch
from google.protobuf.message import DecodeError
from tinker import types as sdk
from tinker.proto import tinker_public_pb2 as pb

from meshrl.api.errors import UserError
from meshrl.api.types import ForwardBackwardOutput, SampleResponse, SamplingParams
from meshrl.config.serve import ServeLimits
from meshrl.serve import limits
from meshrl.training.optimizers import ADAMW, DIMUON, OPTIMIZERS
from meshrl.types import AdamParams, Datum, DimuonParams, EncodedTextChunk, ModelInput

_NUMPY_DTYPES = {
    pb.DTYPE_FLOAT32: np.dtype(np.float32),
    pb.DTYPE_INT64: np.dtype(np.int64),
    pb.DTYPE_INT32: np.dtype(np.int32),
    pb.DTYPE_BFLOAT16: np.dtype(np.uint16),
}
_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


_MODEL_ID_TAG = 0x0A  # field 1 (model_id), length-delimited: what the SDK's serialiser writes first
_MAX_MODEL_ID_BYTES = 1024
_PEEK_BYTES = _MAX_MODEL_ID_BYTES + 8


def leading_model_id(body: bytes, content_encoding: str | None) -> str:
    """The ``model_id`` of a `/forward_backward` body, read from its first bytes only (at most
    ``_PEEK_BYTES`` inflated, whatever the body's size), so that ownership is checked before the
    body is inflated and parsed. The SDK serialises fields in order, so model_id (field 1) comes
    first; a body that does not start with it is refused (UserError)."""
    if content_encoding == "zstd":
        try:
            with limits.zstd_reader(body) as reader:
                head = b""
                while len(head) < _PEEK_BYTES and (chunk := reader.read(_PEEK_BYTES - len(head))):
                    head += chunk
        except limits.ZstdError as exc:
            raise UserError(f"forward_backward body: not valid zstd ({exc})") from None
    elif content_encoding in (None, "", "identity"):
        head = body[:_PEEK_BYTES]
    else:
        raise UserError(f"forward_backward body: unsupported Content-Encoding {content_encoding!r}")
    size, pos = 0, 1
    if head[:1] == bytes([_MODEL_ID_TAG]):
        for shift in (0, 7):  # the length: a varint of at most 2 bytes (model ids of at most 1024 bytes)
            byte = head[pos] if pos < len(head) else 0x80
            pos += 1
            size |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
        else:
            size = 0
    model_id = head[pos:pos + size]
    if 0 < size <= _MAX_MODEL_ID_BYTES and len(model_id) == size:
        try:
            return model_id.decode("utf-8")
        except UnicodeDecodeError:
            pass
    raise UserError("forward_backward body: must start with model_id (protobuf field 1, 1 to "
                    f"{_MAX_MODEL_ID_BYTES} bytes of UTF-8, as the tinker SDK writes it)")


def forward_backward_request(body: bytes, content_encoding: str | None,
                             max_decompressed_bytes: int) -> pb.ForwardBackwardRequest:
    """Parse a `/forward_backward` body (protobuf, zstd-compressed when the header says so, inflated
    no further than ``max_decompressed_bytes``). Its tensors stay bytes until `datums` decodes them,
    after the request's ownership is checked."""
    if content_encoding == "zstd":
        body = limits.inflate(body, max_decompressed_bytes, "forward_backward body")
    elif content_encoding not in (None, "", "identity"):
        raise UserError(f"forward_backward body: unsupported Content-Encoding {content_encoding!r}")
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise UserError(f"forward_backward body: not a ForwardBackwardRequest protobuf ({exc})") from None
    if not msg.model_id:
        raise UserError("forward_backward: model_id is missing")
    return msg


def optimizer_type(where: str, config: sdk.OptimizerConfig | None) -> str:
    """The optimizer an `OptimizerConfig` selects (None: AdamW, the SDK's default); UserError for
    one this server does not train with."""
    if config is None:
        return ADAMW
    fields = config.model_dump()
    if config.type not in OPTIMIZERS or (config.type == DIMUON and fields.get("version", 1) != 1):
        raise UserError(f"{where}: optimizer_config {fields} is not served; use AdamOptimizerConfig (AdamW, the "
                        "default) or DimuonOptimizerConfig (version 1)")
    return config.type


def optim_params(params: sdk.OptimParams) -> AdamParams | DimuonParams:
    """An `optim_step`'s hyperparameters as meshrl's (a nonpositive Dimuon clip norm: no clipping);
    UserError naming a bad or unknown one (every value must be finite)."""
    for name, value in params.model_dump().items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"optim_step: {getattr(params, 'type', 'adam')}_params.{name} = {value}: must be finite")
    try:
        if isinstance(params, sdk.AdamParams):
            return AdamParams(learning_rate=params.learning_rate, beta1=params.beta1, beta2=params.beta2,
                              eps=params.eps, weight_decay=params.weight_decay, grad_clip_norm=params.grad_clip_norm)
        if params.type == DIMUON:
            dimuon = sdk.DimuonParams.model_validate(params.model_dump())
            return DimuonParams(learning_rate=dimuon.learning_rate, beta1=dimuon.beta1,
                                grad_clip_norm=max(dimuon.grad_clip_norm, 0.0))
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise UserError(f"optim_step: {params.type}_params.{where}: {first['msg']}") from None
    except ValueError as exc:
        raise UserError(f"optim_step: {getattr(params, 'type', 'adam')}_params: {exc}") from None
    raise UserError(f"optim_step: optimizer {params.type!r} is not served; pass AdamParams (AdamW) or DimuonParams "
                    "(Dimuon), the optimizer the training client was created with")


def loss_fn_config(msg: pb.ForwardBackwardRequest) -> dict[str, float | str] | None:
    """The loss's keyword arguments (`loss_fn_config_v2`, else the legacy float-only map)."""
    if msg.loss_fn_config_v2:
        return {key: (value.text if value.WhichOneof("value") == "text" else value.number)
                for key, value in msg.loss_fn_config_v2.items()}
    if msg.loss_fn_config:
        return dict(msg.loss_fn_config)
    return None


def datums(msg: pb.ForwardBackwardRequest, bounds: ServeLimits) -> list[Datum]:
    """The request's training examples as meshrl Datums, every size within ``bounds`` (checked
    on the bytes sent, before any tensor is built)."""
    if not msg.data:
        raise UserError("forward_backward: data is empty")
    limits.at_most("forward_backward: number of datums", len(msg.data), bounds.max_datums_per_request,
                   "max_datums_per_request")
    total = 0
    for i, datum in enumerate(msg.data):
        count = sum(len(chunk.encoded_text.tokens) // 4 for chunk in datum.model_input)
        limits.at_most(f"data[{i}]: tokens", count, bounds.max_tokens_per_datum, "max_tokens_per_datum")
        total += count
    limits.at_most("forward_backward: tokens over all datums", total, bounds.max_tokens_per_request,
                   "max_tokens_per_request")
    out = []
    for i, datum in enumerate(msg.data):
        where = f"data[{i}]"
        tokens: list[int] = []
        for j, chunk in enumerate(datum.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise UserError(f"{where}.model_input[{j}]: a {kind} chunk; only encoded_text is supported")
            ids = _array(chunk.encoded_text.tokens, np.dtype(np.int32), f"{where}.model_input[{j}].tokens")
            tokens.extend(ids.tolist())
        inputs = {name: _tensor(tensor, f"{where}.loss_fn_inputs[{name!r}]", len(tokens), bounds.max_tensor_elements)
                  for name, tensor in datum.loss_fn_inputs.items()}
        try:
            out.append(Datum(ModelInput.from_ints(tokens), inputs))
        except (TypeError, ValueError) as exc:
            raise UserError(f"{where}: {exc}") from None
    return out


@dataclass(frozen=True)
class ProvenanceSpan:
    """One run of a datum's provenance (the SDK's `PromptProvenanceSpan` / `SampledProvenanceSpan`):
    ``length`` consecutive positions of the field it tiles are positions ``offset``, ``offset + 1``,
    ... of the prompt (``sampled`` False) or of the sampled tokens of sequence ``sequence_id``."""

    sampled: bool
    sequence_id: str
    offset: int
    length: int


Provenance = tuple[list[ProvenanceSpan], list[ProvenanceSpan]]
"""A datum's runs over its `model_input`, then over its `target_tokens`."""


def provenance(msg: pb.ForwardBackwardRequest) -> list[Provenance | None]:
    """Each datum's provenance (`Datum.with_provenance`), None for a datum without any."""
    out: list[Provenance | None] = []
    for i, datum in enumerate(msg.data):
        runs = [_spans(datum.model_input_spans, f"data[{i}].model_input_spans"),
                _spans(datum.loss_fn_input_spans, f"data[{i}].loss_fn_input_spans")]
        if not runs[0] and not runs[1]:
            out.append(None)
            continue
        if not runs[0] or not runs[1]:
            raise UserError(f"data[{i}]: provenance comes as a pair: runs over model_input and over target_tokens")
        out.append((runs[0], runs[1]))
    return out


def _spans(spans, where: str) -> list[ProvenanceSpan]:
    out = []
    for j, span in enumerate(spans):
        kind = span.WhichOneof("span")
        if kind is None:
            raise UserError(f"{where}[{j}]: neither prompt_tokens nor sampled_tokens")
        run = getattr(span, kind)
        out.append(ProvenanceSpan(kind == "sampled_tokens", run.sequence_id, run.offset, run.length))
    return out


def _array(raw: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise UserError(f"{where}: {len(raw)} bytes is not a whole number of {dtype.name} values")
    return np.frombuffer(raw, dtype=dtype)


def _tensor(msg: pb.Tensor, where: str, positions: int, max_elements: int) -> torch.Tensor:
    """A dense tensor from a protobuf `Tensor`: bytes of the declared dtype, dense or sparse CSR
    (unlisted entries 0, as the SDK writes them), widened to int64 / float32. Without a shape it
    is 1-D, or 0-dim (one value per datum) when it holds one value and the datum has another number
    of ``positions`` (the SDK sends a 0-dim tensor's shape, ``[]``, as no shape). A declared shape
    of more than ``max_elements`` (`serve.limits.max_tensor_elements`) is refused before anything
    is built."""
    dtype = _NUMPY_DTYPES.get(msg.dtype)
    if dtype is None:
        raise UserError(f"{where}: unsupported dtype {msg.dtype} (expected float32 or int64)")
    shape = list(msg.shape)
    if any(n < 0 for n in shape):
        raise UserError(f"{where}: shape {shape} has a negative size")
    limits.at_most(f"{where}: elements of shape {shape}", math.prod(shape), max_elements, "max_tensor_elements")
    if msg.WhichOneof("encoding") == "sparse_csr":
        values = _widen(_array(msg.sparse_csr.values, dtype, f"{where}.values"), msg.dtype)
        crow = _array(msg.sparse_csr.crow_indices, np.dtype(np.int64), f"{where}.crow_indices")
        col = _array(msg.sparse_csr.col_indices, np.dtype(np.int64), f"{where}.col_indices")
        if len(shape) != 2:
            raise UserError(f"{where}: a sparse CSR tensor needs a 2-D shape, got {shape}")
        try:
            return torch.sparse_csr_tensor(torch.from_numpy(crow.copy()), torch.from_numpy(col.copy()),
                                           torch.from_numpy(values.copy()), shape, check_invariants=True).to_dense()
        except RuntimeError as exc:
            raise UserError(f"{where}: malformed sparse CSR tensor ({str(exc).splitlines()[0]})") from None
    values = _widen(_array(msg.dense, dtype, where), msg.dtype)
    if not shape:
        shape = [] if values.size == 1 and positions != 1 else [values.size]
    if math.prod(shape) != values.size:
        raise UserError(f"{where}: {values.size} values do not fill shape {shape}")
    return torch.from_numpy(values.reshape(shape).copy())


def _widen(values: np.ndarray, proto_dtype: int) -> np.ndarray:
    if proto_dtype == pb.DTYPE_BFLOAT16:  # bfloat16 is the upper half of a float32
        return (values.astype(np.uint32) << 16).view(np.float32)
    if proto_dtype == pb.DTYPE_INT32:
        return values.astype(np.int64)
    return values


def model_input(prompt: sdk.ModelInput, where: str) -> ModelInput:
    """A JSON `ModelInput` of token chunks as meshrl's."""
    chunks = []
    for j, chunk in enumerate(prompt.chunks):
        if not isinstance(chunk, sdk.EncodedTextChunk):
            raise UserError(f"{where}.chunks[{j}]: a {chunk.type} chunk; only encoded_text is supported")
        chunks.append(EncodedTextChunk(tuple(int(t) for t in chunk.tokens)))
    return ModelInput(tuple(chunks))


def sampling_params(params: sdk.SamplingParams) -> SamplingParams:
    """The SDK's sampling parameters as meshrl's (a single stop string becomes a list)."""
    stop = params.stop
    if isinstance(stop, str):
        stop = [stop]
    return SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k, seed=params.seed, stop=None if stop is None else list(stop))


def forward_backward_output(result: ForwardBackwardOutput) -> bytes:
    """A backend `ForwardBackwardOutput` as the SDK's protobuf: one `ArrayRecord` per datum (so
    every datum keeps its own shapes) and metrics whose keys must read `name:reduction`, the form
    the SDK splits to combine chunked results."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in result.metrics.items():
        if key.count(":") != 1:
            raise ValueError(f"metric key {key!r} is not of the form name:reduction")
        msg.metrics[key] = float(value)
    names = set(result.loss_fn_outputs[0]) if result.loss_fn_outputs else set()
    for i, outputs in enumerate(result.loss_fn_outputs):
        if set(outputs) != names:
            raise ValueError(f"loss_fn_outputs[{i}] has fields {sorted(outputs)}, datum 0 has {sorted(names)}")
        record = msg.loss_fn_outputs.add(num_datums=1)
        for name, tensor in outputs.items():
            array = _output_array(tensor)
            field = record.fields[name]
            field.data = array.tobytes()
            field.offsets = np.array([0, array.nbytes], dtype=np.int64).tobytes()
            field.dtype = pb.DTYPE_INT64 if array.dtype == np.int64 else pb.DTYPE_FLOAT32
            field.trailing_shape.extend(array.shape[1:])
    return msg.SerializeToString()


def _output_array(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    if tensor.is_floating_point():
        tensor = tensor.to(torch.float32)
    else:
        tensor = tensor.to(torch.int64)
    return np.ascontiguousarray(tensor.numpy())


def sample_response(result: SampleResponse, request: sdk.SampleRequest, targets: "TargetIds | None") -> bytes:
    """A backend `SampleResponse` as the SDK's protobuf: tokens as int32, log-probabilities as
    float32, NaN for a prompt position without one (and for positions before the last
    `prompt_logprobs_last_n`, when the request scored only those; their top-k rows are empty);
    top-k lists as dense [positions, k] matrices, sentinel-filled (token 0, logprob -99999) where
    an entry is missing; target logprobs in the layout of the request's ids (``targets``)."""
    last_n = request.prompt_logprobs_last_n
    msg = pb.SampleResponse()
    for seq in result.sequences:
        out = msg.sequences.add(stop_reason=_STOP_REASONS[seq.stop_reason],
                                tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes())
        if seq.logprobs:
            out.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
        if seq.topk_logprobs is not None:
            out.topk_sampled_logprobs.CopyFrom(_topk(seq.topk_logprobs, request.topk_sample_logprobs))
    if result.prompt_logprobs is not None:
        values = np.array([math.nan if v is None else v for v in result.prompt_logprobs], dtype=np.float32)
        if last_n is not None:
            values[: max(len(values) - last_n, 0)] = math.nan
        msg.prompt_logprobs = values.tobytes()
    if result.topk_prompt_logprobs is not None:
        rows = list(result.topk_prompt_logprobs)
        if last_n is not None:
            rows[: max(len(rows) - last_n, 0)] = [None] * max(len(rows) - last_n, 0)
        msg.topk_prompt_logprobs.CopyFrom(_topk(rows, request.topk_prompt_logprobs))
    if result.target_prompt_logprobs is not None:
        if targets is None:
            raise ValueError("the backend returned target logprobs nobody asked for")
        msg.target_prompt_logprobs.CopyFrom(targets.encode(result.target_prompt_logprobs))
    if result.prompt_alt_tokens is not None:
        alt = result.prompt_alt_tokens
        msg.prompt_alt_tokens.tokens.CopyFrom(_dense(alt.tokens.to(torch.int64), pb.DTYPE_INT64))
        msg.prompt_alt_tokens.logprobs.CopyFrom(_dense(alt.logprobs.to(torch.float32), pb.DTYPE_FLOAT32))
    return msg.SerializeToString()


TOPK_SENTINEL = (0, -99999.0)
"""The SDK's empty top-k cell (`tinker.types.topk_logprobs.MASK_LOGPROB`)."""


def _topk(rows: list, k: int) -> pb.TopkLogprobs:
    """Top-k lists (None: nothing at that position) as the SDK's dense [len(rows), k] matrices."""
    ids = np.full((len(rows), k), TOPK_SENTINEL[0], dtype=np.int32)
    values = np.full((len(rows), k), TOPK_SENTINEL[1], dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate((row or [])[:k]):
            ids[i, j], values[i, j] = token, logprob
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=values.tobytes(), k=k, length=len(rows))


def _dense(tensor: torch.Tensor, dtype: int) -> pb.Tensor:
    array = np.ascontiguousarray(tensor.detach().cpu().numpy())
    return pb.Tensor(dense=array.tobytes(), dtype=dtype, shape=list(array.shape))


@dataclass(frozen=True)
class TargetIds:
    """`SampleRequest.target_prompt_logprobs`: token ids per prompt row (-1: nothing asked), and
    the CSR layout (row pointers, column indices) it came in when sparse, which the reply keeps."""

    rows: tuple[tuple[int, ...], ...]
    csr: tuple[list[int], list[int]] | None = None

    def encode(self, logprobs: torch.Tensor) -> pb.Tensor:
        """The float32 logprobs of these ids ([rows, K], 0.0 where -1), in the request's layout."""
        values = logprobs.to(torch.float32).reshape(len(self.rows), -1)
        if self.csr is None:
            return _dense(values, pb.DTYPE_FLOAT32)
        crow, col = self.csr
        rows = torch.repeat_interleave(torch.arange(len(crow) - 1), torch.tensor(crow).diff())
        listed = values[rows, torch.tensor(col, dtype=torch.long)].numpy()
        return pb.Tensor(sparse_csr=pb.SparseCsr(values=listed.tobytes(),
                                                 crow_indices=np.asarray(crow, dtype=np.int64).tobytes(),
                                                 col_indices=np.asarray(col, dtype=np.int64).tobytes()),
                         dtype=pb.DTYPE_FLOAT32, shape=list(values.shape))


def target_ids(data: sdk.TensorData | None, prompt_length: int, max_elements: int) -> TargetIds | None:
    """The ids of a request's `target_prompt_logprobs` (int64, [len(prompt) - 1, K], dense or
    sparse CSR with -1 in every unlisted cell); UserError naming what is malformed, or a shape over
    ``max_elements`` or not matching the prompt, before anything is built."""
    if data is None:
        return None
    where = "target_prompt_logprobs"
    if data.dtype != "int64" or data.shape is None or len(data.shape) != 2:
        raise UserError(f"{where}: expected an int64 tensor of shape [len(prompt) - 1, K], got {data.dtype} "
                        f"of shape {data.shape}")
    n_rows, width = data.shape
    if n_rows != prompt_length - 1 or width < 1:
        raise UserError(f"{where}: shape {data.shape}, expected [len(prompt) - 1, K] = [{prompt_length - 1}, K >= 1]")
    limits.at_most(f"{where}: elements of shape {data.shape}", n_rows * width, max_elements, "max_tensor_elements")
    values = [int(v) for v in data.data]
    if data.sparse_crow_indices is None:
        if len(values) != n_rows * width:
            raise UserError(f"{where}: {len(values)} values do not fill shape {data.shape}")
        return TargetIds(tuple(tuple(values[r * width:(r + 1) * width]) for r in range(n_rows)))
    crow, col = list(data.sparse_crow_indices), list(data.sparse_col_indices or [])
    if (len(crow) != n_rows + 1 or crow[0] != 0 or not crow[-1] == len(col) == len(values)
            or any(b < a for a, b in zip(crow, crow[1:])) or any(not 0 <= c < width for c in col)):
        raise UserError(f"{where}: malformed sparse CSR tensor (row pointers, column indices and values of "
                        f"shape {data.shape} disagree)")
    dense = [[-1] * width for _ in range(n_rows)]
    for r in range(n_rows):
        for i in range(crow[r], crow[r + 1]):
            dense[r][col[i]] = values[i]
    return TargetIds(tuple(map(tuple, dense)), (crow, col))
