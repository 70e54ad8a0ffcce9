//! The request lists of a step, read straight from vLLM's `SchedulerOutput`.
//!
//! The planner's `schedule` takes plain lists so that any server can call it; vLLM's
//! connector hands it the scheduler's own objects instead. Reading their attributes here
//! spares a Python function, a tuple and an unpacking per step, and the running
//! requests' lists pass through untouched (vLLM builds them once per step already).

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PySet};

use crate::convert::type_name;
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
    let new_req_ids = PyList::empty(py);
    let new_num_computed = PyList::empty(py);
    let new_block_ids = PyList::empty(py);
    // Most steps admit no request.
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
