//! One step across the boundary: the scheduled requests in (plain lists, or read straight
//! from vLLM's `SchedulerOutput`) and the plan out.
//!
//! The planner's `schedule` takes plain lists so that any server can call it; vLLM's
//! connector hands it the scheduler's own objects instead. Reading their attributes here
//! spares a Python function, a tuple and an unpacking per step, and the running
//! requests' lists pass through untouched (vLLM builds them once per step already).

use offload_core::{ScheduleKind, ScheduledRequest, StepPlan};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyMapping, PySet, PyString, PyTuple};

use crate::convert::{block_ids, hash_bytes, ids_to_bytes, type_name, MappedHashes};
use crate::errors::INVALID_INPUT_ERROR;

/// One step's lists, in the order of `Planner.schedule`'s request arguments.
pub(crate) struct StepLists<'py> {
    pub(crate) new_req_ids: Bound<'py, PyList>,
    pub(crate) new_num_computed: Bound<'py, PyList>,
    pub(crate) new_block_ids: Bound<'py, PyList>,
    pub(crate) cached_req_ids: Bound<'py, PyList>,
    pub(crate) cached_num_computed: Bound<'py, PyList>,
    pub(crate) cached_new_block_ids: Bound<'py, PyList>,
    pub(crate) resumed_req_ids: Bound<'py, PyAny>,
    /// `{request_id: tokens}`, read only when `after_forward` asked for it.
    pub(crate) num_scheduled_tokens: Option<Bound<'py, PyAny>>,
}

/// `scheduler_output.<name>` as a list, or an error naming the attribute.
fn list_attr<'py>(
    obj: &Bound<'py, PyAny>,
    name: &Bound<'py, pyo3::types::PyString>,
) -> PyResult<Bound<'py, PyList>> {
    let v = obj.getattr(name)?;
    v.cast_into::<PyList>().map_err(|e| {
        INVALID_INPUT_ERROR.err(format!(
            "scheduler output: {name} must be a list, got {}",
            type_name(e.into_inner().as_any())
        ))
    })
}

/// Reads `scheduled_new_reqs` (their `req_id`, `num_computed_tokens`, `block_ids`),
/// `scheduled_cached_reqs` (`req_ids`, `num_computed_tokens`, `new_block_ids`,
/// `resumed_req_ids`) and, with `after_forward`, `num_scheduled_tokens`.
pub(crate) fn step_lists<'py>(
    so: &Bound<'py, PyAny>,
    after_forward: bool,
) -> PyResult<StepLists<'py>> {
    let py = so.py();
    let new = list_attr(so, intern!(py, "scheduled_new_reqs"))?;
    // Most steps admit no request: vLLM's own empty list stands for all three then.
    let (new_req_ids, new_num_computed, new_block_ids) = if new.is_empty() {
        (new.clone(), new.clone(), new.clone())
    } else {
        (PyList::empty(py), PyList::empty(py), PyList::empty(py))
    };
    for r in new.iter() {
        new_req_ids.append(r.getattr(intern!(py, "req_id"))?)?;
        new_num_computed.append(r.getattr(intern!(py, "num_computed_tokens"))?)?;
        new_block_ids.append(r.getattr(intern!(py, "block_ids"))?)?;
    }
    let cached = so.getattr(intern!(py, "scheduled_cached_reqs"))?;
    let cached_req_ids = list_attr(&cached, intern!(py, "req_ids"))?;
    let resumed_req_ids = match cached.getattr_opt(intern!(py, "resumed_req_ids"))? {
        Some(resumed) => resumed,
        // vLLM < 0.11 flagged resumed requests in a list beside `req_ids`.
        None => {
            let resumed = PySet::empty(py)?;
            if let Some(flags) = cached.getattr_opt(intern!(py, "resumed_from_preemption"))? {
                for (id, flag) in cached_req_ids.iter().zip(flags.try_iter()?) {
                    if flag?.is_truthy()? {
                        resumed.add(id)?;
                    }
                }
            }
            resumed.into_any()
        }
    };
    Ok(StepLists {
        new_req_ids,
        new_num_computed,
        new_block_ids,
        cached_num_computed: list_attr(&cached, intern!(py, "num_computed_tokens"))?,
        cached_new_block_ids: list_attr(&cached, intern!(py, "new_block_ids"))?,
        cached_req_ids,
        resumed_req_ids,
        num_scheduled_tokens: if after_forward {
            Some(so.getattr(intern!(py, "num_scheduled_tokens"))?)
        } else {
            None
        },
    })
}

