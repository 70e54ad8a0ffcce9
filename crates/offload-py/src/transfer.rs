//! The `TransferEngine` class: the worker side's copy engine.

use std::time::Duration;

use offload_core::transfer::{
    BackendKind, BlockAccessError, BuildError, Completion, CudaOptions, Direction, FaultPlan,
    ReadyError, RegionSpec, SubmitError, TransferConfig, TransferEngine, TransferJob,
};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{
    config_err, DEVICE_ERROR, ENGINE_SHUTDOWN_ERROR, HOST_MEMORY_ERROR, INVALID_INPUT_ERROR,
    QUEUE_FULL_ERROR, TRANSFER_ERROR,
};

/// `(transfer_id, ok, error message or None)`.
type CompletionTuple = (u64, bool, Option<String>);

/// Maps an engine construction error to its class.
fn build_err(e: BuildError) -> PyErr {
    let msg = e.to_string();
    match e {
        BuildError::InvalidConfig { .. } => INVALID_INPUT_ERROR.err(msg),
        BuildError::Memory(_) => HOST_MEMORY_ERROR.err(msg),
        BuildError::Cuda(_) => DEVICE_ERROR.err(msg),
        _ => TRANSFER_ERROR.err(msg),
    }
}

/// Maps a refused submit to its class.
fn submit_err(e: SubmitError) -> PyErr {
    let msg = e.to_string();
    match e {
        SubmitError::DuplicateJobId { .. } => INVALID_INPUT_ERROR.err(msg),
        SubmitError::QueueFull { .. } => QUEUE_FULL_ERROR.err(msg),
        SubmitError::Shutdown { .. } => ENGINE_SHUTDOWN_ERROR.err(msg),
        _ => DEVICE_ERROR.err(msg),
    }
}

/// Maps a refused host-block access to its class.
fn block_err(e: BlockAccessError) -> PyErr {
    let msg = e.to_string();
    match e {
        BlockAccessError::NoSuchRegion { .. } | BlockAccessError::InvalidBlock { .. } => {
            INVALID_INPUT_ERROR.err(msg)
        }
        _ => TRANSFER_ERROR.err(msg),
    }
}

/// Maps a `wait_ready` failure to its class.
fn ready_err(e: ReadyError) -> PyErr {
    let msg = e.to_string();
    match e {
        ReadyError::NotReady { .. } => TRANSFER_ERROR.err(msg),
        _ => DEVICE_ERROR.err(msg),
    }
}

/// Copies KV blocks between the registered KV tensors and host memory it owns.
#[pyclass(module = "kvoffload._native", name = "TransferEngine")]
#[derive(Debug)]
pub(crate) struct PyTransferEngine {
    inner: TransferEngine,
}

