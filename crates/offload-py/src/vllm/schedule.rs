//! One vLLM step into the core: the scheduled requests of a `SchedulerOutput` (or the
//! same lists passed plainly) become the core's `ScheduledRequest`s, with every KV-cache
//! group's block table, and running requests that fill no block are left out (see
//! [`super::running`]).

use offload_core::{LazyCandidate, Planner, ScheduleKind, StepPlan};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyMapping, PyString};

use super::running::RunningWatch;
use super::step::{all_group_ids, req_id, same_len, scheduled_requests, StepLists};
use crate::convert::count;
use crate::errors::{plan_err, INVALID_INPUT_ERROR};

/// The step's plan for the scheduled requests in vLLM's lists (`hash_lists` maps request
/// ids to their `block_hashes`; the lists' `num_scheduled_tokens`, vLLM's own dict, is
/// read for planners whose stores run after the forward pass) and the lazy candidates
/// `lazy`.
pub(crate) fn plan_requests<'py>(
    planner: &mut Planner,
    running: &mut RunningWatch,
    lists: &StepLists<'py>,
    hash_lists: &Bound<'py, PyMapping>,
    lazy: Vec<LazyCandidate>,
) -> PyResult<StepPlan> {
    let StepLists {
        new_req_ids,
        new_num_computed,
        new_block_ids,
        cached_req_ids,
        cached_num_computed,
        cached_new_block_ids,
        resumed_req_ids,
        num_scheduled_tokens,
    } = lists;
    let num_scheduled_tokens = num_scheduled_tokens
        .as_ref()
        .map(|m| m.cast::<PyMapping>())
        .transpose()?;
    same_len(
        "new request lists",
        &[
            new_req_ids.len(),
            new_num_computed.len(),
            new_block_ids.len(),
        ],
    )?;
    same_len(
        "cached request lists",
        &[
            cached_req_ids.len(),
            cached_num_computed.len(),
            cached_new_block_ids.len(),
        ],
    )?;
    // Request ids are borrowed from the Python strings (kept alive in `names`): no
    // allocation per request per step.
    let n = new_req_ids.len() + cached_req_ids.len();
    let mut names: Vec<Bound<'py, PyString>> = Vec::with_capacity(n);
    // Every KV-cache group's table.
    let mut rows: Vec<(ScheduleKind, usize, usize, Vec<Vec<u32>>)> = Vec::with_capacity(n);
    let tables = |v: &Bound<'py, PyAny>| all_group_ids(v);
    let scheduled_tokens = |name: &Bound<'py, PyString>| -> PyResult<usize> {
        let Some(map) = num_scheduled_tokens else {
            return Ok(0);
        };
        // vLLM's is a dict: its lookup skips the generic mapping protocol.
        let n = match map.cast::<PyDict>() {
            Ok(dict) => dict.get_item(name)?.ok_or_else(|| {
                INVALID_INPUT_ERROR.err(format!(
                    "num_scheduled_tokens has no entry for request {name}"
                ))
            })?,
            Err(_) => map.get_item(name)?,
        };
        count(n.extract()?, "num_scheduled_tokens")
    };
    for i in 0..new_req_ids.len() {
        let name = req_id(new_req_ids.get_item(i)?)?;
        let nct = count(
            new_num_computed.get_item(i)?.extract()?,
            "num_computed_tokens",
        )?;
        let ids = tables(&new_block_ids.get_item(i)?)?;
        rows.push((ScheduleKind::New, nct, scheduled_tokens(&name)?, ids));
        names.push(name);
    }
    let any_resumed = resumed_req_ids.len().unwrap_or(0) > 0;
    // Eager: running requests that fill no block skip the core (see `store_due`).
    let watch = planner.reads_scheduled_requests();
    if watch {
        running.begin(n);
    }
    // (place in the watch, index in `names`) of requests passed to the core.
    let mut passed: Vec<(usize, usize)> = Vec::new();
    for i in 0..cached_req_ids.len() {
        let name = req_id(cached_req_ids.get_item(i)?)?;
        let nct = count(
            cached_num_computed.get_item(i)?.extract()?,
            "num_computed_tokens",
        )?;
        let table = cached_new_block_ids.get_item(i)?;
        let kind = if any_resumed && resumed_req_ids.contains(&name)? {
            ScheduleKind::Resumed
        } else {
            ScheduleKind::Running
        };
        let scheduled = scheduled_tokens(&name)?;
        if watch {
            if kind == ScheduleKind::Running
                && table.is_none()
                && running.skips(&name, nct + scheduled)
            {
                continue;
            }
            passed.push((running.passed(&name), names.len()));
        }
        rows.push((kind, nct, scheduled, tables(&table)?));
        names.push(name);
    }
    if watch {
        // Next step, the requests admitted now run after the ones already running.
        for (i, name) in names.iter().enumerate().take(new_req_ids.len()) {
            passed.push((running.passed(name), i));
        }
    }
    let mut ids: Vec<&str> = Vec::with_capacity(names.len());
    for name in &names {
        ids.push(name.to_str()?);
    }
    let scheduled = scheduled_requests(rows.into_iter(), &ids, &names, hash_lists);
    let plan = planner.schedule(scheduled, lazy);
    if watch {
        // Recorded even when the step failed: the core kept the other requests.
        for (place, i) in passed {
            if let Some(due) = planner.store_due(ids[i]) {
                running.set_due(place, due);
            }
        }
        running.end();
    }
    plan.map_err(plan_err)
}
