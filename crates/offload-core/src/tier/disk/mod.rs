//! The disk tier: blocks in local files, below the CPU tier and above a remote store.
//!
//! It is a [`RemoteStore`](super::RemoteStore), so it takes the remote tier's whole path
//! (see [`tier`](super)): the scheduler's probe thread asks whether a prompt's next blocks
//! are on disk and answers "pending" meanwhile; the worker fetches found blocks into CPU
//! blocks the scheduler reserved, verifies them (the slot's entry: key, length, block
//! hash; the payload's checksum) and they load like any CPU hit; blocks stored on CPU
//! are written behind.
//!
//! # Written through, not spilled on eviction
//! CPU evictions are decided by the scheduler, but the bytes live in the worker; spilling
//! on eviction would put the scheduler on the disk's path (hold the block until its
//! bytes are out). Writing every stored block through, on the worker's write-behind
//! thread, keeps the scheduler off the disk entirely, and a block is on disk by the time
//! the CPU tier evicts it. A full write queue drops writes (counted), never blocks.
//!
//! # Files
//! Each rank owns `<disk_path>.rank_<N>` (data, `layout.rs` explains the slots) and
//! `<...>.idx` (entries), the index locked exclusively while open, so a second engine on
//! the same `disk_path` is refused at start.
//! Without `disk_persist` the files are emptied at start, and the data file's name is
//! removed as soon as it is open and its space reserved: the open descriptor keeps it
//! usable, and the kernel frees the space when the worker dies, however it dies (vLLM's
//! default `--shutdown-timeout 0` force-kills it, so no destructor may run). The index
//! keeps its name (it holds the lock, and the scheduler's [`DiskProbe`] opens it by path)
//! and is removed at shutdown; a force kill leaves only it (192 B per slot and 4 KiB),
//! emptied by the next engine on the path. With `disk_persist` both files stay, and the
//! next engine rebuilds its index from the entries (blocks of another layout or capacity
//! are wiped, never served).
//!
//! # Failures
//! Every read is checked on the I/O thread that made it: the slot's index entry must be
//! intact (its own checksum) and name the key's digest and this layout's block length,
//! and the payload read must sum to the entry's checksum, which is bound to the key (so
//! another block's bytes under the entry fail it too); `get_into` then compares the
//! entry's block hash with the one asked for, and the layout with the file's. A bad
//! block is a miss, counted, its slot freed and its entry cleared. A failed write is a
//! counted skip, a failed read a miss. [`DISABLE_AFTER_ERRORS`] failed I/Os in a row
//! turn the tier off (one log line, the `disk_disabled` gauge); nothing waits on a
//! failing disk.
//!
//! # Events
//! With [`DiskOptions::report_changes`], the store records which blocks each write put on
//! disk and which left it ([`DiskStore::take_changes`]), so the connector can publish
//! them as KV events of medium `"STORAGE"` (`journal.rs`).

mod aligned;
pub mod config;
mod error;
mod faults;
mod file;
mod index;
mod io_pool;
mod journal;
mod layout;
mod options;
mod reader;
mod reads;
mod recovery;
mod runs;
mod slot_io;
mod source;
mod stats;
mod store;

pub use config::DiskConfig;
pub use error::{DiskError, IoKind};
pub use index::{Placement, SlotIndex};
pub use journal::{DiskChanges, JOURNAL_HASH_BYTES};
pub use layout::ENTRY_BYTES;
pub use options::{capacity_for_blocks, DiskOptions, DEFAULT_IO_THREADS, DISABLE_AFTER_ERRORS};
pub use reader::DiskProbe;
pub use stats::{DiskSnapshot, DiskStats};
pub use store::DiskStore;
