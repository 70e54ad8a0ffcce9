//! What can go wrong with the disk tier: at start (an error naming the path) and per I/O
//! (a kind, counted; the block is skipped or missed).

use std::path::PathBuf;

use thiserror::Error;

/// The disk tier could not start.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum DiskError {
    /// A file could not be opened or created (named with the key it comes from, so an
    /// operator knows which setting to change).
    #[error("disk tier: cannot open {path} (disk_path): {reason}")]
    Open {
        /// The file.
        path: PathBuf,
        /// What the system said.
        reason: String,
    },
    /// Another engine (or rank) uses the files.
    #[error("disk tier: {path} is locked by another engine; give each engine its own disk_path")]
    Locked {
        /// The locked file.
        path: PathBuf,
    },
    /// The capacity could not be reserved.
    #[error("disk tier: cannot reserve {bytes} bytes for {path} (disk_capacity_bytes): {reason}")]
    Space {
        /// The file.
        path: PathBuf,
        /// Bytes asked for.
        bytes: u64,
        /// What the system said.
        reason: String,
    },
    /// The capacity holds not one block.
    #[error(
        "disk tier: disk_capacity_bytes={capacity} holds no block of {block_bytes} bytes \
         (in a slot of whole 4 KiB pages, with its 128-byte index entry and a 4 KiB header)"
    )]
    TooSmall {
        /// The capacity given.
        capacity: u64,
        /// Bytes of one block.
        block_bytes: u64,
    },
}

/// Why one read or write failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum IoKind {
    /// `ENOSPC` or `EDQUOT`.
    NoSpace,
    /// `EIO`.
    Io,
    /// `EINVAL` (an alignment the file system refuses).
    Invalid,
    /// Fewer bytes than asked for.
    Short,
    /// Anything else.
    Other,
}

impl IoKind {
    /// The kind's name in messages and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Self::NoSpace => "enospc",
            Self::Io => "eio",
            Self::Invalid => "einval",
            Self::Short => "short",
            Self::Other => "other",
        }
    }
}
