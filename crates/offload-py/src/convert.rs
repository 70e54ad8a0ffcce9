//! Conversions between Python objects and core types.

use std::cell::OnceCell;

use offload_core::{BlockHash, ConfigValue, GroupKind, HashError, HashSource, KvEvent};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyFloat, PyInt, PyList, PyMapping, PyString, PyTuple};

use crate::errors::INVALID_INPUT_ERROR;

/// A Python value as a config value; types a key cannot take become `Other(type name)`.
pub(crate) fn config_value(v: &Bound<'_, PyAny>) -> ConfigValue {
    if v.is_none() {
        ConfigValue::Null
    } else if v.is_instance_of::<PyBool>() {
        ConfigValue::Bool(v.is_truthy().unwrap_or(false))
    } else if v.is_instance_of::<PyInt>() {
        match v.extract::<i128>() {
            Ok(i) => ConfigValue::Int(i),
            Err(_) => ConfigValue::Other(format!("int {v}")),
        }
    } else if v.is_instance_of::<PyFloat>() {
        v.extract::<f64>()
            .map_or_else(|_| ConfigValue::Other("float".into()), ConfigValue::Float)
    } else if let Ok(s) = v.cast::<PyString>() {
        ConfigValue::Str(s.to_string())
    } else if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        match v.try_iter() {
            Ok(items) => ConfigValue::List(
                items
                    .map(|item| item.map_or(ConfigValue::Null, |i| config_value(&i)))
                    .collect(),
            ),
            Err(_) => ConfigValue::Other("list".into()),
        }
    } else {
        let name = v
            .get_type()
            .name()
            .map_or_else(|_| "unknown".to_string(), |n| n.to_string());
        ConfigValue::Other(name)
    }
}

/// The bytes of `list[i]` when it is exactly a `bytes` object, without taking a
/// reference.
///
/// This runs once per new block hash of every request (128 per 2048-token prompt), so it
/// uses two C API calls and a type pointer compare instead of pyo3's checked item access
/// and downcast (a `bytes` subclass takes the checked path in [`PyHashes::hash`]).
fn list_bytes<'a>(list: &'a Bound<'_, PyList>, i: usize) -> Option<&'a [u8]> {
    let index = ffi::Py_ssize_t::try_from(i).ok()?;
    let mut data: *mut std::os::raw::c_char = std::ptr::null_mut();
    let mut len: ffi::Py_ssize_t = 0;
    // SAFETY: the GIL is held (`list` is bound). `PyList_GetItem` returns a borrowed
    // reference that stays valid while `list` holds the item, which it does for `'a`: the
    // list cannot change without the GIL, which this thread keeps until the slice is
    // copied by the caller. `Py_TYPE` reads the header every object has;
    // `PyBytes_AsStringAndSize` only reads the object, which is a `bytes`.
    unsafe {
        let item = ffi::PyList_GetItem(list.as_ptr(), index);
        if item.is_null() {
            ffi::PyErr_Clear();
            return None;
        }
        if ffi::Py_TYPE(item) != std::ptr::addr_of_mut!(ffi::PyBytes_Type) {
            return None;
        }
        if ffi::PyBytes_AsStringAndSize(item, &mut data, &mut len) != 0 {
            ffi::PyErr_Clear();
            return None;
        }
        Some(std::slice::from_raw_parts(
            data.cast::<u8>(),
            usize::try_from(len).ok()?,
        ))
    }
}

/// A Python sequence of `bytes` block hashes (vLLM's `request.block_hashes`), read
/// through [`HashSource`] one entry or one run at a time, as the planner needs them.
#[derive(Debug)]
pub(crate) struct PyHashes<'py> {
    seq: Bound<'py, PyAny>,
    /// `seq` when it is a list (vLLM's case): items are read without type checks on it.
    list: Option<Bound<'py, PyList>>,
    len: Result<usize, HashError>,
}

impl<'py> PyHashes<'py> {
    pub(crate) fn new(seq: Bound<'py, PyAny>) -> Self {
        let list = seq.cast::<PyList>().ok().cloned();
        let len = match &list {
            Some(list) => Ok(list.len()),
            None => seq.len().map_err(|_| HashError {
                index: 0,
                reason: format!("expected a sequence of bytes, got {}", type_name(&seq)),
            }),
        };
        Self { seq, list, len }
    }

    /// The checked path: names what is wrong with an entry that is not plain bytes.
    fn hash_checked(&self, index: usize) -> Result<BlockHash, HashError> {
        let bad = |reason: String| HashError { index, reason };
        let item = self
            .seq
            .get_item(index)
            .map_err(|e| bad(format!("cannot be read: {e}")))?;
        let bytes = item.cast::<PyBytes>().map_err(|_| {
            bad(format!(
                "block hash must be bytes, got {}",
                type_name(&item)
            ))
        })?;
        BlockHash::from_bytes(bytes.as_bytes()).ok_or_else(|| bad("empty block hash".into()))
    }
}

impl HashSource for PyHashes<'_> {
    fn num_hashes(&self) -> Result<usize, HashError> {
        self.len.clone()
    }

    #[inline]
    fn hash(&self, index: usize) -> Result<BlockHash, HashError> {
        if let Some(list) = &self.list {
            if let Some(h) = list_bytes(list, index).and_then(BlockHash::from_bytes) {
                return Ok(h);
            }
        }
        self.hash_checked(index)
    }
}

