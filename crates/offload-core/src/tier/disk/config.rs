//! The disk tier's keys in `kv_connector_extra_config`, parsed into [`DiskConfig`].
//!
//! The keys and their defaults are those of vLLM 0.32's `SimpleCPUOffloadConnector`, so a
//! config written for it works unchanged; `disk_persist` is kvoffload's own.

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::config_value::{parse_bool, parse_bytes, ConfigValue};
use crate::error::ConfigError;

/// Key: `"cpu"` (no disk tier) or `"disk"`.
pub const KEY_BACKEND: &str = "kv_offload_backend";
/// Key: path prefix of the tier's files; each rank uses `<disk_path>.rank_<N>`.
pub const KEY_DISK_PATH: &str = "disk_path";
/// Key: bytes of disk each rank may use, reserved at start.
pub const KEY_DISK_CAPACITY: &str = "disk_capacity_bytes";
/// Key: blocks of host memory staging the disk when `cpu_bytes_to_use` is not given.
pub const KEY_DISK_BUFFER_SLOTS: &str = "disk_buffer_slots";
/// Key: buffered I/O through the page cache instead of `O_DIRECT`.
pub const KEY_USE_PAGE_CACHE: &str = "use_page_cache";
/// Key: keep the files at shutdown and serve them after a restart.
pub const KEY_DISK_PERSIST: &str = "disk_persist";
/// Every key of the disk tier.
pub(crate) const DISK_KEYS: [&str; 6] = [
    KEY_BACKEND,
    KEY_DISK_PATH,
    KEY_DISK_CAPACITY,
    KEY_DISK_BUFFER_SLOTS,
    KEY_USE_PAGE_CACHE,
    KEY_DISK_PERSIST,
];

/// Simple's default capacity per rank: 100 GiB.
pub const DEFAULT_DISK_CAPACITY_BYTES: u64 = 100 << 30;
/// Simple's default staging slots.
pub const DEFAULT_DISK_BUFFER_SLOTS: u32 = 2;

/// Validated settings of the disk tier.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DiskConfig {
    /// Path prefix of the files (`<path>.rank_<N>`).
    pub path: PathBuf,
    /// Bytes of disk per rank, files included.
    pub capacity_bytes: u64,
    /// Staging blocks when the CPU tier is staging only.
    pub buffer_slots: u32,
    /// Buffered I/O instead of `O_DIRECT`.
    pub use_page_cache: bool,
    /// Keep blocks across restarts.
    pub persist: bool,
    /// Whether `cpu_bytes_to_use` (or its per-rank form) was given: the CPU tier then
    /// sits in front of the disk at that size; without it, host memory only stages.
    pub cpu_in_front: bool,
}

impl DiskConfig {
    /// The files of tensor-parallel rank `rank`: `<disk_path>.rank_<rank>` (as Simple
    /// names them).
    pub fn rank_path(&self, rank: u32) -> PathBuf {
        let mut p = self.path.clone().into_os_string();
        p.push(format!(".rank_{rank}"));
        PathBuf::from(p)
    }

    /// Parses the disk keys of `map`: `None` unless `kv_offload_backend` is `"disk"`.
    /// `cpu_given` says whether a CPU byte budget was set. Disk keys under `"cpu"` are
    /// named in a warning, as Simple does.
    pub(crate) fn from_map(
        map: &BTreeMap<String, ConfigValue>,
        cpu_given: bool,
        warnings: &mut Vec<String>,
    ) -> Result<Option<Self>, ConfigError> {
        let get = |key: &str| map.get(key).filter(|v| **v != ConfigValue::Null);
        let disk = match get(KEY_BACKEND) {
            None => false,
            Some(ConfigValue::Str(s)) if s == "cpu" => false,
            Some(ConfigValue::Str(s)) if s == "disk" => true,
            Some(v @ ConfigValue::Str(_)) => {
                return Err(ConfigError::InvalidValue {
                    key: KEY_BACKEND.to_string(),
                    value: v.to_string(),
                    reason: "expected \"cpu\" or \"disk\"",
                })
            }
            Some(v) => {
                return Err(ConfigError::WrongType {
                    key: KEY_BACKEND.to_string(),
                    expected: "\"cpu\" or \"disk\"",
                    got: v.to_string(),
                })
            }
        };
        let capacity_bytes = get(KEY_DISK_CAPACITY)
            .map(|v| parse_bytes(KEY_DISK_CAPACITY, v))
            .transpose()?
            .unwrap_or(DEFAULT_DISK_CAPACITY_BYTES);
        let buffer_slots = match get(KEY_DISK_BUFFER_SLOTS) {
            None => DEFAULT_DISK_BUFFER_SLOTS,
            Some(v) => parse_slots(v)?,
        };
        let use_page_cache = get(KEY_USE_PAGE_CACHE)
            .map(|v| parse_bool(KEY_USE_PAGE_CACHE, v))
            .transpose()?
            .unwrap_or(false);
        let persist = get(KEY_DISK_PERSIST)
            .map(|v| parse_bool(KEY_DISK_PERSIST, v))
            .transpose()?
            .unwrap_or(false);
        let path = match get(KEY_DISK_PATH) {
            None => None,
            // Simple treats an empty path as none.
            Some(ConfigValue::Str(s)) if s.is_empty() => None,
            Some(ConfigValue::Str(s)) => Some(PathBuf::from(s)),
            Some(v) => {
                return Err(ConfigError::WrongType {
                    key: KEY_DISK_PATH.to_string(),
                    expected: "a path (string)",
                    got: v.to_string(),
                })
            }
        };
        if !disk {
            let ignored: Vec<&str> = DISK_KEYS[1..]
                .iter()
                .copied()
                .filter(|k| get(k).is_some())
                .collect();
            if !ignored.is_empty() {
                warnings.push(format!(
                    "kv_offload_backend is \"cpu\", ignoring disk-only config: {}; set \
                     kv_offload_backend=\"disk\" to enable the disk tier",
                    ignored.join(", ")
                ));
            }
            return Ok(None);
        }
        let Some(path) = path else {
            return Err(ConfigError::InvalidValue {
                key: KEY_DISK_PATH.to_string(),
                value: "None".to_string(),
                reason: "kv_offload_backend \"disk\" needs a disk_path",
            });
        };
        if capacity_bytes == 0 {
            return Err(ConfigError::InvalidValue {
                key: KEY_DISK_CAPACITY.to_string(),
                value: "0".to_string(),
                reason: "kv_offload_backend \"disk\" needs disk_capacity_bytes > 0",
            });
        }
        Ok(Some(Self {
            path,
            capacity_bytes,
            buffer_slots,
            use_page_cache,
            persist,
            cpu_in_front: cpu_given,
        }))
    }
}

