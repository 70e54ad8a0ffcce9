//! # offload-core
//!
//! The engine of kvoffload: a CPU tier for an LLM server's KV cache. When GPU memory runs
//! out, servers drop the KV of old prefixes and recompute them later; this crate keeps
//! those blocks in host memory and plans the copies that bring them back.
//!
//! It is pure Rust with no Python and no CUDA needed to build or test, so servers other
//! than vLLM can embed it:
//! - [`OffloadConfig`] parses and validates the settings;
//! - [`BlockPool`], [`PrefixIndex`], [`Lru`] and [`BlockCache`] keep CPU blocks keyed by
//!   the server's own chained block hashes;
//! - [`Planner`] is the scheduler-side brain: prefix lookups with pinning, load plans,
//!   eager and lazy store selection, completion accounting across ranks, KV events;
//! - [`transfer::TransferEngine`] is the worker side: it owns the host memory and copies
//!   blocks on its own thread.
//!
//! ## Example
//! A server that offloads a finished request's prompt and serves a second request with
//! the same prefix from CPU:
//! ```
//! use offload_core::{BlockHash, Planner, PlannerConfig};
//!
//! let mut planner = Planner::new(PlannerConfig {
//!     block_size: 16,
//!     num_cpu_blocks: 1024,
//!     events: true,
//!     ..PlannerConfig::default()
//! });
//! let prompt: Vec<BlockHash> = (1..=8).map(BlockHash).collect(); // 128 tokens
//!
//! // Request "a" runs: nothing on CPU yet, its 8 blocks live in GPU blocks 100..108.
//! planner.extend_hashes("a", prompt.iter().copied());
//! assert_eq!(planner.lookup("a", 129, 0)?, 0);
//! let gpu_a: Vec<u32> = (100..109).collect();
//! planner.on_alloc("a", &gpu_a, 0, 0)?;
//! planner.note_scheduled("a", 0, &gpu_a, true)?;
//! // It finishes; the flush stores all 8 full blocks and vLLM must keep them until done.
//! assert!(planner.request_finished("a", 128)?);
//! let store = planner.take_step().store.expect("blocks to store");
//! assert_eq!(store.gpu_blocks, (100..108).collect::<Vec<_>>());
//! planner.complete(store.id, true)?; // the worker copied them
//! assert_eq!(planner.take_completions().finished_sending, vec!["a".to_string()]);
//!
//! // Request "b" shares the prompt: 128 tokens come from CPU, only the last is computed.
//! planner.extend_hashes("b", prompt.iter().copied());
//! assert_eq!(planner.lookup("b", 129, 0)?, 128);
//! let gpu_b: Vec<u32> = (200..209).collect();
//! planner.on_alloc("b", &gpu_b, 0, 128)?;
//! let load = planner.take_step().loads.remove(0);
//! assert_eq!(load.cpu_blocks, store.cpu_blocks);
//! planner.complete(load.id, true)?;
//! assert_eq!(planner.take_completions().finished_recving, vec!["b".to_string()]);
//! # Ok::<(), offload_core::PlanError>(())
//! ```

pub mod cache;
pub mod config;
pub mod error;
pub mod events;
pub mod evict;
pub mod index;
pub mod memory;
pub mod planner;
pub mod pool;
pub mod transfer;

pub use cache::BlockCache;
pub use config::{ConfigValue, LoadMode, OffloadConfig, ParsedConfig};
pub use error::{ConfigError, PlanError};
pub use events::{EventBuffer, KvEvent, PlannerStats};
pub use evict::{EvictionPolicy, Lru};
pub use index::{BlockHash, BlockKey, PrefixIndex};
pub use planner::{Completions, LoadJob, Planner, PlannerConfig, StepPlan, StoreJob, TransferId};
pub use pool::{BlockId, BlockPool, BlockState, PoolError};
