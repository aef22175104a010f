"""A vLLM KV connector that writes the verifier's hidden states straight into our cache shards.

vLLM's `extract_hidden_states` speculative method stores, per prompt token, the outputs of the layers
named in `eagle_aux_hidden_state_layer_ids` in a cache-only KV group; when a request finishes this
connector reads its rows back (synchronously, so it works on CPU and GPU alike) and, once every request
of a shard group has arrived, writes them as one shard through `HiddenStateCache.write_shard` (our
dtypes, checksums and manifest). Loaded by vLLM through `kv_connector_module_path`.

Requests carry `{"peagle": {"cache": DIR, "index": I, "group": G, "group_size": N}}` in their
`kv_transfer_params`; the layer ids must be our three aux layers followed by `num_hidden_layers`
(the last decoder layer's output before the final norm, our `last`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

from peagle_core.hidden_states.cache import HiddenStateCache
from peagle_core.hidden_states.codec import HiddenRecord

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

PARAMS_KEY = "peagle"


@dataclass
class _Save:
    req_id: str
    params: dict[str, Any]
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class PeagleConnectorMetadata(KVConnectorMetadata):
    saves: list[_Save] = field(default_factory=list)


class PeagleHiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only connector: finished requests' hidden states become rows of our cache shards."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        # The hidden-state group and its block size, found the way vLLM's example connector finds them.
        self._group_id = ExampleHiddenStatesConnector._find_cache_kv_group_id(kv_cache_config)
        self._block_size = ExampleHiddenStatesConnector._get_cache_block_size(
            vllm_config, kv_cache_config, self._group_id
        )
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "extract_hidden_states":
            raise ValueError("PeagleHiddenStatesConnector needs speculative method extract_hidden_states")
        ids = list(getattr(spec.draft_model_config.hf_config, "eagle_aux_hidden_state_layer_ids", []))
        if len(ids) < 2:
            raise ValueError(f"need aux layer ids plus the last layer, got {ids}")
        self._num_aux = len(ids) - 1
        # scheduler side
        self._pending: dict[str, _Save] = {}
        # worker side
        self._kv_cache: torch.Tensor | None = None
        self._writer = True
        self._groups: dict[tuple[str, int], dict[int, tuple[HiddenRecord, torch.Tensor]]] = {}
        self._caches: dict[str, HiddenStateCache] = {}
        self._done: set[str] = set()
        self._finished: set[str] = set()

    def get_finished_count(self) -> int:
        return 1  # only tensor-parallel rank 0 writes

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self._writer = get_tensor_model_parallel_rank() == 0
        layers = list(
            get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches))
        )
        if len(layers) != 1:
            raise ValueError(f"expected one cache-only hidden-state layer, found {len(layers)}")
        self._kv_cache = kv_caches[layers[0]]
        if self._kv_cache.shape[2] != self._block_size:
            raise ValueError(f"hidden-state block size {self._kv_cache.shape[2]} != {self._block_size}")

    def start_load_kv(self, *args: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, *args: Any, **kwargs: Any) -> None:
        return None  # the rows are already in the cache-only layer; they are read on finish

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, PeagleConnectorMetadata):
                for save in meta.saves:
                    if self._writer:
                        self._store(save)
                    self._done.add(save.req_id)
        self._finished |= finished_req_ids
        ready = self._done & self._finished
        self._done -= ready
        self._finished -= ready
        return (ready or None), None

    def _rows(self, save: _Save) -> HiddenRecord:
        assert self._kv_cache is not None
        blocks = torch.tensor(save.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()
        n = len(save.token_ids)
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), n)
        states = states.to("cpu", torch.float32)  # [n, num_aux + 1, H]
        return HiddenRecord(states[:, : self._num_aux].reshape(n, -1).clone(), states[:, -1].clone())

    def _store(self, save: _Save) -> None:
        p = save.params
        key = (str(p["cache"]), int(p["group"]))
        group = self._groups.setdefault(key, {})
        group[int(p["index"])] = (self._rows(save), torch.tensor(save.token_ids, dtype=torch.int32))
        if len(group) < int(p["group_size"]):
            return
        del self._groups[key]
        cache = self._caches.get(key[0])
        if cache is None:
            cache = self._caches[key[0]] = HiddenStateCache.open(key[0])
        cache.write_shard([(i, rec, ids) for i, (rec, ids) in sorted(group.items())])

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = PeagleConnectorMetadata(saves=list(self._pending.values()))
        self._pending.clear()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = (request.kv_transfer_params or {}).get(PARAMS_KEY)
        if params is None or request.prompt_token_ids is None:
            return False, None  # not one of ours: nothing to store, free the blocks now
        self._pending[request.request_id] = _Save(
            request.request_id, dict(params), list(request.prompt_token_ids), list(block_ids)
        )
        return True, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if not 0 <= self._group_id < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self._group_id])
