//! The remote tier's bindings: connecting a [`RemoteTier`] for a layout, and the
//! `WorkerTier` class (a worker rank's fetches and write-behind). Decisions are the
//! core's (`offload_core::tier`); this file converts.

use std::sync::Arc;
use std::time::Duration;

use offload_core::tier::config::DEFAULT_REMOTE_NAMESPACE;
use offload_core::tier::disk::{DiskOptions, DiskProbe, DiskStats, DiskStore};
use offload_core::tier::{
    sharing_problem, FetchRequest, KeySpace, KvLayout, RedisStore, RemoteStore, RemoteTier,
    StackedStore, TierSnapshot, TierStats, WorkerTier,
};
use offload_core::transfer::FaultPlan;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyMapping};

use crate::config::PyOffloadConfig;
use crate::convert::type_name;
use crate::errors::{INVALID_INPUT_ERROR, REMOTE_TIER_ERROR};
use crate::transfer::{ids_from_bytes, PyTransferEngine};

/// Bytes of one block hash in the remote tier's keys (the index's 128 bits).
pub(crate) const HASH_BYTES: usize = 16;

/// The write-behind queue's bound with a disk tier and no remote one.
const DEFAULT_MAX_INFLIGHT_BYTES: u64 =
    offload_core::tier::config::DEFAULT_REMOTE_MAX_INFLIGHT_BYTES;

/// A [`KvLayout`] from a mapping with one entry per field.
pub(crate) fn kv_layout(layout: &Bound<'_, PyAny>) -> PyResult<KvLayout> {
    let m = layout.cast::<PyMapping>().map_err(|_| {
        INVALID_INPUT_ERROR.err(format!(
            "layout must be a mapping, got {}",
            type_name(layout)
        ))
    })?;
    let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        m.get_item(k)
            .map_err(|_| INVALID_INPUT_ERROR.err(format!("layout: missing field {k:?}")))
    };
    let s = |k: &str| -> PyResult<String> {
        get(k)?
            .extract()
            .map_err(|_| INVALID_INPUT_ERROR.err(format!("layout: {k} must be a str")))
    };
    let n = |k: &str| -> PyResult<u32> {
        get(k)?.extract().map_err(|_| {
            INVALID_INPUT_ERROR.err(format!("layout: {k} must be an int from 0 to 2**32-1"))
        })
    };
    Ok(KvLayout {
        model_id: s("model_id")?,
        dtype: s("dtype")?,
        block_size: n("block_size")?,
        num_layers: n("num_layers")?,
        num_kv_heads: n("num_kv_heads")?,
        head_size: n("head_size")?,
        tp_rank: n("tp_rank")?,
        tp_size: n("tp_size")?,
        kv_cache_group: n("kv_cache_group")?,
        hash_algo: s("hash_algo")?,
        none_hash_seed: s("none_hash_seed")?,
        weights: s("weights")?,
    })
}

/// Who opens the tiers below the CPU: the scheduler only checks existence (and holds
/// the engine's lock on the disk path); a worker rank owns its disk files.
pub(crate) enum Side<'a> {
    Scheduler,
    Worker {
        /// Bytes of one CPU block on this rank.
        block_bytes: usize,
        /// The rank's disk store, opened once and shared by its fetch and write tiers.
        disk: &'a mut Option<DiskStore>,
        /// Whether the disk records which blocks come and go (KV events).
        report_changes: bool,
    },
}

/// An error unless `config` has a tier below the CPU.
pub(crate) fn check_lower(config: &PyOffloadConfig) -> PyResult<()> {
    let c = &config.inner;
    if c.remote.is_none() && c.disk.is_none() {
        return Err(INVALID_INPUT_ERROR.err(
            "the config has no tier below the CPU (no remote_url, kv_offload_backend not \"disk\")",
        ));
    }
    Ok(())
}

