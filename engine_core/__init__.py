"""The CPU half of the engine: requests, scheduler, paged KV block manager, step loop."""
from engine_core.config import CacheConfig, SchedulerConfig
from engine_core.engine_core import EngineCore, ModelExecutor
from engine_core.kv_cache.block_pool import BlockPool, IntegrityError
from engine_core.kv_cache.free_block_queue import FreeBlockQueue, KVCacheBlock
from engine_core.kv_cache.kv_cache_manager import KVCacheManager, hash_block_tokens
from engine_core.request import Request, RequestStatus
from engine_core.sched.scheduler import Scheduler

__all__ = ["BlockPool", "IntegrityError", "CacheConfig", "SchedulerConfig", "EngineCore",
           "ModelExecutor", "FreeBlockQueue", "KVCacheBlock", "KVCacheManager",
           "hash_block_tokens", "Request", "RequestStatus", "Scheduler"]