/// `disk_buffer_slots`: Simple clamps values below 1 to 1, so a copied config that says 0
/// keeps working; anything but an integer is refused.
fn parse_slots(value: &ConfigValue) -> Result<u32, ConfigError> {
    let n = match value {
        ConfigValue::Int(n) => *n,
        ConfigValue::Str(s) => s
            .trim()
            .parse::<i128>()
            .map_err(|_| ConfigError::InvalidValue {
                key: KEY_DISK_BUFFER_SLOTS.to_string(),
                value: value.to_string(),
                reason: "not an integer",
            })?,
        v => {
            return Err(ConfigError::WrongType {
                key: KEY_DISK_BUFFER_SLOTS.to_string(),
                expected: "an integer number of blocks",
                got: v.to_string(),
            })
        }
    };
    u32::try_from(n.max(1)).map_err(|_| ConfigError::InvalidValue {
        key: KEY_DISK_BUFFER_SLOTS.to_string(),
        value: value.to_string(),
        reason: "too large",
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn parse(items: &[(&str, ConfigValue)]) -> Result<Option<DiskConfig>, ConfigError> {
        let map = items
            .iter()
            .map(|(k, v)| ((*k).to_string(), v.clone()))
            .collect();
        DiskConfig::from_map(&map, false, &mut Vec::new())
    }

    #[test]
    fn simple_disk_config_parses_with_simple_defaults() {
        let c = parse(&[
            (KEY_BACKEND, ConfigValue::Str("disk".into())),
            (KEY_DISK_PATH, ConfigValue::Str("/nvme/kv".into())),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(c.capacity_bytes, DEFAULT_DISK_CAPACITY_BYTES);
        assert_eq!(c.buffer_slots, 2);
        assert!(!c.use_page_cache && !c.persist && !c.cpu_in_front);
        assert_eq!(c.rank_path(3), PathBuf::from("/nvme/kv.rank_3"));
    }

    #[test]
    fn bad_values_name_their_key() {
        let err = parse(&[(KEY_BACKEND, ConfigValue::Str("nvme".into()))]).unwrap_err();
        assert!(err.to_string().contains(KEY_BACKEND), "{err}");
        assert!(err.to_string().contains("nvme"), "{err}");
        let err = parse(&[(KEY_BACKEND, ConfigValue::Str("disk".into()))]).unwrap_err();
        assert!(err.to_string().contains(KEY_DISK_PATH), "{err}");
        let err = parse(&[
            (KEY_BACKEND, ConfigValue::Str("disk".into())),
            (KEY_DISK_PATH, ConfigValue::Str("/x".into())),
            (KEY_DISK_CAPACITY, ConfigValue::Int(0)),
        ])
        .unwrap_err();
        assert!(err.to_string().contains(KEY_DISK_CAPACITY), "{err}");
        let err = parse(&[(KEY_USE_PAGE_CACHE, ConfigValue::Int(7))]).unwrap_err();
        assert!(err.to_string().contains(KEY_USE_PAGE_CACHE), "{err}");
        let err = parse(&[(KEY_DISK_BUFFER_SLOTS, ConfigValue::Bool(true))]).unwrap_err();
        assert!(err.to_string().contains(KEY_DISK_BUFFER_SLOTS), "{err}");
    }

    #[test]
    fn disk_keys_under_cpu_warn_and_slots_clamp_like_simple() {
        let mut warnings = Vec::new();
        let map = [(KEY_DISK_PATH.to_string(), ConfigValue::Str("/x".into()))]
            .into_iter()
            .collect();
        assert!(DiskConfig::from_map(&map, false, &mut warnings)
            .unwrap()
            .is_none());
        assert!(warnings[0].contains(KEY_DISK_PATH), "{warnings:?}");
        assert_eq!(parse_slots(&ConfigValue::Int(0)).unwrap(), 1);
    }
}
