//! The settings of a [`CudaCopyBackend`](super::CudaCopyBackend), apart from the backend so
//! that an engine's config can name them without depending on the backend itself.

use super::{CudaError, DEFAULT_PIN_CHUNK_BYTES, PIN_CHUNK_ALIGN};

/// Settings of a [`CudaCopyBackend`](super::CudaCopyBackend).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaOptions {
    /// Device ordinal (as PyTorch numbers it: `tensor.device.index`) whose primary context
    /// is used.
    pub device: i32,
    /// Use `cuMemcpyBatchAsync` when the driver has it; `false` forces the `cuMemcpyAsync`
    /// loop (for comparisons).
    pub allow_batch: bool,
    /// Most bytes pinned by one `cuMemHostRegister` call; a multiple of
    /// [`PIN_CHUNK_ALIGN`]. Copies never cross a chunk boundary on the host side.
    pub pin_chunk_bytes: usize,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            device: 0,
            allow_batch: true,
            pin_chunk_bytes: DEFAULT_PIN_CHUNK_BYTES,
        }
    }
}

impl CudaOptions {
    /// Refuses a value the backend cannot work with, naming it.
    pub(super) fn validate(&self) -> Result<(), CudaError> {
        if self.pin_chunk_bytes == 0 || self.pin_chunk_bytes % PIN_CHUNK_ALIGN != 0 {
            return Err(CudaError::InvalidOption {
                field: "pin_chunk_bytes",
                value: self.pin_chunk_bytes.to_string(),
                reason: "must be a positive multiple of 4096",
            });
        }
        if self.device < 0 {
            return Err(CudaError::InvalidOption {
                field: "device",
                value: self.device.to_string(),
                reason: "must be >= 0",
            });
        }
        Ok(())
    }
}