/// The tiers below the CPU for `layout`'s keys: the disk (when configured) in front of
/// the remote store (when configured), connecting (blocking up to its deadline) and
/// opening files now so a bad path or URL is named at start.
pub(crate) fn connect(
    config: &PyOffloadConfig,
    layout: &KvLayout,
    stats: &Arc<TierStats>,
    side: Side<'_>,
) -> PyResult<RemoteTier> {
    let err = |e: offload_core::tier::TierError| REMOTE_TIER_ERROR.err(e.to_string());
    let derr = |e: offload_core::tier::disk::DiskError| REMOTE_TIER_ERROR.err(e.to_string());
    let c = &config.inner;
    let namespace = c
        .remote
        .as_ref()
        .map_or(DEFAULT_REMOTE_NAMESPACE, |r| r.namespace.as_str());
    let keys = KeySpace::new(namespace, layout.fingerprint()).map_err(err)?;
    let disk: Option<Box<dyn RemoteStore>> = match (&c.disk, side) {
        (None, _) => None,
        (Some(d), Side::Scheduler) => {
            // The scheduler probes the keys of rank 0, which writes them (as for Redis).
            let probe = DiskProbe::new(d.rank_path(layout.tp_rank), keys.fingerprint());
            Some(Box::new(probe))
        }
        (
            Some(d),
            Side::Worker {
                block_bytes,
                disk,
                report_changes,
            },
        ) => {
            if disk.is_none() {
                let mut opts = DiskOptions::new(
                    d.rank_path(layout.tp_rank),
                    d.capacity_bytes,
                    block_bytes as u64,
                    keys.fingerprint(),
                );
                opts.use_page_cache = d.use_page_cache;
                opts.persist = d.persist;
                opts.report_changes = report_changes;
                if let Some(spec) = &c.faults {
                    opts.faults = FaultPlan::from_config_value(spec)
                        .map_err(|e| INVALID_INPUT_ERROR.err(e.to_string()))?;
                }
                *disk = Some(DiskStore::open(&opts).map_err(derr)?);
            }
            disk.as_ref()
                .map(|s| Box::new(s.clone()) as Box<dyn RemoteStore>)
        }
    };
    let remote: Option<Box<dyn RemoteStore>> = match &c.remote {
        None => None,
        Some(r) => Some(Box::new(
            RedisStore::connect(&r.seeds, r.timeout()).map_err(err)?,
        )),
    };
    let store: Box<dyn RemoteStore> = match (disk, remote) {
        (Some(d), Some(r)) => Box::new(StackedStore::new(d, r)),
        (Some(one), None) | (None, Some(one)) => one,
        (None, None) => return Err(INVALID_INPUT_ERROR.err("no tier below the CPU configured")),
    };
    Ok(RemoteTier::new(store, keys, Arc::clone(stats)))
}

/// Hashes as the tier's keys take them, from `HASH_BYTES`-byte chunks.
pub(crate) fn hash_chunks(hashes: &[u8], what: &str) -> PyResult<Vec<Vec<u8>>> {
    if hashes.len() % HASH_BYTES != 0 {
        return Err(INVALID_INPUT_ERROR.err(format!(
            "{what}: {} bytes is not a whole number of {HASH_BYTES}-byte hashes",
            hashes.len()
        )));
    }
    Ok(hashes
        .chunks_exact(HASH_BYTES)
        .map(<[u8]>::to_vec)
        .collect())
}

/// Counters of the tier, by name (`remote_` + the field).
pub(crate) fn tier_counters(s: &TierSnapshot) -> Vec<(&'static str, u64)> {
    vec![
        ("remote_probe_round_trips", s.probe_round_trips),
        ("remote_probe_keys", s.probe_keys),
        ("remote_probe_hits", s.probe_hits),
        ("remote_get_round_trips", s.get_round_trips),
        ("remote_get_micros", s.get_micros),
        ("remote_get_hits", s.get_hits),
        ("remote_get_misses", s.get_misses),
        ("remote_corrupt_values", s.corrupt_values),
        ("remote_failed_keys", s.failed_keys),
        ("remote_timeouts", s.timeouts),
        ("remote_writes_queued", s.writes_queued),
        ("remote_writes_dropped", s.writes_dropped),
        ("remote_writes_done", s.writes_done),
        ("remote_writes_failed", s.writes_failed),
        ("remote_bytes_written", s.bytes_written),
        ("remote_bytes_read", s.bytes_read),
    ]
}

