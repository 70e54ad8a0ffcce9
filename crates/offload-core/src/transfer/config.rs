//! How an engine is built: its tunables and which backend moves the bytes.

use std::time::Duration;

use super::cuda::CudaOptions;
use super::fault::FaultPlan;
use crate::memory::HostMemoryOptions;

/// Tunables of a [`TransferEngine`](super::TransferEngine).
///
/// ```
/// use std::time::Duration;
/// use offload_core::transfer::TransferConfig;
///
/// let config = TransferConfig { queue_capacity: 16, ..TransferConfig::default() };
/// assert_eq!(config.poll_interval, Duration::from_micros(50));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferConfig {
    /// Jobs of one direction that may wait for the copy thread before `submit` returns
    /// `QueueFull`.
    pub queue_capacity: usize,
    /// Jobs of one direction submitted to the backend and not yet complete before the copy
    /// thread stops taking new ones of that direction (bounds a device backend's
    /// outstanding events).
    pub max_in_flight: usize,
    /// How long the copy thread sleeps between polls of an asynchronous backend.
    pub poll_interval: Duration,
    /// How the host memory is allocated.
    pub memory: HostMemoryOptions,
    /// Faults to inject ([`TransferEngine::open`](super::TransferEngine::open) wraps the
    /// backend when any is set).
    pub faults: FaultPlan,
}

impl Default for TransferConfig {
    fn default() -> Self {
        Self {
            queue_capacity: 1024,
            max_in_flight: 64,
            poll_interval: Duration::from_micros(50),
            memory: HostMemoryOptions::default(),
            faults: FaultPlan::default(),
        }
    }
}

/// Which backend [`TransferEngine::open`](super::TransferEngine::open) builds.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendKind {
    /// [`HostCopyBackend`](super::HostCopyBackend): both sides are host memory (CPU servers,
    /// tests).
    Host,
    /// [`CudaCopyBackend`](super::CudaCopyBackend) on the driver from
    /// [`CudaDriver::load`](super::CudaDriver::load), with these options.
    Cuda(CudaOptions),
}
