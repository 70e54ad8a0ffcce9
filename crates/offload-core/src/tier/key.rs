//! Remote keys: an operator namespace, a fingerprint of everything that decides what a
//! block's bytes mean, and the server's full block hash.
//!
//! Two engines may share a block only when both its hash and its layout agree: the same
//! tokens give the same hash under another model, dtype or tensor-parallel rank, but other
//! bytes. The fingerprint keeps such blocks apart; the value header repeats it, so a value
//! that lands under the wrong key anyway is never loaded.

use std::fmt;

use super::checksum::checksum;
use super::TierError;
use crate::config::ConfigValue;
use crate::error::ConfigError;

/// The longest block hash a key takes (vLLM's are 32 bytes for sha256, 8 for xxhash).
pub const MAX_HASH_BYTES: usize = 64;
/// The longest namespace accepted.
pub(crate) const MAX_NAMESPACE_BYTES: usize = 128;
/// vLLM's `NONE_HASH` seed when `PYTHONHASHSEED` is unset and the hash is cryptographic.
pub const DEFAULT_NONE_HASH_SEED: &str = "vllm-none-hash";
/// Key: the operator's version of the weights, part of every persisted or shared block's
/// key ([`KvLayout::weights`]): bump it after updating weights in place (RL), where the
/// checkpoint files on disk do not change.
pub const KEY_KV_CACHE_VERSION: &str = "kv_cache_version";
/// The longest `kv_cache_version` accepted.
const MAX_KV_CACHE_VERSION_BYTES: usize = 128;

/// Parses `kv_cache_version`: a string of 1 to 128 characters from `A-Z a-z 0-9 . _ - + : /`,
/// or a non-negative integer (a training step), kept as its decimal digits.
pub fn parse_kv_cache_version(value: &ConfigValue) -> Result<String, ConfigError> {
    let text = match value {
        ConfigValue::Str(s) => s.clone(),
        ConfigValue::Int(n) if *n >= 0 => n.to_string(),
        ConfigValue::Int(_) => {
            return Err(ConfigError::InvalidValue {
                key: KEY_KV_CACHE_VERSION.to_string(),
                value: value.to_string(),
                reason: "must not be negative",
            })
        }
        other => {
            return Err(ConfigError::WrongType {
                key: KEY_KV_CACHE_VERSION.to_string(),
                expected: "a string (e.g. \"step-1200\") or a non-negative integer",
                got: other.to_string(),
            })
        }
    };
    let allowed = |c: char| c.is_ascii_alphanumeric() || "._-+:/".contains(c);
    let reason = if text.is_empty() {
        Some("must not be empty")
    } else if text.len() > MAX_KV_CACHE_VERSION_BYTES {
        Some("longer than 128 characters")
    } else if !text.chars().all(allowed) {
        Some("only A-Z a-z 0-9 . _ - + : / are allowed")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(ConfigError::InvalidValue {
            key: KEY_KV_CACHE_VERSION.to_string(),
            value: value.to_string(),
            reason,
        }),
        None => Ok(text),
    }
}

/// Bumped when the key layout or the value format changes, so old and new engines never
/// read each other: in a rolling upgrade on one shared store, each would otherwise reject
/// the other's values as another format and overwrite them (v2: value format 2).
const KEY_VERSION: &str = "v2";

/// Everything that decides what a KV block's bytes mean on one rank.
///
/// # Examples
/// ```
/// use offload_core::tier::KvLayout;
///
/// let rank0 = KvLayout {
///     model_id: "Qwen/Qwen3-0.6B".into(),
///     dtype: "bfloat16".into(),
///     block_size: 16,
///     num_layers: 28,
///     num_kv_heads: 8,
///     head_size: 128,
///     tp_rank: 0,
///     tp_size: 2,
///     kv_cache_group: 0,
///     hash_algo: "sha256".into(),
///     none_hash_seed: "vllm-none-hash".into(),
///     weights: "checkpoint:5f1c...".into(),
/// };
/// let rank1 = KvLayout { tp_rank: 1, ..rank0.clone() };
/// assert_ne!(rank0.fingerprint(), rank1.fingerprint());
/// // Other weights under the same name (a fine-tune, an RL update): other keys.
/// let updated = KvLayout { weights: "checkpoint:5f1c...|kv_cache_version=7".into(), ..rank0.clone() };
/// assert_ne!(rank0.fingerprint(), updated.fingerprint());
/// assert_eq!(rank0.fingerprint(), rank0.clone().fingerprint());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLayout {
    /// The model (vLLM's `model_config.model`, or the served name).
    pub model_id: String,
    /// The KV cache dtype as the server names it (`"bfloat16"`, `"fp8_e4m3"`).
    pub dtype: String,
    /// Tokens per block.
    pub block_size: u32,
    /// Layers whose KV a block holds.
    pub num_layers: u32,
    /// KV heads on this rank's shard.
    pub num_kv_heads: u32,
    /// Elements per head.
    pub head_size: u32,
    /// This rank within tensor parallelism.
    pub tp_rank: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// vLLM's KV-cache group id.
    pub kv_cache_group: u32,
    /// vLLM's `prefix_caching_hash_algo` (`"sha256"`, `"sha256_cbor"`, `"xxhash"`, ...).
    pub hash_algo: String,
    /// The seed vLLM derived `NONE_HASH` from (`kv_cache_utils.get_none_hash_seed()`).
    pub none_hash_seed: String,
    /// Which weights computed the KV: a digest of the checkpoint's files (names, sizes,
    /// headers, sampled bytes) and the operator's `kv_cache_version`, so a tier that
    /// outlives the engine never serves blocks of other weights under the same name.
    pub weights: String,
}