/// A request's hash list looked up in a `{request_id: block_hashes}` mapping only when
/// the planner reads it: most running requests of a step need no hash at all.
#[derive(Debug)]
pub(crate) struct MappedHashes<'a, 'py> {
    map: &'a Bound<'py, PyMapping>,
    req_id: &'a Bound<'py, PyString>,
    hashes: OnceCell<PyHashes<'py>>,
}

impl<'a, 'py> MappedHashes<'a, 'py> {
    pub(crate) fn new(map: &'a Bound<'py, PyMapping>, req_id: &'a Bound<'py, PyString>) -> Self {
        Self {
            map,
            req_id,
            hashes: OnceCell::new(),
        }
    }

    fn get(&self) -> &PyHashes<'py> {
        self.hashes.get_or_init(|| {
            // A request missing from the mapping has no hashes yet.
            let seq = self
                .map
                .get_item(self.req_id)
                .unwrap_or_else(|_| PyList::empty(self.map.py()).into_any());
            PyHashes::new(seq)
        })
    }
}

impl HashSource for MappedHashes<'_, '_> {
    fn num_hashes(&self) -> Result<usize, HashError> {
        self.get().num_hashes()
    }

    fn hash(&self, index: usize) -> Result<BlockHash, HashError> {
        self.get().hash(index)
    }

    fn hashes_into(&self, start: usize, out: &mut [BlockHash]) -> Result<(), HashError> {
        self.get().hashes_into(start, out)
    }
}

/// One block id: a non-negative int below 2**32 - 1.
pub(crate) fn block_id(item: &Bound<'_, PyAny>, what: &str) -> PyResult<u32> {
    let v: i64 = item.extract().map_err(|_| {
        INVALID_INPUT_ERROR.err(format!(
            "{what}: block id must be an int, got {}",
            type_name(item)
        ))
    })?;
    u32::try_from(v)
        .ok()
        .filter(|v| *v != u32::MAX)
        .ok_or_else(|| INVALID_INPUT_ERROR.err(format!("{what}: invalid block id {v}")))
}

/// A sequence of block ids (`None` is empty).
pub(crate) fn block_ids(seq: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u32>> {
    if seq.is_none() {
        return Ok(Vec::new());
    }
    if let Ok(list) = seq.cast::<PyList>() {
        // Collecting a fallible iterator would grow the vector by doubling.
        let mut out = Vec::with_capacity(list.len());
        for x in list.iter() {
            out.push(block_id(&x, what)?);
        }
        return Ok(out);
    }
    let iter = seq.try_iter().map_err(|_| {
        INVALID_INPUT_ERROR.err(format!(
            "{what}: expected a sequence of ints, got {}",
            type_name(seq)
        ))
    })?;
    iter.map(|x| block_id(&x?, what)).collect()
}

/// A non-negative token count.
pub(crate) fn count(v: i64, what: &str) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| INVALID_INPUT_ERROR.err(format!("{what} must be >= 0, got {v}")))
}

pub(crate) fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type()
        .name()
        .map_or_else(|_| "unknown".to_string(), |n| n.to_string())
}

/// Block ids as little-endian `u32` bytes.
pub(crate) fn ids_to_bytes<'py>(py: Python<'py>, ids: &[u32]) -> Bound<'py, PyBytes> {
    let mut buf = Vec::with_capacity(ids.len() * 4);
    for id in ids {
        buf.extend_from_slice(&id.to_le_bytes());
    }
    PyBytes::new(py, &buf)
}

/// A 16-byte hash as Python `bytes`.
pub(crate) fn hash_bytes<'py>(py: Python<'py>, h: BlockHash) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &h.0.to_le_bytes())
}

/// A KV event as a tuple: `("stored", group, [hash], parent | None, block_size)`,
/// `("removed", group, [hash])`, `("cleared",)`.
pub(crate) fn event_tuple(py: Python<'_>, e: KvEvent) -> PyResult<Bound<'_, PyTuple>> {
    match e {
        KvEvent::Stored {
            group,
            hashes,
            parent,
            block_size,
        } => {
            let hs: Vec<_> = hashes.into_iter().map(|h| hash_bytes(py, h)).collect();
            let parent = parent.map(|h| hash_bytes(py, h));
            ("stored", group, hs, parent, block_size).into_pyobject(py)
        }
        KvEvent::Removed { group, hashes } => {
            let hs: Vec<_> = hashes.into_iter().map(|h| hash_bytes(py, h)).collect();
            ("removed", group, hs).into_pyobject(py)
        }
        KvEvent::AllCleared => ("cleared",).into_pyobject(py),
    }
}

/// KV-cache group `index`'s kind from vLLM's spec kind name and its sliding window (its
/// `sliding_window` plus `extra_retained_tokens`).
pub(crate) fn group_kind(index: usize, kind: &str, window: Option<i64>) -> PyResult<GroupKind> {
    match (kind, window) {
        ("full_attention" | "mla_attention", _) => Ok(GroupKind::FullAttention),
        ("mamba", _) => Ok(GroupKind::Mamba),
        ("sliding_window", Some(w)) => u32::try_from(w)
            .ok()
            .filter(|w| *w > 0)
            .map(|window| GroupKind::SlidingWindow { window })
            .ok_or_else(|| {
                INVALID_INPUT_ERROR.err(format!(
                    "Planner: group {index}: invalid sliding window {w}"
                ))
            }),
        _ => Err(INVALID_INPUT_ERROR.err(format!(
            "Planner: group {index}: KV-cache group kind {kind:?} (window {window:?}) cannot \
             be planned; kinds: full_attention, mla_attention, sliding_window with a window, \
             mamba"
        ))),
    }
}
