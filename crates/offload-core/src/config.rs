//! [`OffloadConfig`]: the connector's settings, parsed from `kv_connector_extra_config`.

use std::collections::BTreeMap;

pub use crate::config_value::ConfigValue;
use crate::config_value::{parse_bool, parse_bytes};
use crate::error::ConfigError;
use crate::tier::disk::DiskConfig;
use crate::tier::{parse_kv_cache_version, RemoteConfig, KEY_KV_CACHE_VERSION};

/// Key: total CPU bytes for offloaded KV across all ranks.
pub const KEY_CPU_BYTES: &str = "cpu_bytes_to_use";
/// Key: CPU bytes for offloaded KV on each rank; wins over [`KEY_CPU_BYTES`].
pub const KEY_CPU_BYTES_PER_RANK: &str = "cpu_bytes_to_use_per_rank";
/// Key: store blocks only when they near eviction from the GPU instead of eagerly.
pub const KEY_LAZY: &str = "lazy_offload";
/// Key: how loads are scheduled: `"auto"`, `"sync"` or `"async"` (see [`LoadMode`]).
pub const KEY_LOAD_MODE: &str = "load_mode";
/// Key: the KV cache layout the connector asks vLLM for (see [`KvCacheLayout`]).
pub const KEY_KV_CACHE_LAYOUT: &str = "kv_cache_layout";
/// Key (tests only): faults to inject into the copy engine. Kept here as the raw string
/// [`OffloadConfig::faults`]; the transfer engine, which owns fault injection, parses it
/// (`FaultPlan::from_config_value`).
pub const KEY_FAULTS: &str = "kvoffload.faults";

/// When a load from CPU completes relative to the request that needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadMode {
    /// Synchronous where KV lives in host memory (a load is a memcpy), else asynchronous.
    #[default]
    Auto,
    /// The request runs in the step of its load; workers finish the copy before the
    /// forward pass.
    Sync,
    /// The request waits until the load completed; copies overlap other requests' compute.
    Async,
}

impl LoadMode {
    /// Whether loads are synchronous, given where the KV cache lives.
    pub fn is_sync(self, kv_in_host_memory: bool) -> bool {
        match self {
            Self::Auto => kv_in_host_memory,
            Self::Sync => true,
            Self::Async => false,
        }
    }
}

/// Which KV cache layout the connector asks vLLM for.
///
/// vLLM lays the KV cache of every layer out in one allocation, in an order named after
/// its axes (L layer, B block, H head, N token, C content). Where B is outermost
/// (`BLNHC`, `BLHNC`), one block of every layer is one contiguous run of bytes, so
/// offloading a block is one copy instead of one per layer. vLLM uses the request only
/// where every attention backend supports it, and `VLLM_KV_CACHE_LAYOUT` overrides it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KvCacheLayout {
    /// Block-outermost on GPUs; on vLLM's CPU backend (which supports one layout) nothing.
    #[default]
    Auto,
    /// Ask for nothing: the attention backend's preference stands.
    Engine,
    /// One of vLLM's layout names (upper case), e.g. `"BLNHC"`.
    Named(String),
}

/// The default total budget when neither byte key is given: 8 GiB.
pub const DEFAULT_CPU_BYTES: u64 = 8 << 30;

/// Validated offload settings for one rank.
///
/// # Examples
/// ```
/// use std::collections::BTreeMap;
/// use offload_core::{ConfigValue, OffloadConfig};
///
/// let mut map = BTreeMap::new();
/// map.insert("cpu_bytes_to_use".to_string(), ConfigValue::Int(4 << 30));
/// map.insert("lazy_offload".to_string(), ConfigValue::Bool(true));
/// let parsed = OffloadConfig::from_map(&map, 2).unwrap();
/// assert_eq!(parsed.config.cpu_bytes_per_rank, 2 << 30);
/// assert!(parsed.config.lazy_offload);
/// assert!(parsed.warnings.is_empty());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OffloadConfig {
    /// Bytes of host memory this rank may use for offloaded blocks.
    pub cpu_bytes_per_rank: u64,
    /// Lazy mode: offload blocks as they near eviction from the GPU.
    pub lazy_offload: bool,
    /// When loads complete relative to the requests that need them.
    pub load_mode: LoadMode,
    /// The fault-injection spec for copies (tests), unparsed: the transfer engine owns its
    /// meaning. `None` injects nothing.
    pub faults: Option<String>,
    /// Number of ranks that must report a store before its blocks are published.
    pub world_size: u32,
    /// The remote tier, `None` without `remote_url`.
    pub remote: Option<RemoteConfig>,
    /// The disk tier, `None` unless `kv_offload_backend` is `"disk"`.
    pub disk: Option<DiskConfig>,
    /// The KV cache layout to ask vLLM for.
    pub kv_cache_layout: KvCacheLayout,
    /// The operator's version of the weights (`kv_cache_version`), part of the keys of
    /// every tier that outlives the engine; `None` when not set.
    pub kv_cache_version: Option<String>,
}

