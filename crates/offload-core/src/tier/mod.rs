//! A second tier behind the CPU tier: blocks shared between engines through a remote
//! store, so one replica serves a prefix another replica computed.
//!
//! The store is a cache, never a source of truth. Every value carries a header (format,
//! layout fingerprint, block hash, length) and a checksum; a value that fails any check is
//! a miss, counted and logged, and the block is recomputed. Every call has a deadline, so
//! a dead or stalled store costs a miss, never a hang.
//!
//! Layers, bottom up:
//! - [`RemoteStore`]: raw bytes by key, one round trip per call. [`RedisStore`] speaks to
//!   Redis Cluster (or Valkey); [`disk::DiskStore`] keeps blocks in local files (the
//!   scheduler checks them through [`disk::DiskProbe`]); [`StackedStore`] puts the disk in
//!   front of Redis. Another store (Mooncake) implements the same trait and nothing above
//!   changes. [`MemoryStore`] is one in this process, for
//!   tests without a server.
//! - [`KeySpace`] and [`value`]: what a key and a value are for one engine rank
//!   ([`KvLayout`] decides which blocks are interchangeable).
//! - [`RemoteTier`]: block-level calls (probe a chain, fetch verified blocks, store).
//! - [`WriteBehind`] (worker side): writes blocks from a byte-bounded queue on its own
//!   thread, in batches, dropping and counting what does not fit.
//! - [`ProbeQueue`] (scheduler side): existence checks on their own thread, polled without
//!   blocking, so the scheduler answers "ask again next step" while one is in flight.
//! - [`WorkerTier`] (worker side): fetches planned by the scheduler into the CPU blocks it
//!   reserved, and the write-behind of stored blocks.
//!
//! # Who does what
//! The scheduler owns the index, the worker owns the bytes, and they meet only in the
//! per-step metadata, so a remote hit takes the same path as a store: when the local CPU
//! hit ends before the prompt's full blocks do, the planner (`Planner::lookup_tiered`)
//! probes the rest of the chain (one round trip, on the probe thread) and answers
//! "pending" meanwhile; found blocks get CPU blocks reserved in the index (not yet
//! served), a fetch job goes to every worker with the step's metadata, each rank fetches
//! its own shard into those blocks, and once every rank reported, the leading run all of
//! them filled is published: the next lookup finds it as a local hit, pinned and loaded
//! as usual. Blocks a rank could not fill are dropped and their hashes remembered (a
//! bounded set), so the chain is cut there from then on and the request recomputes
//! instead of being offered the same failing fetch again. Each request gets at most one
//! remote attempt per prompt length, so no request waits on the store more than one probe
//! and one fetch, each bounded by the deadline.
//!
//! Without `remote_url` and without `kv_offload_backend: "disk"` there is no tier: nothing
//! here is constructed and nothing runs. With both, the disk sits in front of the remote
//! store ([`StackedStore`]).
//!
//! # Operating the store
//! The tier never deletes: the store bounds itself. Give every Redis node a `maxmemory`
//! and `maxmemory-policy allkeys-lru` (`scripts/redis_cluster.sh` does), so the least
//! recently used blocks go first when it fills; a key expiry (`EXPIRE`, or Redis's
//! `volatile-*` policies) is not needed for correctness, since a stale block is only ever
//! a block nobody asks for. Size it as bytes per block (the block's KV bytes plus a
//! header of 40 bytes and its hash) times the distinct prefixes worth sharing; every
//! tensor-parallel rank stores its own shard under its own fingerprint.

mod blocks;
mod checksum;
pub mod config;
pub mod disk;
mod fill;
mod key;
mod memory;
mod probe;
mod redis;
mod stack;
mod stats;
pub mod value;
mod value_sum;
mod worker;
mod writer;

use thiserror::Error;

pub use blocks::{FetchedBlock, RemoteTier};
pub use config::RemoteConfig;
pub use fill::{BlockFill, Fill};
pub use key::{
    parse_kv_cache_version, sharing_problem, KeySpace, KvLayout, LayoutFingerprint, RemoteKey,
    DEFAULT_NONE_HASH_SEED, KEY_KV_CACHE_VERSION, MAX_HASH_BYTES,
};
pub use memory::MemoryStore;
pub use probe::ProbeQueue;
pub use redis::{redact_url, RedisStore};
pub use stack::StackedStore;
pub use stats::{TierSnapshot, TierStats};
pub use value::{ValueError, ValueParts};
pub use worker::{FetchRequest, WorkerTier, FETCH_BATCH};
pub use writer::WriteBehind;

