"""TapConnector: a vLLM KV connector that hands each finished request's tapped layers to tapdraft.

vLLM's ``extract_hidden_states`` speculative method runs the target and writes the requested layers'
hidden states ([tokens, n_layers, H] per token slot) into the KV cache of one cache-only attention
layer, block by block as prefill chunks run, so chunked prefill leaves the whole prompt in place by
the time the request finishes. vLLM's own ``ExampleHiddenStatesConnector`` then saves one safetensors
file per request from a thread pool, through pinned memory (which fails on CPU: ``pin_memory=True
requires a CUDA or other accelerator backend``). This connector keeps the same two halves
(``vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py`` in vllm 0.32) and
replaces the file with a frame on a local socket:

- scheduler side: ``request_finished`` records (tag, prompt token ids, block ids) and keeps the blocks;
  ``build_connector_meta`` passes the records to the workers on the next step.
- worker side: ``get_finished`` gathers each record's slots from the cache (a plain device-to-host copy,
  no pinned memory), sends ``{"kind": "states", "tag", "token_ids", "dtype", "shape"}`` + the bytes on
  ``kv_connector_extra_config["tapdraft_socket"]``, and reports the request done so vLLM frees its blocks.

The tag is ``kv_transfer_params["tapdraft_tag"]`` of the request's sampling params (tapdraft's sample
index). Prompt tokens only: tapdraft sends ``max_tokens=1``, and the sampled token is never an input.
One rank sends (tensor rank 0 of the stage holding the cache-only layer), so vLLM counts one
``finished_sending`` per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, SupportsHMA)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

from . import wire

SOCKET_KEY = "tapdraft_socket"
TAG_KEY = "tapdraft_tag"


@dataclass
class Save:
    req_id: str
    tag: Any
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class TapMetadata(KVConnectorMetadata):
    saves: list[Save] = field(default_factory=list)


class TapConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only connector streaming extract_hidden_states' cache to tapdraft (module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "extract_hidden_states":
            raise ValueError("TapConnector needs speculative_config method 'extract_hidden_states'")
        self._group = self._hidden_state_group(kv_cache_config)
        self._address = self._kv_transfer_config.get_from_extra_config(SOCKET_KEY, None)
        self._pending: dict[str, Save] = {}  # scheduler side
        self._cache: torch.Tensor | None = None  # worker side: [blocks, n_layers, block_size, H]
        self._sender = False
        self._sock = None
        self._sent: set[str] = set()
        self._finished: set[str] = set()

    @staticmethod
    def _hidden_state_group(kv_cache_config: Any) -> int:
        if kv_cache_config is None:
            return 0
        from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

        groups = kv_cache_config.kv_cache_groups
        ids = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
        if len(ids) == 1:
            return ids[0]
        if not ids and len(groups) == 1:
            return 0
        raise ValueError(f"cannot tell the hidden-states cache group among {len(groups)} KV cache groups")

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return "LBNHC"  # each token's layers together, as the cache-only layer writes them

    def get_finished_count(self) -> int:
        return 1

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        layers = get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches))
        if len(layers) > 1:
            raise ValueError(f"expected one cache-only attention layer, found {len(layers)}")
        if layers:
            self._cache = kv_caches[next(iter(layers))]
        self._sender = bool(layers) and get_tensor_model_parallel_rank() == 0

    def start_load_kv(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, *args: Any, **kwargs: Any) -> None:
        pass  # the cache-only layer already wrote the states during the forward

    def wait_for_save(self) -> None:
        pass

    def _states(self, save: Save) -> torch.Tensor:
        """[T, n_layers, H] on the host: the request's slots, in token order."""
        assert self._cache is not None
        bs = self._cache.shape[2]
        blocks = torch.tensor(save.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * bs + torch.arange(bs)[None]).flatten()[: len(save.token_ids)]
        slots = slots.to(self._cache.device)
        return self._cache[slots // bs, :, slots % bs].to("cpu").contiguous()

    def _send(self, save: Save) -> None:
        if self._sock is None:
            if not self._address:
                raise ValueError(f"TapConnector needs kv_connector_extra_config[{SOCKET_KEY!r}]")
            self._sock = wire.connect(self._address)
        hs = self._states(save)
        dtype = str(hs.dtype).removeprefix("torch.")
        raw = hs.view(torch.uint8).numpy() if hs.dtype == torch.bfloat16 else hs.numpy()
        wire.send(self._sock, {"kind": "states", "tag": save.tag, "token_ids": save.token_ids, "dtype": dtype,
                               "shape": list(hs.shape)}, raw)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._sender and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, TapMetadata):
                for save in meta.saves:
                    self._send(save)
                    self._sent.add(save.req_id)
        self._finished |= finished_req_ids
        done = self._finished & self._sent
        self._finished -= done
        self._sent -= done
        return done or None, None

    def shutdown(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert num_external_tokens == 0, "TapConnector loads nothing"

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = TapMetadata(saves=list(self._pending.values()))
        self._pending.clear()
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        if TAG_KEY not in params or request.prompt_token_ids is None:
            return False, None
        self._pending[request.request_id] = Save(request.request_id, params[TAG_KEY],
                                                 list(request.prompt_token_ids), list(block_ids))
        return True, None  # keep the blocks until a worker has sent them

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        if not 0 <= self._group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self._group])