/// The result of parsing: the config plus warnings the caller should log.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParsedConfig {
    /// The validated config.
    pub config: OffloadConfig,
    /// Non-fatal findings (unknown keys, disagreeing byte budgets).
    pub warnings: Vec<String>,
}

impl OffloadConfig {
    /// Parses and validates the connector's extra config for one rank of `world_size`.
    ///
    /// Unknown keys produce warnings, never errors, so configs written for other
    /// offloaders keep working; keys starting with `kvoffload.` are reserved for
    /// this crate's callers (test switches) and are passed over silently.
    pub fn from_map(
        map: &BTreeMap<String, ConfigValue>,
        world_size: u32,
    ) -> Result<ParsedConfig, ConfigError> {
        if world_size == 0 {
            return Err(ConfigError::InvalidGeometry {
                what: "world_size",
                value: 0,
                reason: "must be at least 1",
            });
        }
        let mut warnings = Vec::new();
        let total = map
            .get(KEY_CPU_BYTES)
            .filter(|v| **v != ConfigValue::Null)
            .map(|v| parse_bytes(KEY_CPU_BYTES, v))
            .transpose()?;
        let per_rank = map
            .get(KEY_CPU_BYTES_PER_RANK)
            .filter(|v| **v != ConfigValue::Null)
            .map(|v| parse_bytes(KEY_CPU_BYTES_PER_RANK, v))
            .transpose()?;
        let lazy_offload = match map.get(KEY_LAZY) {
            None | Some(ConfigValue::Null) => false,
            Some(v) => parse_bool(KEY_LAZY, v)?,
        };
        let load_mode = match map.get(KEY_LOAD_MODE) {
            None | Some(ConfigValue::Null) => LoadMode::Auto,
            Some(v) => parse_load_mode(v)?,
        };
        let kv_cache_layout = match map.get(KEY_KV_CACHE_LAYOUT) {
            None | Some(ConfigValue::Null) => KvCacheLayout::Auto,
            Some(v) => parse_kv_cache_layout(v)?,
        };
        let faults = match map.get(KEY_FAULTS) {
            None | Some(ConfigValue::Null) => None,
            Some(ConfigValue::Str(spec)) if spec.trim().is_empty() => None,
            Some(ConfigValue::Str(spec)) => Some(spec.clone()),
            Some(v) => {
                return Err(ConfigError::WrongType {
                    key: KEY_FAULTS.to_string(),
                    expected: "a string like \"fail_loads_every=3,delay_ms=5\"",
                    got: v.to_string(),
                })
            }
        };
        let kv_cache_version = match map.get(KEY_KV_CACHE_VERSION) {
            None | Some(ConfigValue::Null) => None,
            Some(v) => Some(parse_kv_cache_version(v)?),
        };
        let remote = RemoteConfig::from_map(map, &mut warnings)?;
        let disk = DiskConfig::from_map(map, total.is_some() || per_rank.is_some(), &mut warnings)?;
        let cpu_bytes_per_rank = match (per_rank, total) {
            (Some(p), Some(t)) => {
                let split = t / u64::from(world_size);
                if split != p {
                    warnings.push(format!(
                        "{KEY_CPU_BYTES_PER_RANK}={p} disagrees with {KEY_CPU_BYTES}={t} \
                         split over {world_size} rank(s) ({split}); using {p} per rank"
                    ));
                }
                p
            }
            (Some(p), None) => p,
            (None, Some(t)) => split_total(t, world_size)?,
            // The disk tier without a CPU budget: host memory only stages, sized by
            // `stage_for` once the block size is known.
            (None, None) if disk.is_some() => 0,
            (None, None) => split_total(DEFAULT_CPU_BYTES, world_size)?,
        };
        for key in map.keys() {
            let known = [
                KEY_CPU_BYTES,
                KEY_CPU_BYTES_PER_RANK,
                KEY_LAZY,
                KEY_LOAD_MODE,
                KEY_KV_CACHE_LAYOUT,
                KEY_KV_CACHE_VERSION,
            ];
            if !known.contains(&key.as_str())
                && !crate::tier::config::REMOTE_KEYS.contains(&key.as_str())
                && !crate::tier::disk::config::DISK_KEYS.contains(&key.as_str())
                && !key.starts_with("kvoffload.")
            {
                warnings.push(format!("unknown kvoffload config key `{key}` is ignored"));
            }
        }
        for w in &warnings {
            log::warn!("{w}");
        }
        Ok(ParsedConfig {
            config: Self {
                cpu_bytes_per_rank,
                lazy_offload,
                load_mode,
                faults,
                world_size,
                remote,
                disk,
                kv_cache_layout,
                kv_cache_version,
            },
            warnings,
        })
    }