/// A 128-bit digest of a [`KvLayout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayoutFingerprint(pub u128);

impl fmt::Display for LayoutFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl KvLayout {
    /// The layout's fingerprint. Fields are length-prefixed, so no two layouts encode
    /// to the same bytes.
    pub fn fingerprint(&self) -> LayoutFingerprint {
        let mut buf = Vec::with_capacity(128);
        for s in [
            &self.model_id,
            &self.dtype,
            &self.hash_algo,
            &self.none_hash_seed,
            &self.weights,
        ] {
            buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
            buf.extend_from_slice(s.as_bytes());
        }
        for n in [
            self.block_size,
            self.num_layers,
            self.num_kv_heads,
            self.head_size,
            self.tp_rank,
            self.tp_size,
            self.kv_cache_group,
        ] {
            buf.extend_from_slice(&n.to_le_bytes());
        }
        let lo = checksum(0x6b76_6f66_666c_6f61, &[&buf]);
        let hi = checksum(0x6c61_796f_7574_2d66, &[&buf]);
        LayoutFingerprint(u128::from(hi) << 64 | u128::from(lo))
    }
}

/// Why block hashes cannot agree across engines with this hash setup, with the fix; `None`
/// when they can.
///
/// vLLM chains every block hash from `NONE_HASH`. A cryptographic algorithm uses a fixed
/// default seed unless `PYTHONHASHSEED` is set; a non-cryptographic one draws a random seed
/// per process when it is unset, so no two engines ever produce the same hashes.
pub fn sharing_problem(hash_algo: &str, pythonhashseed_set: bool) -> Option<String> {
    let non_crypto = matches!(hash_algo, "xxhash" | "xxhash_cbor");
    (non_crypto && !pythonhashseed_set).then(|| {
        format!(
            "kvoffload: the remote tier cannot share blocks between engines: \
             prefix_caching_hash_algo={hash_algo} without PYTHONHASHSEED seeds block hashes \
             randomly per process. Set PYTHONHASHSEED to the same value on every engine, or \
             use prefix_caching_hash_algo=sha256"
        )
    })
}

/// Builds the keys of one engine rank: `{namespace}:v2:{fingerprint}:{hash}` in hex.
///
/// Keys carry no `{...}` hash tag, so Redis Cluster spreads blocks over all masters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySpace {
    prefix: String,
    fingerprint: LayoutFingerprint,
}

impl KeySpace {
    /// Keys under `namespace` for blocks of a layout with `fingerprint`.
    pub fn new(namespace: &str, fingerprint: LayoutFingerprint) -> Result<Self, TierError> {
        validate_namespace(namespace).map_err(|reason| TierError::BadNamespace {
            namespace: namespace.to_string(),
            reason,
        })?;
        Ok(Self {
            prefix: format!("{namespace}:{KEY_VERSION}:{fingerprint}:"),
            fingerprint,
        })
    }

    /// The layout fingerprint values under these keys must carry.
    pub fn fingerprint(&self) -> LayoutFingerprint {
        self.fingerprint
    }

