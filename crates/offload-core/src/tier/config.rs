//! The remote tier's keys in `kv_connector_extra_config`, parsed into [`RemoteConfig`].

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use crate::config_value::{parse_bool, parse_bytes, ConfigValue};
use crate::error::ConfigError;

use super::key::validate_namespace;
use super::redis::{parse_seed, redact_url};

/// Key: the store's seed URLs (`redis://` or `rediss://`, several separated by commas);
/// absent means no remote tier.
pub const KEY_REMOTE_URL: &str = "remote_url";
/// Key: prefix of every key, so several deployments can share a store.
pub const KEY_REMOTE_NAMESPACE: &str = "remote_namespace";
/// Key: deadline of every remote call, in milliseconds.
pub const KEY_REMOTE_TIMEOUT_MS: &str = "remote_timeout_ms";
/// Key: whether this engine writes blocks to the store (readers-only replicas say `false`).
pub const KEY_REMOTE_WRITE: &str = "remote_write";
/// Key: bytes the write-behind queue may hold before it drops writes.
pub const KEY_REMOTE_MAX_INFLIGHT_BYTES: &str = "remote_max_inflight_bytes";
/// Every key of the remote tier.
pub(crate) const REMOTE_KEYS: [&str; 5] = [
    KEY_REMOTE_URL,
    KEY_REMOTE_NAMESPACE,
    KEY_REMOTE_TIMEOUT_MS,
    KEY_REMOTE_WRITE,
    KEY_REMOTE_MAX_INFLIGHT_BYTES,
];

/// The namespace when none is given.
pub const DEFAULT_REMOTE_NAMESPACE: &str = "kvoffload";
/// The deadline when none is given: a miss costs at most this much scheduling delay.
pub const DEFAULT_REMOTE_TIMEOUT_MS: u64 = 200;
/// The write-behind queue's bound when none is given: 256 MiB.
pub const DEFAULT_REMOTE_MAX_INFLIGHT_BYTES: u64 = 256 << 20;
const MAX_TIMEOUT_MS: u64 = 60_000;

/// Validated settings of the remote tier.
///
/// `Debug` masks passwords; use [`Self::seeds`] to connect.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RemoteConfig {
    /// Seed URLs, passwords included.
    pub seeds: Vec<String>,
    /// Prefix of every key.
    pub namespace: String,
    /// Deadline of every call.
    pub timeout_ms: u64,
    /// Whether this engine writes blocks.
    pub write: bool,
    /// Bound of the write-behind queue, in payload bytes.
    pub max_inflight_bytes: u64,
}

impl fmt::Debug for RemoteConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let seeds: Vec<String> = self.seeds.iter().map(|s| redact_url(s)).collect();
        f.debug_struct("RemoteConfig")
            .field("seeds", &seeds)
            .field("namespace", &self.namespace)
            .field("timeout_ms", &self.timeout_ms)
            .field("write", &self.write)
            .field("max_inflight_bytes", &self.max_inflight_bytes)
            .finish()
    }
}

impl RemoteConfig {
    /// The deadline of every call.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }

    /// Parses the remote keys of `map`: `None` without a `remote_url`. The other keys are
    /// validated either way, and named in a warning when they have no effect.
    pub(crate) fn from_map(
        map: &BTreeMap<String, ConfigValue>,
        warnings: &mut Vec<String>,
    ) -> Result<Option<Self>, ConfigError> {
        let get = |key: &str| map.get(key).filter(|v| **v != ConfigValue::Null);
        let namespace = match get(KEY_REMOTE_NAMESPACE) {
            None => DEFAULT_REMOTE_NAMESPACE.to_string(),
            Some(ConfigValue::Str(s)) => {
                validate_namespace(s).map_err(|reason| ConfigError::InvalidValue {
                    key: KEY_REMOTE_NAMESPACE.to_string(),
                    value: format!("{s:?}"),
                    reason,
                })?;
                s.clone()
            }
            Some(v) => {
                return Err(ConfigError::WrongType {
                    key: KEY_REMOTE_NAMESPACE.to_string(),
                    expected: "a string",
                    got: v.to_string(),
                })
            }
        };
        let timeout_ms = get(KEY_REMOTE_TIMEOUT_MS)
            .map(parse_timeout)
            .transpose()?
            .unwrap_or(DEFAULT_REMOTE_TIMEOUT_MS);
        let write = get(KEY_REMOTE_WRITE)
            .map(|v| parse_bool(KEY_REMOTE_WRITE, v))
            .transpose()?
            .unwrap_or(true);
        let max_inflight_bytes = get(KEY_REMOTE_MAX_INFLIGHT_BYTES)
            .map(|v| parse_bytes(KEY_REMOTE_MAX_INFLIGHT_BYTES, v))
            .transpose()?
            .unwrap_or(DEFAULT_REMOTE_MAX_INFLIGHT_BYTES);
        let Some(url) = get(KEY_REMOTE_URL) else {
            for key in &REMOTE_KEYS[1..] {
                if get(key).is_some() {
                    warnings.push(format!(
                        "kvoffload config key `{key}` has no effect without `{KEY_REMOTE_URL}`"
                    ));
                }
            }
            return Ok(None);
        };
        Ok(Some(Self {
            seeds: parse_seeds(url)?,
            namespace,
            timeout_ms,
            write,
            max_inflight_bytes,
        }))
    }
}