    /// Whether host memory only stages the disk tier (`kv_offload_backend` `"disk"`
    /// without a CPU budget, as Simple's disk mode).
    pub fn cpu_stages_only(&self) -> bool {
        self.disk.as_ref().is_some_and(|d| !d.cpu_in_front)
    }

    /// Sizes the staging pool when host memory only stages the disk: the larger of
    /// `disk_buffer_slots` and `serve_blocks` (the blocks one request's hit needs at once,
    /// since a disk hit is brought into CPU blocks before it loads) blocks of
    /// `bytes_per_block`. Does nothing otherwise.
    pub fn stage_for(&mut self, serve_blocks: u32, bytes_per_block: u64) {
        if let Some(d) = self.disk.as_ref().filter(|d| !d.cpu_in_front) {
            let blocks = u64::from(d.buffer_slots.max(serve_blocks));
            self.cpu_bytes_per_rank = blocks.saturating_mul(bytes_per_block);
        }
    }

    /// How many CPU blocks of `bytes_per_block` fit this rank's budget.
    ///
    /// Scheduler and workers both call this with the same per-block size, so neither
    /// plans past what the other allocated.
    pub fn num_cpu_blocks(&self, bytes_per_block: u64) -> Result<u32, ConfigError> {
        if bytes_per_block == 0 {
            return Err(ConfigError::InvalidGeometry {
                what: "bytes_per_block",
                value: 0,
                reason: "a KV block cannot be empty",
            });
        }
        let n = self.cpu_bytes_per_rank / bytes_per_block;
        // Block ids are u32 with one value reserved as a list sentinel.
        Ok(u32::try_from(n).unwrap_or(u32::MAX - 1).min(u32::MAX - 1))
    }
}

fn split_total(total: u64, world_size: u32) -> Result<u64, ConfigError> {
    let per_rank = total / u64::from(world_size);
    if per_rank == 0 {
        return Err(ConfigError::InvalidValue {
            key: KEY_CPU_BYTES.to_string(),
            value: total.to_string(),
            reason: "less than one byte per rank after splitting over the world size",
        });
    }
    Ok(per_rank)
}

fn parse_load_mode(value: &ConfigValue) -> Result<LoadMode, ConfigError> {
    match value {
        ConfigValue::Str(s) => match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(LoadMode::Auto),
            "sync" => Ok(LoadMode::Sync),
            "async" => Ok(LoadMode::Async),
            _ => Err(ConfigError::InvalidValue {
                key: KEY_LOAD_MODE.to_string(),
                value: value.to_string(),
                reason: "must be \"auto\", \"sync\" or \"async\"",
            }),
        },
        _ => Err(ConfigError::WrongType {
            key: KEY_LOAD_MODE.to_string(),
            expected: "one of the strings \"auto\", \"sync\", \"async\"",
            got: value.to_string(),
        }),
    }
}

fn parse_kv_cache_layout(value: &ConfigValue) -> Result<KvCacheLayout, ConfigError> {
    let ConfigValue::Str(s) = value else {
        return Err(ConfigError::WrongType {
            key: KEY_KV_CACHE_LAYOUT.to_string(),
            expected: "a string: \"auto\", \"engine\" or a vLLM layout name like \"BLNHC\"",
            got: value.to_string(),
        });
    };
    let name = s.trim();
    match name.to_ascii_lowercase().as_str() {
        "auto" => return Ok(KvCacheLayout::Auto),
        "engine" => return Ok(KvCacheLayout::Engine),
        _ => {}
    }
    let upper = name.to_ascii_uppercase();
    let mut axes: Vec<char> = upper.chars().collect();
    axes.sort_unstable();
    if axes != ['B', 'C', 'H', 'L', 'N'] {
        return Err(ConfigError::InvalidValue {
            key: KEY_KV_CACHE_LAYOUT.to_string(),
            value: value.to_string(),
            reason: "must be \"auto\", \"engine\" or a vLLM layout name: the axes L, B, H, \
                     N, C once each, e.g. \"BLNHC\"",
        });
    }
    Ok(KvCacheLayout::Named(upper))
}

#[cfg(test)]
mod tests;
