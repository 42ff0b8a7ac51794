"""A small key -> bytes store over any fsspec filesystem (file://, s3://, gs://, hf://, ...), with a
deadline on every operation, atomic puts, write-once creates and checksummed payloads."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import os
import uuid
import zlib
from typing import Any, Callable, TypeVar

import torch
from safetensors.torch import load as st_load, save as st_save

T = TypeVar("T")
Tensors = dict[str, torch.Tensor]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class StoreError(RuntimeError):
    """A store operation failed or passed its deadline."""


class CorruptObject(ValueError):
    """An object's bytes do not match its manifest (truncated, altered, or not what it claims)."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode_tensors(tensors: Tensors, dtype: str = "fp32", compression: str = "none") -> bytes:
    """safetensors bytes of ``tensors`` cast to ``dtype`` (fp32|bf16), zlib-compressed on request."""
    data = st_save({k: v.detach().to(DTYPES[dtype]).contiguous().cpu() for k, v in tensors.items()})
    return zlib.compress(data, 1) if compression == "zlib" else data


def decode_tensors(data: bytes, compression: str = "none") -> Tensors:
    """The float32 tensors in ``data`` (from `encode_tensors`); CorruptObject if unreadable."""
    try:
        raw = zlib.decompress(data) if compression == "zlib" else data
        return {k: v.float() for k, v in st_load(raw).items()}
    except Exception as e:  # zlib.error, safetensors' own errors: all mean the same to a reader
        raise CorruptObject(f"cannot decode tensors: {type(e).__name__}: {e}") from None


class ObjectStore:
    """Keys are '/'-separated paths under ``url``. Puts are atomic (readers see the whole object or
    none); `create` is write-once (the first writer wins); listings bypass fsspec's listing cache
    (other replicas write meanwhile); every call raises StoreError after ``timeout_s``."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, timeout_s: float = 120.0):
        import fsspec

        try:
            self.fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except (ImportError, ValueError) as e:
            raise StoreError(f"store_url {url!r}: {e}") from None
        self.url, self.root, self.timeout_s = url, root.rstrip("/"), timeout_s
        self._pool = cf.ThreadPoolExecutor(max_workers=4, thread_name_prefix="objstore")
        self._local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _call(self, what: str, fn: Callable[..., T], *args) -> T:
        future = self._pool.submit(fn, *args)
        try:
            return future.result(timeout=self.timeout_s)
        except cf.TimeoutError:
            raise StoreError(f"store {what} took over {self.timeout_s:.0f}s ({self.url})") from None
        except (FileNotFoundError, FileExistsError):
            raise
        except Exception as e:
            raise StoreError(f"store {what} failed ({self.url}): {type(e).__name__}: {e}") from None

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key`` atomically: on local files a temporary file in the same folder,
        then a rename; on object stores one PUT, which is atomic there (a move would be a copy and
        a delete, and s3fs checks the copy's source against a possibly stale listing cache)."""
        final = self.path(key)

        def write():
            if not self._local:
                self.fs.pipe_file(final, data)
                return
            tmp = f"{final.rsplit('/', 1)[0]}/.tmp-{uuid.uuid4().hex}"
            self.fs.makedirs(final.rsplit("/", 1)[0], exist_ok=True)
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, final)

        self._call(f"put {key}", write)

    def create(self, key: str, data: bytes) -> bool:
        """Write ``data`` at ``key`` only if nothing is there, atomically (an exclusive create:
        local files a hard link of a complete temporary file, S3 If-None-Match); True if this call
        wrote it."""
        final = self.path(key)

        def write():
            if not self._local:
                self.fs.pipe_file(final, data, mode="create")
                return
            # fsspec's local "create" is an exists() check, then a plain write: two writers could
            # both win, and a reader could see the object half written
            folder = final.rsplit("/", 1)[0]
            self.fs.makedirs(folder, exist_ok=True)
            tmp = f"{folder}/.tmp-{uuid.uuid4().hex}"
            self.fs.pipe_file(tmp, data)
            try:
                os.link(tmp, final)  # FileExistsError if there is one
            finally:
                os.unlink(tmp)

        try:
            self._call(f"create {key}", write)
            return True
        except FileExistsError:
            return False
        except StoreError as e:
            if "PreconditionFailed" in str(e) or "412" in str(e) or "exists" in str(e).lower():
                return False
            raise

    def get(self, key: str) -> bytes | None:
        """The bytes at ``key``, None if absent."""
        try:
            return self._call(f"get {key}", self.fs.cat_file, self.path(key))
        except FileNotFoundError:
            return None

    def get_json(self, key: str) -> dict | None:
        """The JSON object at ``key``; None if absent; CorruptObject if not a JSON object."""
        data = self.get(key)
        if data is None:
            return None
        try:
            obj = json.loads(data)
        except ValueError:
            raise CorruptObject(f"{key}: not JSON") from None
        if not isinstance(obj, dict):
            raise CorruptObject(f"{key}: not a JSON object")
        return obj

    def put_json(self, key: str, obj: dict) -> None:
        self.put(key, json.dumps(obj, sort_keys=True).encode())

    def create_json(self, key: str, obj: dict) -> bool:
        return self.create(key, json.dumps(obj, sort_keys=True).encode())

    def list(self, prefix: str) -> list[str]:
        """Names (not paths) directly under ``prefix``; temporary keys excluded; [] if none."""
        def ls():
            self.fs.invalidate_cache(self.path(prefix))
            try:
                return self.fs.ls(self.path(prefix), detail=False)
            except FileNotFoundError:
                return []

        return sorted(n for n in (p.rstrip("/").rsplit("/", 1)[-1] for p in self._call(f"list {prefix}", ls))
                      if not n.startswith(".tmp-"))

    def delete(self, prefix: str) -> None:
        """Remove ``prefix`` and everything under it (absent is fine)."""
        def rm():
            self.fs.invalidate_cache(self.path(prefix))
            try:
                self.fs.rm(self.path(prefix), recursive=True)
            except FileNotFoundError:
                pass

        self._call(f"delete {prefix}", rm)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
