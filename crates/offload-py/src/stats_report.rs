//! The planner's counters as vLLM's stats payload wants them: what changed since the
//! previous report. vLLM asks after every step; comparing here keeps that call from
//! building and diffing every counter in Python.

use offload_core::{Planner, PlannerStats};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyString};

use crate::tier::tier_counters;

/// What was last reported.
#[derive(Debug, Default)]
pub(crate) struct StatsReport {
    /// The counters as of the last report.
    reported: PlannerStats,
    /// The remote tier's counters at the previous report, in `remote_counters` order.
    reported_remote: Vec<u64>,
    /// `(cpu_blocks_used, cpu_blocks_capacity)` at the previous report.
    reported_gauges: Option<(usize, usize)>,
}

/// A report: the counters that grew (`{name: increase}`) and the gauges whose value
/// changed.
pub(crate) type Report<'py> = (Bound<'py, PyDict>, Bound<'py, PyDict>);

impl StatsReport {
    /// What changed since the previous call: the counters that grew and the gauges
    /// (`cpu_blocks_used`: cached or being written; `cpu_blocks_capacity`) whose value
    /// changed; `None` when nothing did.
    pub(crate) fn take<'py>(
        &mut self,
        py: Python<'py>,
        planner: &Planner,
    ) -> PyResult<Option<Report<'py>>> {
        let now = planner.stats();
        let cache = planner.cache();
        let used = cache.capacity() as usize - cache.pool().num_free();
        let capacity = cache.capacity() as usize;
        let remote = remote_counters(planner);
        let unchanged = now == self.reported
            && self.reported_gauges == Some((used, capacity))
            && remote.len() == self.reported_remote.len()
            && remote
                .iter()
                .zip(&self.reported_remote)
                .all(|((_, v), was)| v == was);
        if unchanged {
            return Ok(None);
        }
        // Built every step: the names are made once, not per report.
        static NAMES: PyOnceLock<Vec<Py<PyString>>> = PyOnceLock::new();
        let names = NAMES.get_or_init(py, || {
            counters(&PlannerStats::default())
                .iter()
                .map(|(name, _)| PyString::intern(py, name).unbind())
                .collect()
        });
        let deltas = PyDict::new(py);
        let pairs = counters(&now).into_iter().zip(counters(&self.reported));
        for (name, ((_, v), (_, was))) in names.iter().zip(pairs) {
            if v != was {
                deltas.set_item(name.bind(py), v.saturating_sub(was))?;
            }
        }
        self.reported = now;
        if self.reported_remote.len() != remote.len() {
            self.reported_remote = vec![0; remote.len()];
        }
        for ((name, v), was) in remote.into_iter().zip(&mut self.reported_remote) {
            if v != *was {
                deltas.set_item(name, v.saturating_sub(*was))?;
                *was = v;
            }
        }
        let gauges = PyDict::new(py);
        let (was_used, was_capacity) = self.reported_gauges.unzip();
        if was_used != Some(used) {
            gauges.set_item(intern!(py, "cpu_blocks_used"), used)?;
        }
        if was_capacity != Some(capacity) {
            gauges.set_item(intern!(py, "cpu_blocks_capacity"), capacity)?;
        }
        self.reported_gauges = Some((used, capacity));
        Ok(Some((deltas, gauges)))
    }
}

/// Every counter by name: the planner's and the remote tier's.
pub(crate) fn all_counters(planner: &Planner) -> Vec<(&'static str, u64)> {
    let mut out = counters(&planner.stats()).to_vec();
    out.extend(remote_counters(planner));
    out
}

/// The planner's counters by name, in one place for every reader.
fn counters(s: &PlannerStats) -> [(&'static str, u64); 12] {
    [
        ("lookups", s.lookups),
        ("cached_lookups", s.cached_lookups),
        ("hit_tokens", s.hit_tokens),
        ("load_blocks", s.load_blocks),
        ("store_blocks", s.store_blocks),
        ("stored_blocks", s.stored_blocks),
        ("dedup_skipped", s.dedup_skipped),
        ("no_space_skipped", s.no_space_skipped),
        ("evicted_blocks", s.evicted_blocks),
        ("failed_loads", s.failed_loads),
        ("failed_stores", s.failed_stores),
        ("rewritten_hash_lists", s.rewritten_hash_lists),
    ]
}

/// The remote tier's counters by name (scheduler side and its probes); none without one.
pub(crate) fn remote_counters(planner: &Planner) -> Vec<(&'static str, u64)> {
    let Some((r, t)) = planner.remote_stats() else {
        return Vec::new();
    };
    let mut out = vec![
        ("remote_pending_lookups", r.pending_lookups),
        ("remote_fetches", r.fetches),
        ("remote_fetch_blocks", r.fetch_blocks),
        ("remote_fetched_blocks", r.fetched_blocks),
        ("remote_failed_fetch_blocks", r.failed_fetch_blocks),
        ("remote_hit_tokens", r.remote_hit_tokens),
        ("remote_skipped_failed", r.skipped_failed),
    ];
    out.extend(tier_counters(&t));
    out
}
