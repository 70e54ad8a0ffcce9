//! # offload-core
//!
//! The engine of kvoffload: a CPU tier for an LLM server's KV cache. When GPU memory runs
//! out, servers drop the KV of old prefixes and recompute them later; this crate keeps
//! those blocks in host memory and plans the copies that bring them back.
//!
//! It is pure Rust with no Python and no CUDA needed to build or test, so servers other
//! than vLLM embed it and drive the same protocol the vLLM connector drives:
//! - [`Planner`] (scheduler side) owns CPU block ids and each request's block hashes.
//!   A model is a list of KV-cache groups ([`GroupKind`]: a dense model is
//!   `[GroupKind::FullAttention]`, hybrid models add sliding-window or Mamba groups), and
//!   every model takes the same path: `Planner::new(cfg, &kinds)`. Per engine step: [`Planner::lookup`] for waiting requests, [`Planner::on_alloc`]
//!   for the hit the scheduler accepted, [`Planner::schedule`] with the step's requests
//!   (it returns the step's [`StepPlan`]), [`Planner::complete_all`] with what workers
//!   report, [`Planner::request_finished`] when a request ends;
//! - [`transfer::TransferEngine`] (worker side) owns the host memory and executes each
//!   plan's [`LoadJob`]s and [`StoreJob`]s on its own copy thread;
//! - [`OffloadConfig`] parses and validates the settings.
//!
//! The CPU tier's building blocks ([`BlockCache`], [`PrefixIndex`], [`BlockPool`], the
//! eviction policies, [`HostMemory`]) are public from the crate root for benches and for
//! servers that assemble their own scheduler side; the modules that hold them are not.
//!
//! Hashes are the server's own chained block hashes (block `k`'s hash covers blocks
//! `0..=k`), read through [`HashSource`] when the planner needs them and checked against
//! what it read before, so a request whose list is rewritten under the same id is never
//! served or stored under a stale key.
//!
//! ## Example
//! A server that offloads a finished request's prompt and serves a second request with
//! the same prefix from CPU (`examples/embedded_server.rs` adds the worker side and real
//! bytes):
//! ```
//! use offload_core::{
//!     BlockHash, GroupKind, Planner, PlannerConfig, ScheduleKind, ScheduledRequest,
//! };
//!
//! // A dense model: one full-attention KV-cache group.
//! let dense = [GroupKind::FullAttention];
//! let mut planner = Planner::new(PlannerConfig::new(16, 1024).with_events(true), &dense);
//! let prompt: Vec<BlockHash> = (1..=8).map(BlockHash).collect(); // 128 tokens
//! let new = |req, gpu: &[u32]| ScheduledRequest {
//!     req_id: req,
//!     kind: ScheduleKind::New,
//!     num_computed_tokens: 0,
//!     num_scheduled_tokens: 0,
//!     gpu_blocks: gpu.to_vec(),
//!     hashes: &prompt,
//! };
//!
//! // Request "a" runs: nothing on CPU yet, its 8 blocks live in GPU blocks 100..108.
//! assert_eq!(planner.lookup("a", &prompt, 129, 0)?, 0);
//! let gpu_a: Vec<u32> = (100..109).collect();
//! planner.on_alloc("a", &[&gpu_a], 0, 0)?;
//! assert!(planner.schedule([new("a", &gpu_a)], [])?.is_empty());
//! // It finishes; the flush stores all 8 full blocks and the server must keep them.
//! assert!(planner.request_finished("a", &prompt, 128)?);
//! let store = planner.schedule(Vec::<ScheduledRequest<'_, &Vec<BlockHash>>>::new(), [])?
//!     .store
//!     .expect("blocks to store");
//! assert_eq!(store.gpu_blocks, (100..108).collect::<Vec<_>>());
//! planner.complete(store.id, true)?; // the worker copied them
//! assert_eq!(planner.take_completions().finished_sending, vec!["a".to_string()]);
//!
//! // Request "b" shares the prompt: 128 tokens come from CPU, only the last is computed.
//! assert_eq!(planner.lookup("b", &prompt, 129, 0)?, 128);
//! let gpu_b: Vec<u32> = (200..209).collect();
//! planner.on_alloc("b", &[&gpu_b], 0, 128)?;
//! let load = planner.schedule([new("b", &gpu_b)], [])?.loads.remove(0);
//! assert_eq!(load.cpu_blocks, store.cpu_blocks);
//! planner.complete(load.id, true)?;
//! assert_eq!(planner.take_completions().finished_recving, vec!["b".to_string()]);
//! # Ok::<(), offload_core::PlanError>(())
//! ```

mod cache;
pub mod config;
mod config_value;
pub mod error;
pub mod events;
mod evict;
mod index;
pub mod key;
mod memory;
pub mod planner;
mod pool;
mod prefetch;
pub mod tier;
pub mod transfer;

pub use cache::{BlockCache, Reservation};
pub use config::{ConfigValue, KvCacheLayout, LoadMode, OffloadConfig, ParsedConfig};
pub use error::{ConfigError, HashError, PlanError};
pub use events::{EventBuffer, KvEvent, PlannerStats};
pub use evict::{Clock, EvictionPolicy, Lru, Slru};
pub use index::{PrefixIndex, Vacancy};
pub use key::{BlockHash, BlockId, BlockKey};
pub use memory::{HostMemory, HostMemoryOptions, MemoryError};
pub use planner::{
    Completions, FetchJob, GroupKind, GroupTables, HashSource, LazyCandidate, LoadJob,
    LookupOutcome, Planner, PlannerConfig, RemoteStats, ScheduleKind, ScheduledGroups,
    ScheduledRequest, StepPlan, StoreJob, TransferId,
};
pub use pool::{BlockPool, BlockState, PoolError};
