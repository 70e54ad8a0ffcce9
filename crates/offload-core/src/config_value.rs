//! The values of the settings map and the parsers every settings section shares: a leaf
//! module, read by [`crate::config`] and [`crate::tier`]'s remote settings alike.

use std::fmt;

use crate::error::ConfigError;

/// One value of the key/value map, as it arrives from JSON or Python.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ConfigValue {
    /// An integer.
    Int(i128),
    /// A floating point number; accepted for byte sizes only when integral (`6.4e10`).
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A string; accepted for byte sizes when it is a plain decimal integer.
    Str(String),
    /// `null` / `None`.
    Null,
    /// A JSON array or a Python list or tuple (`remote_url`'s seeds).
    List(Vec<ConfigValue>),
    /// Any other type; the string is its type name, for the error message.
    Other(String),
}

impl fmt::Display for ConfigValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Int(v) => write!(f, "{v} (int)"),
            Self::Float(v) => write!(f, "{v} (float)"),
            Self::Bool(v) => write!(f, "{v} (bool)"),
            Self::Str(v) => write!(f, "{v:?} (str)"),
            Self::Null => f.write_str("None"),
            Self::List(items) => {
                f.write_str("[")?;
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{v}")?;
                }
                f.write_str("] (list)")
            }
            Self::Other(t) => write!(f, "a value of type {t}"),
        }
    }
}

pub(crate) fn parse_bytes(key: &str, value: &ConfigValue) -> Result<u64, ConfigError> {
    let invalid = |reason| ConfigError::InvalidValue {
        key: key.to_string(),
        value: value.to_string(),
        reason,
    };
    let n: i128 = match value {
        ConfigValue::Int(v) => *v,
        ConfigValue::Float(v) => {
            if !v.is_finite() || v.fract() != 0.0 {
                return Err(invalid("must be a whole number of bytes"));
            }
            if v.abs() > 1e30 {
                return Err(invalid("too large"));
            }
            // Integral and bounded, so the conversion is exact.
            *v as i128
        }
        ConfigValue::Str(s) => s
            .trim()
            .replace('_', "")
            .parse::<i128>()
            .map_err(|_| invalid("must be a whole number of bytes"))?,
        ConfigValue::Bool(_) | ConfigValue::Null | ConfigValue::List(_) | ConfigValue::Other(_) => {
            return Err(ConfigError::WrongType {
                key: key.to_string(),
                expected: "a positive integer number of bytes",
                got: value.to_string(),
            })
        }
    };
    if n <= 0 {
        return Err(invalid("must be a positive number of bytes"));
    }
    u64::try_from(n).map_err(|_| invalid("too large"))
}

pub(crate) fn parse_bool(key: &str, value: &ConfigValue) -> Result<bool, ConfigError> {
    match value {
        ConfigValue::Bool(b) => Ok(*b),
        ConfigValue::Str(s) => match s.trim().to_ascii_lowercase().as_str() {
            "true" => Ok(true),
            "false" => Ok(false),
            _ => Err(ConfigError::InvalidValue {
                key: key.to_string(),
                value: value.to_string(),
                reason: "must be true or false",
            }),
        },
        _ => Err(ConfigError::WrongType {
            key: key.to_string(),
            expected: "a bool",
            got: value.to_string(),
        }),
    }
}