/// The key the tiers below the CPU give block `block_hash` (vLLM's bytes) of KV-cache
/// group `group`: the hashes `WorkerTier.take_disk_changes` names.
#[pyfunction]
pub(crate) fn tier_block_hash<'py>(
    py: Python<'py>,
    group: u32,
    block_hash: &[u8],
) -> PyResult<Bound<'py, PyBytes>> {
    let hash = offload_core::BlockHash::from_bytes(block_hash)
        .ok_or_else(|| INVALID_INPUT_ERROR.err("block_hash must not be empty"))?;
    let key = offload_core::BlockKey::new(group, hash).remote_hash();
    Ok(PyBytes::new(py, &key.0.to_le_bytes()))
}

/// Why engines cannot share blocks with this hash setup (with the fix), or `None`.
#[pyfunction]
pub(crate) fn remote_sharing_problem(hash_algo: &str, pythonhashseed_set: bool) -> Option<String> {
    sharing_problem(hash_algo, pythonhashseed_set)
}

/// The remote tier of one worker rank (see `offload_core::tier::WorkerTier`).
#[pyclass(module = "kvoffload._native", name = "WorkerTier")]
#[derive(Debug)]
pub(crate) struct PyWorkerTier {
    inner: WorkerTier,
    disk_stats: Option<Arc<DiskStats>>,
    /// The rank's disk store until shutdown, which must release its files and lock even
    /// while Python still holds this object.
    disk: Option<DiskStore>,
}

#[pymethods]
impl PyWorkerTier {
    /// Connects (twice: fetches and writes run on threads of their own) and starts the
    /// tier over `engine`'s host memory, with the keys of `layout`. With `events`, the
    /// disk records which blocks come and go (`take_disk_changes`).
    #[new]
    #[pyo3(signature = (engine, config, layout, events = false))]
    fn new(
        py: Python<'_>,
        engine: &PyTransferEngine,
        config: &PyOffloadConfig,
        layout: &Bound<'_, PyAny>,
        events: bool,
    ) -> PyResult<Self> {
        check_lower(config)?;
        let layout = kv_layout(layout)?;
        let blocks = engine.inner.host_blocks();
        let c = &config.inner;
        let writes = c.disk.is_some() || c.remote.as_ref().is_some_and(|r| r.write);
        let max_inflight = c
            .remote
            .as_ref()
            .map_or(DEFAULT_MAX_INFLIGHT_BYTES, |r| r.max_inflight_bytes);
        let (inner, disk) = py.detach(|| -> PyResult<(WorkerTier, Option<DiskStore>)> {
            let stats = Arc::new(TierStats::default());
            let block_bytes = blocks.block_bytes();
            let mut disk = None;
            let side = Side::Worker {
                block_bytes,
                disk: &mut disk,
                report_changes: events,
            };
            let fetch = connect(config, &layout, &stats, side)?;
            let write = if writes {
                let side = Side::Worker {
                    block_bytes,
                    disk: &mut disk,
                    report_changes: events,
                };
                Some(connect(config, &layout, &stats, side)?)
            } else {
                None
            };
            let tier = WorkerTier::spawn(blocks, fetch, write, max_inflight).map_err(|e| {
                REMOTE_TIER_ERROR.err(format!("cannot start the tiers below the CPU: {e}"))
            })?;
            Ok((tier, disk))
        })?;
        Ok(Self {
            inner,
            disk_stats: disk.as_ref().map(DiskStore::stats),
            disk,
        })
    }

