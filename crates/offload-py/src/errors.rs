//! Python exception classes, one per core error kind, all under `KVOffloadError`, and the
//! mapping of each core error to its class.

use offload_core::transfer::{BlockAccessError, BuildError, ReadyError, SubmitError};
use offload_core::{ConfigError, PlanError};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

/// A Python exception class created at import.
pub(crate) struct ErrorClass {
    name: &'static str,
    doc: &'static str,
    /// Python builtin bases besides `KVOffloadError` (looked up in `builtins`).
    builtin_bases: &'static [&'static str],
    cell: PyOnceLock<Py<PyType>>,
}

impl ErrorClass {
    const fn new(
        name: &'static str,
        doc: &'static str,
        builtin_bases: &'static [&'static str],
    ) -> Self {
        Self {
            name,
            doc,
            builtin_bases,
            cell: PyOnceLock::new(),
        }
    }

    /// An instance of this class carrying `msg`.
    pub(crate) fn err(&self, msg: impl Into<String>) -> PyErr {
        let msg = msg.into();
        Python::attach(|py| match self.cell.get(py) {
            Some(ty) => PyErr::from_type(ty.bind(py).clone(), msg),
            None => PyRuntimeError::new_err(msg),
        })
    }
}

pub(crate) static KVOFFLOAD_ERROR: ErrorClass = ErrorClass::new(
    "KVOffloadError",
    "Base class of every kvoffload error.",
    &["Exception"],
);
pub(crate) static CONFIG_ERROR: ErrorClass = ErrorClass::new(
    "ConfigError",
    "An invalid kv_connector_extra_config value; the message names the key and the value.",
    &["ValueError"],
);
pub(crate) static INVALID_INPUT_ERROR: ErrorClass = ErrorClass::new(
    "InvalidInputError",
    "An argument of the wrong type or out of range (a negative block id, a hash that is not bytes, lists of different lengths).",
    &["ValueError"],
);
pub(crate) static UNKNOWN_REQUEST_ERROR: ErrorClass = ErrorClass::new(
    "UnknownRequestError",
    "A request id the planner does not track.",
    &["LookupError"],
);
pub(crate) static UNKNOWN_TRANSFER_ERROR: ErrorClass = ErrorClass::new(
    "UnknownTransferError",
    "A completion for a transfer the planner did not issue or already retired.",
    &["LookupError"],
);
pub(crate) static TRANSFER_ERROR: ErrorClass = ErrorClass::new(
    "TransferError",
    "A copy between GPU and CPU blocks could not be done.",
    &["RuntimeError"],
);
pub(crate) static QUEUE_FULL_ERROR: ErrorClass = ErrorClass::new(
    "QueueFullError",
    "The copy thread's queue is full; the batch was not submitted.",
    &["RuntimeError"],
);
pub(crate) static ENGINE_SHUTDOWN_ERROR: ErrorClass = ErrorClass::new(
    "EngineShutdownError",
    "The transfer engine was shut down.",
    &["RuntimeError"],
);
pub(crate) static DEVICE_ERROR: ErrorClass = ErrorClass::new(
    "DeviceError",
    "The copy backend (memcpy or the CUDA driver) failed; fatal device errors are sticky.",
    &["RuntimeError"],
);
pub(crate) static HOST_MEMORY_ERROR: ErrorClass = ErrorClass::new(
    "HostMemoryError",
    "Host memory for the CPU pool could not be allocated.",
    &["MemoryError"],
);

pub(crate) static REMOTE_TIER_ERROR: ErrorClass = ErrorClass::new(
    "RemoteTierError",
    "The remote tier's store could not be reached or used (kvoffload runs without it).",
    &["RuntimeError"],
);

/// Every class but the base, in the order they are created.
static SUBCLASSES: [&ErrorClass; 10] = [
    &CONFIG_ERROR,
    &INVALID_INPUT_ERROR,
    &UNKNOWN_REQUEST_ERROR,
    &UNKNOWN_TRANSFER_ERROR,
    &TRANSFER_ERROR,
    &QUEUE_FULL_ERROR,
    &ENGINE_SHUTDOWN_ERROR,
    &DEVICE_ERROR,
    &HOST_MEMORY_ERROR,
    &REMOTE_TIER_ERROR,
];

