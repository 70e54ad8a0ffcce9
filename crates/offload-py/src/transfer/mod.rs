//! The `TransferEngine` class: the worker side's copy engine.

mod regions;

use std::time::Duration;

use offload_core::transfer::{
    AttachError, BackendKind, Completion, CudaOptions, Direction, FaultPlan, RegionSpec,
    TransferConfig, TransferEngine, TransferJob,
};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{
    block_err, build_err, config_err, ready_err, submit_err, DEVICE_ERROR, ENGINE_SHUTDOWN_ERROR,
    INVALID_INPUT_ERROR, TRANSFER_ERROR,
};
use regions::checked_regions;

/// `(transfer_id, ok, error message or None)`.
type CompletionTuple = (u64, bool, Option<String>);

/// Copies KV blocks between the registered KV tensors and host memory it owns.
#[pyclass(module = "kvoffload._native", name = "TransferEngine")]
#[derive(Debug)]
pub(crate) struct PyTransferEngine {
    pub(crate) inner: TransferEngine,
    /// The tensors the regions lie in, referenced while the copy thread may touch them.
    held: Vec<Py<PyAny>>,
    /// What regions given to `register` are checked against (their tensors' device).
    kind: BackendKind,
}

impl Drop for PyTransferEngine {
    fn drop(&mut self) {
        // A shutdown that times out leaves the copy thread running; the worker adapter logs
        // its own shutdown failures, so the error itself has nobody left to tell here.
        let _ = self.inner.shutdown(DROP_SHUTDOWN_TIMEOUT);
        if !self.inner.copy_thread_exited() {
            // The copy thread may still write into these tensors: never free them.
            std::mem::forget(std::mem::take(&mut self.held));
        }
    }
}

/// How long dropping an engine waits for its copy thread.
const DROP_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);

fn backend_kind(backend: &str, device: i32, cuda_batch: bool) -> PyResult<BackendKind> {
    match backend {
        "host" => Ok(BackendKind::Host),
        "cuda" => Ok(BackendKind::Cuda(CudaOptions {
            device,
            allow_batch: cuda_batch,
            ..CudaOptions::default()
        })),
        other => Err(INVALID_INPUT_ERROR.err(format!(
            "backend must be \"host\" or \"cuda\", got {other:?}"
        ))),
    }
}

/// Builds the engine (without the GIL: the CUDA driver loads here).
fn open(
    py: Python<'_>,
    specs: Vec<RegionSpec>,
    num_cpu_blocks: u32,
    hugepages: bool,
    kind: BackendKind,
    faults: Option<&str>,
) -> PyResult<TransferEngine> {
    let faults = faults
        .map(FaultPlan::from_config_value)
        .transpose()
        .map_err(config_err)?
        .unwrap_or_default();
    let mut config = TransferConfig {
        faults,
        ..TransferConfig::default()
    };
    config.memory.hugepages = hugepages;
    py.detach(|| TransferEngine::open(specs, num_cpu_blocks, config, kind))
        .map_err(build_err)
}