/// A key/value store the tier keeps blocks in.
///
/// Each call is one batch: implementations send all of it before waiting for any answer
/// (one round trip, not one per key) and give up at a deadline. Results come per key, in
/// the order of the keys, so a failure on one shard does not hide what the others
/// answered.
pub trait RemoteStore: Send {
    /// Whether each key exists.
    fn exists(&mut self, keys: &[RemoteKey]) -> Vec<Result<bool, TierError>>;

    /// Each key's value, `None` where there is none.
    fn get(&mut self, keys: &[RemoteKey]) -> Vec<Result<Option<Vec<u8>>, TierError>>;

    /// Fetches each key's block straight into the caller's memory: `blocks[i]` says which
    /// block `keys[i]` must hold (its hash; `fingerprint` is the layout's) and where its
    /// payload goes. Every check [`RemoteTier::fetch`] makes is made (header, fingerprint,
    /// hash, length, checksum); only a [`Fill::Filled`] block's destination holds its
    /// bytes, any other may hold anything. A store that reads into buffers of its own (the
    /// disk tier) reads or copies straight into the destination; the default goes through
    /// [`Self::get`] and copies each verified payload.
    fn get_into(
        &mut self,
        keys: &[RemoteKey],
        fingerprint: LayoutFingerprint,
        blocks: &mut [BlockFill<'_, '_>],
    ) -> Vec<Result<Fill, TierError>> {
        fill::through_get(self, keys, fingerprint, blocks)
    }

    /// Writes each value under its key, replacing what was there.
    fn put(&mut self, entries: &[(RemoteKey, Vec<u8>)]) -> Vec<Result<(), TierError>>;

    /// Writes each value, given as its parts, under its key. A store that writes through
    /// buffers of its own (the disk tier) encodes each value straight into them; the
    /// default encodes each into a `Vec` and calls [`Self::put`].
    fn put_parts(&mut self, entries: &[(RemoteKey, ValueParts<'_>)]) -> Vec<Result<(), TierError>> {
        let encoded: Vec<(RemoteKey, Vec<u8>)> = entries
            .iter()
            .map(|(k, v)| (k.clone(), v.encode()))
            .collect();
        self.put(&encoded)
    }

    /// Told that the values under `keys` failed verification: a store that can free their
    /// space (the disk tier) does. The default keeps them (a shared store's values may be
    /// another engine's business).
    fn discard(&mut self, keys: &[RemoteKey]) {
        let _ = keys;
    }

    /// Whether every value `get` returns had its checksum verified by the store
    /// (`value::checksum_ok`), so the tier does not compute it again.
    fn verifies_checksums(&self) -> bool {
        false
    }

    /// The store for logs (addresses without credentials).
    fn describe(&self) -> String;
}

/// A remote tier operation that failed.
///
/// Messages name URLs with their passwords masked.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum TierError {
    /// A namespace that cannot prefix keys.
    #[error("remote tier namespace {namespace:?}: {reason}")]
    BadNamespace {
        /// The namespace given.
        namespace: String,
        /// Why it is rejected.
        reason: &'static str,
    },
    /// A block hash of a length keys do not take.
    #[error("block hash of {len} bytes: keys take 1 to {MAX_HASH_BYTES} bytes")]
    BadHash {
        /// Its length.
        len: usize,
    },
    /// A store URL that cannot be used.
    #[error("remote store URL {url}: {reason}")]
    BadUrl {
        /// The URL, password masked.
        url: String,
        /// Why it is rejected.
        reason: String,
    },
    /// The store could not be reached or refused the credentials.
    #[error("cannot connect to remote store {url}: {reason}")]
    Connect {
        /// The seed URLs, passwords masked.
        url: String,
        /// What the store or the network said.
        reason: String,
    },
    /// A call missed its deadline.
    #[error("remote store {op} missed its {timeout_ms} ms deadline")]
    Timeout {
        /// The operation (`exists`, `get`, `put`, `connect`).
        op: &'static str,
        /// The deadline.
        timeout_ms: u64,
    },
    /// The store turned itself off (the disk tier after repeated I/O errors); said once
    /// by the store, so calls answered this way are counted, not logged.
    #[error("{store} is off")]
    Disabled {
        /// The store, for messages.
        store: String,
    },
    /// The store answered with an error, or the connection broke.
    #[error("remote store {op} failed: {reason}")]
    Store {
        /// The operation.
        op: &'static str,
        /// What went wrong.
        reason: String,
    },
}