    /// The key of the block whose full hash is `hash`.
    pub fn key(&self, hash: &[u8]) -> Result<RemoteKey, TierError> {
        if hash.is_empty() || hash.len() > MAX_HASH_BYTES {
            return Err(TierError::BadHash { len: hash.len() });
        }
        let mut key = String::with_capacity(self.prefix.len() + 2 * hash.len());
        key.push_str(&self.prefix);
        for b in hash {
            key.push(char::from(HEX[usize::from(b >> 4)]));
            key.push(char::from(HEX[usize::from(b & 15)]));
        }
        Ok(RemoteKey(key))
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Why `namespace` cannot prefix keys, if it cannot.
pub(crate) fn validate_namespace(namespace: &str) -> Result<(), &'static str> {
    if namespace.is_empty() {
        return Err("must not be empty");
    }
    if namespace.len() > MAX_NAMESPACE_BYTES {
        return Err("longer than 128 bytes");
    }
    if namespace.contains(['{', '}']) {
        // A hash tag would put every block of the model on one master.
        return Err("must not contain '{' or '}' (a Redis Cluster hash tag)");
    }
    if !namespace
        .chars()
        .all(|c| c.is_ascii_graphic() && c != '"' && c != '\\')
    {
        return Err("must be printable ASCII without spaces, quotes or backslashes");
    }
    Ok(())
}

/// A key in the remote store.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RemoteKey(String);

impl RemoteKey {
    /// The key as the store sees it.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RemoteKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            model_id: "m".into(),
            dtype: "bfloat16".into(),
            block_size: 16,
            num_layers: 2,
            num_kv_heads: 4,
            head_size: 64,
            tp_rank: 0,
            tp_size: 1,
            kv_cache_group: 0,
            hash_algo: "sha256".into(),
            none_hash_seed: DEFAULT_NONE_HASH_SEED.into(),
            weights: "checkpoint:0".into(),
        }
    }

    #[test]
    fn every_field_changes_the_fingerprint() {
        let base = layout().fingerprint();
        let variants: Vec<KvLayout> = vec![
            KvLayout {
                model_id: "other".into(),
                ..layout()
            },
            KvLayout {
                dtype: "float16".into(),
                ..layout()
            },
            KvLayout {
                block_size: 32,
                ..layout()
            },
            KvLayout {
                num_layers: 3,
                ..layout()
            },
            KvLayout {
                num_kv_heads: 8,
                ..layout()
            },
            KvLayout {
                head_size: 128,
                ..layout()
            },
            KvLayout {
                tp_rank: 1,
                ..layout()
            },
            KvLayout {
                tp_size: 2,
                ..layout()
            },
            KvLayout {
                kv_cache_group: 1,
                ..layout()
            },
            KvLayout {
                hash_algo: "sha256_cbor".into(),
                ..layout()
            },
            KvLayout {
                none_hash_seed: "42".into(),
                ..layout()
            },
            KvLayout {
                weights: "checkpoint:1".into(),
                ..layout()
            },
            // Length prefixes keep field boundaries: "m"+"bfloat16" is not "mb"+"float16".
            KvLayout {
                model_id: "mb".into(),
                dtype: "float16".into(),
                ..layout()
            },
        ];
        for v in variants {
            assert_ne!(v.fingerprint(), base, "{v:?}");
        }
    }

    #[test]
    fn kv_cache_version_takes_names_and_steps_and_names_the_key_when_bad() {
        let ok = |v: ConfigValue| parse_kv_cache_version(&v).unwrap();
        assert_eq!(
            ok(ConfigValue::Str("rl-step:12/a.b+c_d".into())),
            "rl-step:12/a.b+c_d"
        );
        assert_eq!(ok(ConfigValue::Int(1200)), "1200");
        for bad in [
            ConfigValue::Str(String::new()),
            ConfigValue::Str("has space".into()),
            ConfigValue::Str("x".repeat(129)),
            ConfigValue::Int(-1),
            ConfigValue::Bool(true),
            ConfigValue::Float(1.5),
        ] {
            let err = parse_kv_cache_version(&bad).unwrap_err().to_string();
            assert!(err.contains("kv_cache_version"), "{err}");
        }
    }

    #[test]
    fn the_key_version_follows_the_value_format() {
        // A new value format under old keys would have engines of both builds reject and
        // overwrite each other's values on one shared store.
        assert_eq!(
            KEY_VERSION,
            format!("v{}", crate::tier::value::FORMAT_VERSION)
        );
    }

    #[test]
    fn keys_are_namespaced_hex_without_hash_tags() {
        let ks = KeySpace::new("prod-a", layout().fingerprint()).unwrap();
        let key = ks.key(&[0xab, 0x01, 0xff]).unwrap();
        assert_eq!(
            key.as_str(),
            format!("prod-a:v2:{}:ab01ff", layout().fingerprint())
        );
        assert!(!key.as_str().contains('{'));
        let other = KeySpace::new("prod-b", layout().fingerprint()).unwrap();
        assert_ne!(other.key(&[0xab, 0x01, 0xff]).unwrap(), key);
    }

    #[test]
    fn bad_namespaces_and_hashes_are_rejected() {
        let fp = layout().fingerprint();
        for ns in ["", "a{b}", "with space", "quo\"te", &"x".repeat(129)] {
            let err = KeySpace::new(ns, fp).unwrap_err();
            assert!(err.to_string().contains("namespace"), "{err}");
        }
        let ks = KeySpace::new("ns", fp).unwrap();
        assert!(ks.key(&[]).is_err());
        assert!(ks.key(&[0; MAX_HASH_BYTES + 1]).is_err());
        assert!(ks.key(&[0; MAX_HASH_BYTES]).is_ok());
    }

    #[test]
    fn random_seeds_are_named_with_the_fix() {
        let msg = sharing_problem("xxhash", false).unwrap();
        assert!(
            msg.contains("PYTHONHASHSEED") && msg.contains("sha256"),
            "{msg}"
        );
        assert!(sharing_problem("xxhash_cbor", false).is_some());
        assert!(sharing_problem("xxhash", true).is_none());
        assert!(sharing_problem("sha256", false).is_none());
        assert!(sharing_problem("sha256_cbor", false).is_none());
    }
}