    /// Whether stored blocks are written to the store.
    #[getter]
    fn writes(&self) -> bool {
        self.inner.writes()
    }

    /// Queues fetch `transfer_id`: blocks `hashes` (16 bytes each) into `cpu_blocks`
    /// (little-endian u32), which the scheduler reserved for it.
    fn fetch(&self, transfer_id: u64, hashes: &[u8], cpu_blocks: &[u8]) -> PyResult<()> {
        let hashes = hash_chunks(hashes, "hashes")?;
        let cpu_blocks = ids_from_bytes(cpu_blocks, "cpu_blocks")?;
        if hashes.len() != cpu_blocks.len() {
            return Err(INVALID_INPUT_ERROR.err(format!(
                "fetch: {} hashes but {} CPU blocks",
                hashes.len(),
                cpu_blocks.len()
            )));
        }
        let req = FetchRequest {
            id: transfer_id,
            hashes,
            cpu_blocks,
        };
        // SAFETY: the scheduler reserved these CPU blocks for this fetch: no load or store
        // names them until every rank reported the fetch (`take_reports`).
        unsafe { self.inner.fetch(req) };
        Ok(())
    }

    /// Fetches finished since the last call: `(transfer_id, leading blocks filled)`.
    fn take_reports(&self) -> Vec<(u64, usize)> {
        self.inner.take_reports()
    }

    /// Offers stored blocks to the write-behind queue; returns how many it took.
    fn write_stored(&self, py: Python<'_>, hashes: &[u8], cpu_blocks: &[u8]) -> PyResult<usize> {
        let hashes = hash_chunks(hashes, "hashes")?;
        let cpu_blocks = ids_from_bytes(cpu_blocks, "cpu_blocks")?;
        let inner = &self.inner;
        // SAFETY: called when the store of these blocks completed and before its
        // completion is reported, so the scheduler cannot have handed them to another copy.
        Ok(py.detach(|| unsafe { inner.write_stored(&hashes, &cpu_blocks) }))
    }

    /// Counters since the start, by name (the disk's, `disk_*`, when there is one).
    fn stats(&self) -> Vec<(&'static str, u64)> {
        let mut out = tier_counters(&self.inner.stats());
        if let Some(d) = &self.disk_stats {
            out.extend(d.snapshot().named());
        }
        out
    }

    /// Blocks that came onto this rank's disk and left it since the last call, as
    /// `(stored, removed)` 16-byte hashes concatenated (empty without a disk, or when not
    /// started with `events`).
    fn take_disk_changes<'py>(
        &self,
        py: Python<'py>,
    ) -> (Bound<'py, PyBytes>, Bound<'py, PyBytes>) {
        let c = self
            .disk
            .as_ref()
            .map(DiskStore::take_changes)
            .unwrap_or_default();
        (
            PyBytes::new(py, c.stored.as_flattened()),
            PyBytes::new(py, c.removed.as_flattened()),
        )
    }

    /// Stops the threads; queued writes get `drain_s` seconds to go out.
    #[pyo3(signature = (drain_s = 1.0))]
    fn shutdown(&mut self, py: Python<'_>, drain_s: f64) -> PyResult<()> {
        let drain = Duration::try_from_secs_f64(drain_s).map_err(|_| {
            INVALID_INPUT_ERROR.err(format!("drain_s must be >= 0 seconds, got {drain_s}"))
        })?;
        let inner = &mut self.inner;
        py.detach(|| inner.shutdown(drain));
        self.disk = None;
        Ok(())
    }
}

/// `hashes` as the remote tier's key bytes, concatenated.
pub(crate) fn hashes_to_bytes<'py>(
    py: Python<'py>,
    hashes: impl IntoIterator<Item = offload_core::BlockHash>,
) -> Bound<'py, PyBytes> {
    let mut buf = Vec::new();
    for h in hashes {
        buf.extend_from_slice(&h.0.to_le_bytes());
    }
    PyBytes::new(py, &buf)
}