fn ids_from_bytes(b: &[u8], what: &str) -> PyResult<Vec<u32>> {
    if b.len() % 4 != 0 {
        return Err(INVALID_INPUT_ERROR.err(format!(
            "{what}: {} bytes is not a whole number of u32 block ids",
            b.len()
        )));
    }
    Ok(b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn completion_tuple(c: Completion) -> CompletionTuple {
    match c.result {
        Ok(()) => (c.id, true, None),
        Err(e) => (c.id, false, Some(e.to_string())),
    }
}

fn duration(seconds: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(seconds)
        .map_err(|_| INVALID_INPUT_ERROR.err(format!("{what} must be >= 0 seconds, got {seconds}")))
}

#[pymethods]
impl PyTransferEngine {
    /// `regions`: `(address, num_blocks, block_bytes, block_stride)` of each KV span.
    ///
    /// The addresses must be live KV tensors that outlive the engine (the connector
    /// passes `tensor.data_ptr()` of the tensors vLLM registered); like ctypes, a wrong
    /// address here is memory corruption, which is why only the connector builds engines.
    ///
    /// `backend`: `"host"` (memcpy; CPU tensors) or `"cuda"` (the CUDA driver, loaded at
    /// run time; `device` is the tensors' CUDA ordinal, `cuda_batch=False` forces the
    /// `cuMemcpyAsync` loop). With `"cuda"` the host memory is pinned in the background:
    /// see `ready`.
    ///
    /// `faults`: a fault-injection spec for tests (`"fail_loads_every=3,delay_ms=5"`,
    /// see `offload_core::transfer::FaultPlan`); `None` injects nothing.
    #[new]
    #[pyo3(signature = (
        regions, num_cpu_blocks, hugepages = false, backend = "host", device = 0,
        cuda_batch = true, faults = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        regions: Vec<(u64, u32, usize, usize)>,
        num_cpu_blocks: u32,
        hugepages: bool,
        backend: &str,
        device: i32,
        cuda_batch: bool,
        faults: Option<&str>,
    ) -> PyResult<Self> {
        let faults = faults
            .map(FaultPlan::from_config_value)
            .transpose()
            .map_err(config_err)?
            .unwrap_or_default();
        let kind = match backend {
            "host" => BackendKind::Host,
            "cuda" => BackendKind::Cuda(CudaOptions {
                device,
                allow_batch: cuda_batch,
                ..CudaOptions::default()
            }),
            other => {
                return Err(INVALID_INPUT_ERROR.err(format!(
                    "backend must be \"host\" or \"cuda\", got {other:?}"
                )))
            }
        };
        let specs = regions
            .into_iter()
            .map(|(base, n, bytes, stride)| {
                // SAFETY: the caller (kvoffload's worker) passes the data pointers of the
                // KV tensors vLLM registered, which stay allocated and in place for the
                // engine's life; vLLM pins blocks while their transfers are in flight.
                unsafe { RegionSpec::new(base, n, bytes, stride) }
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| INVALID_INPUT_ERROR.err(e.to_string()))?;
        let mut config = TransferConfig {
            faults,
            ..TransferConfig::default()
        };
        config.memory.hugepages = hugepages;
        let inner = py
            .detach(|| TransferEngine::open(specs, num_cpu_blocks, config, kind))
            .map_err(build_err)?;
        Ok(Self { inner })
    }

    /// Queues one copy without blocking; block lists are little-endian u32 bytes.
    ///
    /// `wait_event`: a raw CUDA event handle (`torch.cuda.Event().cuda_event`) the copies
    /// must wait for; keep the event object alive until this transfer's completion.
    #[pyo3(signature = (transfer_id, store, gpu_blocks, cpu_blocks, wait_event = None))]
    fn submit(
        &self,
        py: Python<'_>,
        transfer_id: u64,
        store: bool,
        gpu_blocks: &[u8],
        cpu_blocks: &[u8],
        wait_event: Option<u64>,
    ) -> PyResult<()> {
        let gpu = ids_from_bytes(gpu_blocks, "gpu_blocks")?;
        let cpu = ids_from_bytes(cpu_blocks, "cpu_blocks")?;
        if gpu.len() != cpu.len() {
            return Err(INVALID_INPUT_ERROR.err(format!(
                "submit: {} GPU block ids but {} CPU block ids",
                gpu.len(),
                cpu.len()
            )));
        }
        let job = TransferJob {
            id: transfer_id,
            direction: if store {
                Direction::Store
            } else {
                Direction::Load
            },
            pairs: gpu.into_iter().zip(cpu).collect(),
            wait_event,
        };
        py.detach(|| self.inner.submit(job)).map_err(submit_err)
    }

    /// Completions received so far, without blocking.
    fn poll(&self) -> Vec<CompletionTuple> {
        let mut out = Vec::new();
        self.inner.poll_completions(&mut out);
        out.into_iter().map(completion_tuple).collect()
    }

    /// Blocks (without the GIL) until the given transfers completed; returns their
    /// completions.
    fn wait_for(
        &self,
        py: Python<'_>,
        transfer_ids: Vec<u64>,
        timeout_s: f64,
    ) -> PyResult<Vec<CompletionTuple>> {
        let timeout = duration(timeout_s, "timeout_s")?;
        let done = py
            .detach(|| self.inner.wait_for(&transfer_ids, timeout))
            .map_err(|e| TRANSFER_ERROR.err(e.to_string()))?;
        Ok(done.into_iter().map(completion_tuple).collect())
    }

    /// Stops the copy thread within `timeout_s` and releases host memory. Idempotent.
    #[pyo3(signature = (timeout_s = 5.0))]
    fn shutdown(&mut self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        let timeout = duration(timeout_s, "timeout_s")?;
        let inner = &mut self.inner;
        py.detach(|| inner.shutdown(timeout))
            .map_err(|e| ENGINE_SHUTDOWN_ERROR.err(e.to_string()))
    }

    /// Bytes of one CPU block of `region` (tests, debugging); only while nothing is in flight.
    fn read_cpu_block<'py>(
        &mut self,
        py: Python<'py>,
        region: usize,
        cpu_block: u32,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self
            .inner
            .cpu_block_slice(region, cpu_block)
            .map_err(block_err)?;
        Ok(PyBytes::new(py, bytes))
    }

    /// Overwrites one CPU block of `region` (tests that prove outputs depend on the
    /// offloaded bytes); only while nothing is in flight.
    fn write_cpu_block(&mut self, region: usize, cpu_block: u32, data: &[u8]) -> PyResult<()> {
        let block = self
            .inner
            .cpu_block_slice_mut(region, cpu_block)
            .map_err(block_err)?;
        if data.len() != block.len() {
            return Err(INVALID_INPUT_ERROR.err(format!(
                "write_cpu_block: {} bytes given for a {}-byte block",
                data.len(),
                block.len()
            )));
        }
        block.copy_from_slice(data);
        Ok(())
    }

    #[getter]
    fn num_cpu_blocks(&self) -> u32 {
        self.inner.num_cpu_blocks()
    }

    #[getter]
    fn cpu_block_bytes(&self) -> usize {
        self.inner.cpu_block_bytes()
    }

    #[getter]
    fn host_bytes(&self) -> usize {
        self.inner.host_bytes()
    }

    #[getter]
    fn backend(&self) -> &'static str {
        self.inner.backend_name()
    }

    /// E.g. `"cuda (driver 13.0, device 0, cuMemcpyBatchAsync_v2)"`.
    #[getter]
    fn backend_detail(&self) -> String {
        self.inner.backend_detail().to_owned()
    }

    /// Whether the host memory is attached (for CUDA: pinned). Transfers submitted before
    /// wait in the queue.
    #[getter]
    fn ready(&self) -> bool {
        self.inner.is_ready()
    }

    /// Blocks (without the GIL) until `ready`; raises `DeviceError` if pinning failed and
    /// `TransferError` on timeout.
    fn wait_ready(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        let timeout = duration(timeout_s, "timeout_s")?;
        py.detach(|| self.inner.wait_ready(timeout))
            .map_err(ready_err)
    }

    /// Why the engine stopped for good (a fatal device error, a failed pinning, a wait that
    /// timed out), or `None` while it works. Once stopped, every transfer fails.
    #[getter]
    fn stopped(&self) -> Option<String> {
        self.inner.stopped().map(str::to_owned)
    }

    /// Counters since construction, by name.
    fn stats(&self) -> Vec<(&'static str, u64)> {
        let s = self.inner.stats();
        vec![
            ("jobs_submitted", s.jobs_submitted),
            ("jobs_succeeded", s.jobs_succeeded),
            ("jobs_failed", s.jobs_failed),
            ("runs_submitted", s.runs_submitted),
            ("blocks_stored", s.blocks_stored),
            ("blocks_loaded", s.blocks_loaded),
            ("bytes_stored", s.bytes_stored),
            ("bytes_loaded", s.bytes_loaded),
        ]
    }
}