/// The seeds of `remote_url`: one string of URLs separated by commas (or whitespace), or
/// a list of such strings.
fn parse_seeds(value: &ConfigValue) -> Result<Vec<String>, ConfigError> {
    let wrong_type = || ConfigError::WrongType {
        key: KEY_REMOTE_URL.to_string(),
        expected: "a redis:// or rediss:// URL, several separated by commas, or a list of them",
        got: value.to_string(),
    };
    let parts: Vec<&str> = match value {
        ConfigValue::Str(s) => vec![s.as_str()],
        ConfigValue::List(items) => items
            .iter()
            .map(|v| match v {
                ConfigValue::Str(s) => Ok(s.as_str()),
                _ => Err(wrong_type()),
            })
            .collect::<Result<_, _>>()?,
        _ => return Err(wrong_type()),
    };
    let invalid = |value: String, reason| ConfigError::InvalidValue {
        key: KEY_REMOTE_URL.to_string(),
        value,
        reason,
    };
    let seeds: Vec<String> = parts
        .iter()
        .flat_map(|s| s.split([',', ' ', '\n', '\t']))
        .filter(|p| !p.is_empty())
        .map(str::to_string)
        .collect();
    if seeds.is_empty() {
        let shown = match value {
            ConfigValue::Str(s) => format!("{s:?}"),
            other => other.to_string(),
        };
        return Err(invalid(shown, "names no URL"));
    }
    for seed in &seeds {
        parse_seed(seed).map_err(|e| {
            invalid(
                format!("{:?} ({e})", redact_url(seed)),
                "not a usable redis:// or rediss:// URL",
            )
        })?;
    }
    let tls = |u: &String| u.to_ascii_lowercase().starts_with("rediss://");
    if seeds.iter().any(tls) != seeds.iter().all(tls) {
        let shown: Vec<String> = seeds.iter().map(|u| redact_url(u)).collect();
        return Err(invalid(
            format!("{:?}", shown.join(",")),
            "mixes redis:// and rediss:// seeds; a cluster is reached one way",
        ));
    }
    Ok(seeds)
}