fn create(
    py: Python<'_>,
    class: &ErrorClass,
    parent: Option<&Bound<'_, PyType>>,
) -> PyResult<Py<PyType>> {
    let builtins = py.import("builtins")?;
    let mut bases: Vec<Bound<'_, PyAny>> = Vec::new();
    if let Some(p) = parent {
        bases.push(p.clone().into_any());
    }
    for b in class.builtin_bases {
        bases.push(builtins.getattr(*b)?);
    }
    let ns = PyDict::new(py);
    ns.set_item("__module__", "kvoffload._native")?;
    ns.set_item("__doc__", class.doc)?;
    let ty = builtins
        .getattr("type")?
        .call1((class.name, PyTuple::new(py, bases)?, ns))?;
    Ok(ty.cast_into::<PyType>()?.unbind())
}

/// Creates the classes and adds them to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let base = KVOFFLOAD_ERROR
        .cell
        .get_or_try_init(py, || create(py, &KVOFFLOAD_ERROR, None))?
        .bind(py)
        .clone();
    m.add(KVOFFLOAD_ERROR.name, &base)?;
    for class in SUBCLASSES {
        let ty = class
            .cell
            .get_or_try_init(py, || create(py, class, Some(&base)))?;
        m.add(class.name, ty.bind(py))?;
    }
    Ok(())
}

/// Maps a config error to `ConfigError`.
pub(crate) fn config_err(e: ConfigError) -> PyErr {
    CONFIG_ERROR.err(e.to_string())
}

/// Maps each planner error kind to its class.
pub(crate) fn plan_err(e: PlanError) -> PyErr {
    let msg = e.to_string();
    match e {
        PlanError::UnknownRequest(_) => UNKNOWN_REQUEST_ERROR.err(msg),
        PlanError::UnknownTransfer(_) => UNKNOWN_TRANSFER_ERROR.err(msg),
        PlanError::BadHash { .. } => INVALID_INPUT_ERROR.err(msg),
        _ => KVOFFLOAD_ERROR.err(msg),
    }
}

/// Maps an engine construction error to its class.
pub(crate) fn build_err(e: BuildError) -> PyErr {
    let msg = e.to_string();
    match e {
        BuildError::InvalidConfig { .. } => INVALID_INPUT_ERROR.err(msg),
        BuildError::Memory(_) => HOST_MEMORY_ERROR.err(msg),
        BuildError::Cuda(_) => DEVICE_ERROR.err(msg),
        _ => TRANSFER_ERROR.err(msg),
    }
}

/// Maps a refused submit to its class.
pub(crate) fn submit_err(e: SubmitError) -> PyErr {
    let msg = e.to_string();
    match e {
        SubmitError::DuplicateJobId { .. } => INVALID_INPUT_ERROR.err(msg),
        SubmitError::QueueFull { .. } => QUEUE_FULL_ERROR.err(msg),
        SubmitError::Shutdown { .. } => ENGINE_SHUTDOWN_ERROR.err(msg),
        SubmitError::Detached { .. } => TRANSFER_ERROR.err(msg),
        _ => DEVICE_ERROR.err(msg),
    }
}

/// Maps a refused host-block access to its class.
pub(crate) fn block_err(e: BlockAccessError) -> PyErr {
    let msg = e.to_string();
    match e {
        BlockAccessError::NoSuchRegion { .. } | BlockAccessError::InvalidBlock { .. } => {
            INVALID_INPUT_ERROR.err(msg)
        }
        _ => TRANSFER_ERROR.err(msg),
    }
}

/// Maps a `wait_ready` failure to its class.
pub(crate) fn ready_err(e: ReadyError) -> PyErr {
    let msg = e.to_string();
    match e {
        ReadyError::NotReady { .. } => TRANSFER_ERROR.err(msg),
        _ => DEVICE_ERROR.err(msg),
    }
}