/// `(id, req_id, gpu_blocks, cpu_blocks, valid, sync)`; block lists are little-endian u32 bytes.
pub(crate) type LoadTuple<'py> = (
    u64,
    String,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    bool,
    bool,
);
/// `(id, gpu_blocks, cpu_blocks, req_ids)`; block lists are little-endian u32 bytes.
pub(crate) type StoreTuple<'py> = (u64, Bound<'py, PyBytes>, Bound<'py, PyBytes>, Vec<String>);
/// With events on, what a store's KV events need, pairwise with its blocks: the hash
/// each is stored under (16 bytes, as `take_events` names it), its source (request
/// index in `req_ids` and block position; `None` for a lazy block) and, for a lazy
/// block, vLLM's own hash (`BlockHashWithGroupId`; the list is empty when no block is
/// lazy).
pub(crate) type StoreEvents<'py> = (
    Vec<Bound<'py, PyBytes>>,
    Vec<Option<(u32, u32)>>,
    Vec<Option<Py<PyAny>>>,
);
/// `(loads, store, held_gpu_blocks, store_events, store_groups)`; `store_events` is
/// `None` unless events are on and there is a store, `store_groups` empty unless the
/// planner has several KV-cache groups (see `StoreJob::groups`).
pub(crate) type StepTuple<'py> = (
    Vec<LoadTuple<'py>>,
    Option<StoreTuple<'py>>,
    Vec<u32>,
    Option<StoreEvents<'py>>,
    Vec<u32>,
);

/// A request id, which must be a `str`.
pub(crate) fn req_id(v: Bound<'_, PyAny>) -> PyResult<Bound<'_, PyString>> {
    v.cast_into::<PyString>().map_err(|e| {
        INVALID_INPUT_ERROR.err(format!(
            "request ids must be str, got {}",
            type_name(e.into_inner().as_any())
        ))
    })
}

/// The step's scheduled requests from their rows `(kind, num_computed_tokens,
/// num_scheduled_tokens, block tables)`, ids `ids` (borrowed from `names`), and hashes
/// read from `hash_lists` when the planner needs them.
pub(crate) fn scheduled_requests<'a, 'py, B>(
    rows: impl Iterator<Item = (ScheduleKind, usize, usize, B)>,
    ids: &'a [&'a str],
    names: &'a [Bound<'py, PyString>],
    hash_lists: &'a Bound<'py, PyMapping>,
) -> impl Iterator<Item = ScheduledRequest<'a, MappedHashes<'a, 'py>, B>> {
    rows.zip(ids.iter().zip(names)).map(
        move |((kind, num_computed_tokens, num_scheduled_tokens, gpu_blocks), (req_id, name))| {
            ScheduledRequest {
                req_id,
                kind,
                num_computed_tokens,
                num_scheduled_tokens,
                gpu_blocks,
                hashes: MappedHashes::new(hash_lists, name),
            }
        },
    )
}

/// Every group's ids of a `tuple[list[int], ...]` (a missing or `None` entry: none).
pub(crate) fn all_group_ids(v: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u32>>> {
    if v.is_none() {
        return Ok(Vec::new());
    }
    let t = v.cast::<PyTuple>().map_err(|_| {
        INVALID_INPUT_ERROR.err(format!(
            "block ids per KV-cache group must be a tuple of lists, got {}",
            type_name(v)
        ))
    })?;
    t.iter()
        .map(|g| {
            if g.is_none() {
                Ok(Vec::new())
            } else {
                block_ids(&g, "block_ids")
            }
        })
        .collect()
}

/// Refuses parallel lists of different lengths.
pub(crate) fn same_len(what: &str, lens: &[usize]) -> PyResult<()> {
    if lens.windows(2).all(|w| w[0] == w[1]) {
        return Ok(());
    }
    Err(INVALID_INPUT_ERROR.err(format!("schedule: {what} differ in length {lens:?}")))
}

/// The plan for Python; `lazy_hashes`: vLLM's hash of each lazy block of the store
/// (see [`StoreEvents`]).
pub(crate) fn step_to_py(
    py: Python<'_>,
    plan: StepPlan,
    lazy_hashes: Vec<Option<Py<PyAny>>>,
) -> StepTuple<'_> {
    let loads = plan
        .loads
        .into_iter()
        .map(|l| {
            (
                l.id,
                l.req_id,
                ids_to_bytes(py, &l.gpu_blocks),
                ids_to_bytes(py, &l.cpu_blocks),
                l.valid,
                l.sync,
            )
        })
        .collect();
    let mut events = None;
    let mut groups = Vec::new();
    let store = plan.store.map(|s| {
        if !s.hashes.is_empty() {
            let keys = s.hashes.into_iter().map(|h| hash_bytes(py, h)).collect();
            events = Some((keys, s.sources, lazy_hashes));
        }
        groups = s.groups;
        (
            s.id,
            ids_to_bytes(py, &s.gpu_blocks),
            ids_to_bytes(py, &s.cpu_blocks),
            s.req_ids,
        )
    });
    (loads, store, plan.held_gpu_blocks, events, groups)
}

/// [`step_to_py`], or `None` for a step that moves and holds nothing: most steps, and
/// vLLM's garbage collector tends to run at the allocation that follows its own scheduler
/// output, so those steps allocate nothing.
pub(crate) fn step_or_none(
    py: Python<'_>,
    plan: StepPlan,
    lazy_hashes: Vec<Option<Py<PyAny>>>,
) -> Option<StepTuple<'_>> {
    if plan.is_empty() && plan.held_gpu_blocks.is_empty() {
        return None;
    }
    Some(step_to_py(py, plan, lazy_hashes))
}
