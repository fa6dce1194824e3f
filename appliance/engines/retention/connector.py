"""The retention connector: the KV-connector plugin each vLLM worker the appliance starts
loads (vLLM imports this module; the appliance never does). It moves no KV: it holds a
finished request's prefix-cached blocks while the appliance asks, and gives them back.

vLLM builds it twice in the engine-core process: the scheduler's instance does everything
here, the model runner's (role WORKER) has nothing to do. The scheduler calls, on its own
thread:
- `request_finished_all_groups` (before it frees a finished request's blocks): the hold
  book remembers them under the request's `session_id` (the appliance's session key),
  holding nothing; returns `delay_free=False`, so vLLM frees the request as usual.
- `get_num_new_matched_tokens` (for each waiting request, just before its blocks are
  allocated): directives and expiries are applied, then holds are given back until the
  request fits with the reserve (`reserve_fraction` of the pool) still free, so a hold
  never keeps a request waiting, and an admission never leaves the running requests
  without room for their next blocks (they would stall while holds drain, and once none
  was left vLLM would preempt one).
- `has_pending_block_frees` (when a running request is short of blocks, before vLLM would
  preempt one): holds are given back; True makes vLLM retry next step instead of
  preempting (False when nothing was held: it preempts as it would without us). No new
  waiting request is admitted in the rest of that step (`get_num_new_matched_tokens`
  answers None, so vLLM skips it until the next step, counting it "skipped"), as vLLM
  admits none after a preemption: the room given back goes to the running request, which
  new admissions would otherwise take step after step until no hold was left and vLLM
  preempted it after all.
- `build_connector_meta` (end of every step): directives and expiries again.
A directive sent to an idle engine is applied when the next request is scheduled: nothing
evicts without a step, so this is the same as at once.

It subclasses `SupportsHMA`, or vLLM would turn its hybrid KV cache manager off.

With a host tier (`appliance.engines.offload.connector.HostTierConnector` composes it with
vLLM's OffloadingConnector and `attach_host`es that connector's tier before the pool is
bound): a demotion keeps the key's prefix in the host tier and gives its GPU blocks back
first; a restore makes its host copies the tier's most recently used, and the key's next
request loads them back (vLLM's offloading connector, past what the GPU still has); the
reports carry the tier's size and use.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from appliance.engines.retention.channel import ControlChannel, log
from appliance.engines.retention.holds import HoldBook
from appliance.engines.retention.plugin import RetentionTuning
from appliance.engines.retention.protocol import (
    GiveBackReason,
    RetentionReport,
    RetentionRestore,
)
from appliance.engines.retention.vllm_pool import HostTierReader, VllmKvPool

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class RetentionMetadata(KVConnectorMetadata):
    """Nothing travels to the model runner."""


class RetentionConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._tuning = RetentionTuning.from_extra(
            self._kv_transfer_config.kv_connector_extra_config
        )
        self._block_sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
        self._incarnation = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._pool: VllmKvPool | None = None
        self._host: HostTierReader | None = None
        self._host_seen = (0, 0)
        """The host tier's size and use in the latest report."""
        self._published_at = 0.0
        self._book: HoldBook | None = None
        self._reserve = 0
        self._step_begins = True
        """No waiting request was looked at yet in this scheduler step."""
        self._relieved = False
        """Holds were given back for a running request in this step: admit nothing more."""
        self._channel: ControlChannel | None = None
        endpoint = self._tuning.control_endpoint
        if role == KVConnectorRole.SCHEDULER and endpoint:
            first = RetentionReport(self._incarnation, 0, time.time(), 0, 0)
            self._channel = ControlChannel(
                endpoint, first, report_interval_s=self._tuning.report_interval_s
            ).start()

    # --- model runner side: nothing to move ---

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    # --- scheduler side ---

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a hold is a cache: a preempted request need not wait for it

    def attach_host(self, host: HostTierReader) -> None:
        """The worker's host tier (before vLLM binds the block pool)."""
        self._host = host
        if self._pool is not None:
            self._pool.host = host

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self._pool = VllmKvPool(gpu_block_pool, self._host)
        self._book = HoldBook(
            self._pool, self._block_sizes, max_held_fraction=self._tuning.max_held_fraction
        )
        self._reserve = max(1, int(self._pool.usable_blocks() * self._tuning.reserve_fraction))
        log.info(
            "retention connector %s: %d blocks, holds capped at %.0f%%",
            self._incarnation,
            self._pool.usable_blocks(),
            100 * self._tuning.max_held_fraction,
        )
        self._publish()

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._step_begins:  # once a step: directives must be in before any admission
            self._step_begins = False
            self._housekeeping()
        if self._relieved:
            return None, False  # the running request's room first; admitted next step
        if self._book:
            hit_blocks = num_computed_tokens // self._block_sizes[0]
            own = min(self._book.held_of(request.session_id), hit_blocks)
            need = self._need(request) - own + self._reserve
            if self._book.make_room(need, protect=request.session_id):
                self._publish()
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int):
        return

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._housekeeping()
        self._step_begins = True
        self._relieved = False
        return RetentionMetadata()

    def has_pending_block_frees(self) -> bool:
        if not self._book:
            return False
        given = self._book.relieve(self._reserve)
        if given:
            self._relieved = True
            self._publish()
        return given

    def request_finished(self, request: Request, block_ids: list[int]):
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]):
        key = request.session_id
        if key and self._book is not None and self._pool is not None:
            entries = self._pool.cached_entries(
                block_ids, request.num_computed_tokens, self._block_sizes
            )
            self._book.finished(key, entries)
        return False, None

    def reset_cache(self) -> bool | None:
        if self._book is not None:
            self._book.release_all(GiveBackReason.RESET)
            self._publish()
        return True

    def shutdown(self) -> None:
        if self._book is not None:
            self._book.release_all(GiveBackReason.RESET)
            self._publish()
        if self._channel is not None:
            self._channel.close()

    # --- helpers (scheduler thread) ---

    def _need(self, request: Request) -> int:
        """Free blocks a waiting request's prompt takes at most, in every group, with vLLM's
        admission watermark (its hits on blocks in the free queue count, as they leave it)."""
        tokens = request.num_tokens + 1
        watermark = getattr(self._kv_cache_manager, "watermark_blocks", 0) or 0
        return sum(math.ceil(tokens / size) for size in self._block_sizes) + watermark

    def _housekeeping(self) -> None:
        if self._book is None:
            return
        pending = list(self._channel.pending()) if self._channel is not None else []
        restores = [d for d in pending if isinstance(d, RetentionRestore)]
        owed = self._book.catch_up(
            [d for d in pending if not isinstance(d, RetentionRestore)], time.time()
        )
        if self._host is not None:
            for restore in restores:
                self._host.refresh(restore.key)
            changed = self._host.size() != self._host_seen  # stores land every step: 1 s
            owed = owed or (changed and time.monotonic() - self._published_at >= 1.0)
        if owed:
            self._publish()

    def _publish(self) -> None:
        if self._channel is None or self._book is None or self._pool is None:
            return
        given_back = self._book.take_given_back()
        self._host_seen = host = self._pool.host_blocks()
        self._published_at = time.monotonic()
        self._channel.publish(
            RetentionReport(
                incarnation=self._incarnation,
                seq=0,  # the channel numbers what it sends
                at_s=time.time(),
                pool_blocks=self._pool.usable_blocks(),
                free_blocks=self._pool.free_blocks(),
                held=self._book.held(),
                given_back=given_back,
                host_blocks=host[0],
                host_used_blocks=host[1],
            )
        )
