//! Error types of the engine, one enum per concern.

use thiserror::Error;

/// An invalid value in the offload configuration.
///
/// Every variant names the key and the offending value, so an operator can find the
/// mistake in `kv_connector_extra_config` without reading code.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The value has a type the key does not accept (a bool where bytes are expected, a list, ...).
    #[error("kvoffload config key `{key}`: expected {expected}, got {got}")]
    WrongType {
        /// The configuration key.
        key: String,
        /// What the key accepts.
        expected: &'static str,
        /// The value that was given, with its type.
        got: String,
    },
    /// The value has the right type but is out of range (zero, negative, not an integer).
    #[error("kvoffload config key `{key}`: invalid value {value}: {reason}")]
    InvalidValue {
        /// The configuration key.
        key: String,
        /// The value that was given.
        value: String,
        /// Why it is rejected.
        reason: &'static str,
    },
    /// A value that is not part of any key (world size, block geometry) is out of range.
    #[error("kvoffload: invalid {what}: {value} ({reason})")]
    InvalidGeometry {
        /// What was invalid (for example `world_size`).
        what: &'static str,
        /// The value that was given.
        value: u64,
        /// Why it is rejected.
        reason: &'static str,
    },
}

/// A hash that could not be read from a [`HashSource`](crate::HashSource).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("block_hashes[{index}]: {reason}")]
pub struct HashError {
    /// Position of the bad entry.
    pub index: usize,
    /// What is wrong with it.
    pub reason: String,
}

/// A caller broke the planner's protocol (unknown request, ids out of range, ...).
///
/// These are bugs in the embedding code or malformed input; the planner state is left
/// unchanged when one is returned.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum PlanError {
    /// A request id the planner has never seen, or one that already finished.
    #[error("unknown request `{0}`")]
    UnknownRequest(String),
    /// A completion names a transfer the planner did not issue or already retired.
    #[error("unknown transfer id {0}")]
    UnknownTransfer(u64),
    /// A request's block hash could not be read.
    #[error("request `{req_id}`: {source}")]
    BadHash {
        /// The request whose hash list is malformed.
        req_id: String,
        /// Which entry, and why.
        source: HashError,
    },
    /// A call gave block tables for another number of KV-cache groups than the planner
    /// was built with.
    #[error("request `{req_id}`: {got} KV-cache groups given, the planner has {expected}")]
    GroupMismatch {
        /// The request the call was about.
        req_id: String,
        /// The planner's groups.
        expected: usize,
        /// The groups the call gave.
        got: usize,
    },
}