pub(crate) fn ids_from_bytes(b: &[u8], what: &str) -> PyResult<Vec<u32>> {
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
    /// An engine over KV tensors the caller registered.
    ///
    /// `regions`: `(address, num_blocks, block_bytes, block_stride)` of each KV span, and
    /// `tensors`: the tensors they lie in. Every region is checked to lie inside the storage
    /// (`untyped_storage()`) of one of `tensors`, on the device the backend copies on (CPU
    /// for `"host"`, `cuda:<device>` for `"cuda"`), and the engine keeps a reference to
    /// every tensor for as long as its copy thread may touch them (for ever, if the copy
    /// thread does not stop). Resizing a registered tensor's storage while the engine lives
    /// is not checked; vLLM never does.
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
        regions, num_cpu_blocks, tensors, hugepages = true, backend = "host", device = 0,
        cuda_batch = true, faults = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        regions: Vec<(u64, u32, usize, usize)>,
        num_cpu_blocks: u32,
        tensors: Vec<Bound<'_, PyAny>>,
        hugepages: bool,
        backend: &str,
        device: i32,
        cuda_batch: bool,
        faults: Option<&str>,
    ) -> PyResult<Self> {
        let kind = backend_kind(backend, device, cuda_batch)?;
        let specs = checked_regions(regions, &tensors, &kind)?;
        let inner = open(py, specs, num_cpu_blocks, hugepages, kind.clone(), faults)?;
        Ok(Self {
            inner,
            held: tensors.into_iter().map(Bound::unbind).collect(),
            kind,
        })
    }

    /// UNCHECKED: an engine over raw addresses, for tests and tools that own their memory.
    ///
    /// Nothing verifies that an address is live, large enough, on the right device or kept
    /// alive: a wrong one is memory corruption, as with ctypes. Use the constructor, which
    /// checks regions against registered tensors, everywhere else.
    #[staticmethod]
    #[pyo3(signature = (
        regions, num_cpu_blocks, hugepages = true, backend = "host", device = 0,
        cuda_batch = true, faults = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn _unchecked(
        py: Python<'_>,
        regions: Vec<(u64, u32, usize, usize)>,
        num_cpu_blocks: u32,
        hugepages: bool,
        backend: &str,
        device: i32,
        cuda_batch: bool,
        faults: Option<&str>,
    ) -> PyResult<Self> {
        let kind = backend_kind(backend, device, cuda_batch)?;
        let specs = regions
            .into_iter()
            .map(|(base, n, bytes, stride)| {
                // SAFETY: none taken here: this constructor is documented as unchecked, and
                // its caller vouches for every address as `RegionSpec::new` requires.
                unsafe { RegionSpec::new(base, n, bytes, stride) }
                    .map_err(|e| INVALID_INPUT_ERROR.err(e.to_string()))
            })
            .collect::<PyResult<Vec<_>>>()?;
        let inner = open(py, specs, num_cpu_blocks, hugepages, kind.clone(), faults)?;
        Ok(Self {
            inner,
            held: Vec::new(),
            kind,
        })
    }

    /// Queues one copy without blocking; block lists are little-endian u32 bytes.
    ///
    /// `wait_event`: UNCHECKED raw CUDA event handle (`torch.cuda.Event().cuda_event`) the
    /// copies must wait for; keep the event object alive until this transfer's completion.
    /// The driver rejects some bad handles, but a dangling one is undefined behaviour.
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

    /// Stops copying to and from the KV tensors (their memory is about to be released,
    /// e.g. vLLM's sleep mode): later submits are refused, queued transfers fail without
    /// copying (each still completes), and the call returns once no copy touches the
    /// tensors, which it then lets go of. Waits at most `timeout_s` (without the GIL);
    /// past it the engine stops for good and this raises (`DeviceError`). Idempotent.
    #[pyo3(signature = (timeout_s = 5.0))]
    fn unregister(&mut self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        let timeout = duration(timeout_s, "timeout_s")?;
        let inner = &self.inner;
        py.detach(|| inner.detach_regions(timeout))
            .map_err(|e| DEVICE_ERROR.err(e.to_string()))?;
        self.held.clear();
        Ok(())
    }

    /// Copies use these KV tensors again (after `unregister`): the same shape of regions
    /// as at construction (addresses may differ), checked against `tensors` as the
    /// constructor checks them, and kept referenced from now on.
    fn register(
        &mut self,
        regions: Vec<(u64, u32, usize, usize)>,
        tensors: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let specs = checked_regions(regions, &tensors, &self.kind)?;
        // SAFETY: every region lies in the storage of one of `tensors`, on the backend's
        // device (checked above), and `held` keeps those tensors alive while attached.
        unsafe { self.inner.attach_regions(specs) }.map_err(|e| match e {
            AttachError::Mismatch { .. } => INVALID_INPUT_ERROR.err(e.to_string()),
            _ => DEVICE_ERROR.err(e.to_string()),
        })?;
        self.held = tensors.into_iter().map(Bound::unbind).collect();
        Ok(())
    }

    /// Whether copies may touch the KV tensors (not unregistered).
    #[getter]
    fn registered(&self) -> bool {
        self.inner.is_attached()
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