fn parse_timeout(value: &ConfigValue) -> Result<u64, ConfigError> {
    let invalid = || ConfigError::InvalidValue {
        key: KEY_REMOTE_TIMEOUT_MS.to_string(),
        value: value.to_string(),
        reason: "must be a whole number of milliseconds from 1 to 60000",
    };
    let n: i128 = match value {
        ConfigValue::Int(v) => *v,
        ConfigValue::Str(s) => s.trim().parse().map_err(|_| invalid())?,
        _ => {
            return Err(ConfigError::WrongType {
                key: KEY_REMOTE_TIMEOUT_MS.to_string(),
                expected: "an integer number of milliseconds",
                got: value.to_string(),
            })
        }
    };
    u64::try_from(n)
        .ok()
        .filter(|ms| (1..=MAX_TIMEOUT_MS).contains(ms))
        .ok_or_else(invalid)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn parse(
        pairs: &[(&str, ConfigValue)],
    ) -> Result<(Option<RemoteConfig>, Vec<String>), ConfigError> {
        let map = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        let mut warnings = Vec::new();
        RemoteConfig::from_map(&map, &mut warnings).map(|c| (c, warnings))
    }

    fn s(v: &str) -> ConfigValue {
        ConfigValue::Str(v.into())
    }

    #[test]
    fn absent_url_means_no_tier() {
        assert_eq!(parse(&[]).unwrap(), (None, vec![]));
        assert_eq!(
            parse(&[(KEY_REMOTE_URL, ConfigValue::Null)]).unwrap().0,
            None
        );
        let (c, w) = parse(&[(KEY_REMOTE_WRITE, ConfigValue::Bool(false))]).unwrap();
        assert!(c.is_none());
        assert!(
            w[0].contains(KEY_REMOTE_WRITE) && w[0].contains(KEY_REMOTE_URL),
            "{w:?}"
        );
    }

    #[test]
    fn defaults_and_seed_lists() {
        let c = parse(&[(KEY_REMOTE_URL, s("redis://a:7000, redis://b:7001"))])
            .unwrap()
            .0
            .unwrap();
        assert_eq!(c.seeds, vec!["redis://a:7000", "redis://b:7001"]);
        let listed = ConfigValue::List(vec![s("redis://a:7000"), s("redis://b:7001")]);
        let l = parse(&[(KEY_REMOTE_URL, listed)]).unwrap().0.unwrap();
        assert_eq!(l.seeds, c.seeds);
        assert_eq!(c.namespace, DEFAULT_REMOTE_NAMESPACE);
        assert_eq!(
            c.timeout(),
            Duration::from_millis(DEFAULT_REMOTE_TIMEOUT_MS)
        );
        assert!(c.write);
        assert_eq!(c.max_inflight_bytes, DEFAULT_REMOTE_MAX_INFLIGHT_BYTES);
        let c = parse(&[
            (KEY_REMOTE_URL, s("rediss://u:pw@cache:6380")),
            (KEY_REMOTE_NAMESPACE, s("team-a")),
            (KEY_REMOTE_TIMEOUT_MS, ConfigValue::Int(50)),
            (KEY_REMOTE_WRITE, s("false")),
            (KEY_REMOTE_MAX_INFLIGHT_BYTES, ConfigValue::Int(1 << 20)),
        ])
        .unwrap()
        .0
        .unwrap();
        assert_eq!(
            (
                c.namespace.as_str(),
                c.timeout_ms,
                c.write,
                c.max_inflight_bytes
            ),
            ("team-a", 50, false, 1 << 20)
        );
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("pw@") && shown.contains("u:***@"),
            "{shown}"
        );
    }

    #[test]
    fn every_bad_value_names_its_key_and_never_a_password() {
        let bad = [
            (KEY_REMOTE_URL, s("http://x:1")),
            (KEY_REMOTE_URL, s("  , ")),
            (KEY_REMOTE_URL, s("redis://a:1,rediss://b:2")),
            (KEY_REMOTE_URL, s("redis://u:hunter2@")),
            (KEY_REMOTE_URL, ConfigValue::Other("dict".into())),
            (KEY_REMOTE_URL, ConfigValue::List(vec![])),
            (
                KEY_REMOTE_URL,
                ConfigValue::List(vec![s("redis://a:1"), ConfigValue::Int(7)]),
            ),
            (KEY_REMOTE_NAMESPACE, s("a{b}")),
            (KEY_REMOTE_NAMESPACE, ConfigValue::Int(3)),
            (KEY_REMOTE_TIMEOUT_MS, ConfigValue::Int(0)),
            (KEY_REMOTE_TIMEOUT_MS, ConfigValue::Int(60_001)),
            (KEY_REMOTE_TIMEOUT_MS, s("fast")),
            (KEY_REMOTE_TIMEOUT_MS, ConfigValue::Float(1.5)),
            (KEY_REMOTE_WRITE, s("maybe")),
            (KEY_REMOTE_MAX_INFLIGHT_BYTES, ConfigValue::Int(-1)),
        ];
        for (key, v) in bad {
            let mut pairs = vec![(key, v.clone())];
            if key != KEY_REMOTE_URL {
                pairs.push((KEY_REMOTE_URL, s("redis://h:1")));
            }
            let msg = parse(&pairs).unwrap_err().to_string();
            assert!(msg.contains(key), "{msg}");
            assert!(!msg.contains("hunter2"), "{msg}");
        }
    }
}
